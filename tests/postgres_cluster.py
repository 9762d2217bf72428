"""A real PostgreSQL for tests: one server on a free 127.0.0.1 port with a private data dir.

    pg = PostgresServer().start()          # initdb, start, wait until it accepts connections
    pg.dsn                                 # "host=127.0.0.1 port=P user=postgres dbname=postgres"
    pg.terminate(application_name="kera-outbox")   # pg_terminate_backend on those sessions
    pg.wait_session("kera-outbox", timeout_s=20)   # until such a session is connected (again)
    pg.stop()                              # fast shutdown, then the data dir is removed

`postgres_bin_dir()` installs Debian's `postgresql` when no `initdb` is found (on the PATH or in
/usr/lib/postgresql/*/bin). PostgreSQL refuses to run as root, so the server runs as the
`postgres` user (made by the package; `nobody` otherwise) in a data dir it owns, created outside
pytest's tmp dirs (those are private to root, and the server could not enter them).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from kera.cli.local import free_port
from tests.debian import install_if_missing

HOST = "127.0.0.1"
READY_TIMEOUT_S = 30.0       # server started -> accepts a connection
POLL_INTERVAL_S = 0.1
CONNECT_TIMEOUT_S = 2        # one readiness probe (libpq's connect_timeout is whole seconds)
INITDB_TIMEOUT_S = 120
STOP_TIMEOUT_S = 10.0
SERVER_USERS = ("postgres", "nobody")


def _find_bin_dir() -> str | None:
    found = shutil.which("initdb")
    if found:
        return str(Path(os.path.realpath(found)).parent)
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return str(Path(dirs[-1]).parent) if dirs else None


def postgres_bin_dir() -> tuple[str | None, str]:
    """(directory holding initdb and postgres, "") or (None, why they cannot be had)."""
    return install_if_missing("postgresql", _find_bin_dir)


def _server_user() -> pwd.struct_passwd:
    for name in SERVER_USERS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(f"none of the users {SERVER_USERS} exists to run PostgreSQL as")


class PostgresServer:
    def __init__(self, bin_dir: str):
        self.bin_dir = Path(bin_dir)
        self.port = free_port(HOST)
        self.user = _server_user()
        self.dir = Path(tempfile.mkdtemp(prefix="kera-pg-"))
        self.data = self.dir / "data"
        self.proc: subprocess.Popen | None = None

    @property
    def dsn(self) -> str:
        return f"host={HOST} port={self.port} user=postgres dbname=postgres"

    def _as_server_user(self, args: list[str], **kw) -> subprocess.Popen:
        return subprocess.Popen(args, user=self.user.pw_uid, group=self.user.pw_gid,
                                extra_groups=[], stdin=subprocess.DEVNULL, **kw)

    def start(self) -> "PostgresServer":
        os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
        with open(self.dir / "initdb.log", "wb") as logf:
            init = self._as_server_user([str(self.bin_dir / "initdb"), "-D", str(self.data),
                                         "-U", "postgres", "--auth=trust", "-E", "UTF8"],
                                        stdout=logf, stderr=subprocess.STDOUT)
            if init.wait(INITDB_TIMEOUT_S) != 0:
                raise RuntimeError(f"initdb failed: see {self.dir}/initdb.log")
        with open(self.dir / "postgres.log", "ab") as logf:
            # fsync off: a test server's data does not outlive the test.
            self.proc = self._as_server_user(
                [str(self.bin_dir / "postgres"), "-D", str(self.data), "-p", str(self.port),
                 "-h", HOST, "-k", str(self.dir), "-F"],
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        import psycopg
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                break
            try:
                psycopg.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT_S).close()
                return
            except psycopg.OperationalError:
                time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"PostgreSQL not accepting connections after {timeout_s} s: "
                           f"see {self.dir}/postgres.log")

    def connect(self, **kw):
        import psycopg
        return psycopg.connect(self.dsn, connect_timeout=CONNECT_TIMEOUT_S, **kw)

    def terminate(self, application_name: str) -> int:
        """pg_terminate_backend every session with that application_name; how many."""
        with self.connect(autocommit=True) as conn:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name = %s AND pid <> pg_backend_pid()",
                                (application_name,)).fetchall()
        return len(rows)

    def wait_session(self, application_name: str, timeout_s: float) -> None:
        """Until a session with that application_name is connected (a client that lost its
        connection has connected again)."""
        deadline = time.monotonic() + timeout_s
        with self.connect(autocommit=True) as conn:
            while time.monotonic() < deadline:
                if conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name"
                                " = %s", (application_name,)).fetchone()[0]:
                    return
                time.sleep(POLL_INTERVAL_S)
        raise TimeoutError(f"no {application_name!r} session connected within {timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)   # the server's "fast" shutdown
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
