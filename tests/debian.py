"""Install a Debian package when the program a test needs is missing (the tests run as root).

    path, why = install_if_missing("etcd-server", lambda: shutil.which("etcd"))

Returns (what `find()` returns once it finds it, "") or (None, why it could not be had): the
fixture then skips with that reason.
"""

from __future__ import annotations

import os
import subprocess
from typing import Callable

APT_TIMEOUT_S = 600          # apt-get install of one package, downloads included


def install_if_missing(package: str, find: Callable[[], str | None]) -> tuple[str | None, str]:
    """`find()`'s answer, installing `package` first if it has none."""
    found = find()
    if found:
        return found, ""
    why = ""
    # Install; if that fails, the package lists may be stale or missing: update them, once.
    for command in (["install", "-y", package], ["update"], ["install", "-y", package]):
        why = _apt(command)
        found = find()
        if found:
            return found, ""
    return None, f"apt-get install {package} failed: {why}"


def _apt(command: list[str]) -> str:
    """Run apt-get `command`; "" or why it failed."""
    try:
        done = subprocess.run(["apt-get", *command], capture_output=True, text=True,
                              timeout=APT_TIMEOUT_S,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return "" if done.returncode == 0 else done.stderr.strip()[-500:]
