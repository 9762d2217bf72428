"""`--baseline REF`: another commit's kera measured in the same run, alternating with the
working tree's, so a change is reported as a ratio against the landed commit.

The baseline is a `git archive` of REF's commit under a cache directory named by its sha
(reused by later runs) plus a venv over the system's site packages (pyzmq, numpy, pyarrow ...
come from there; nothing is downloaded). The venv's site-packages names the checkout in a .pth
file, which is what `pip install -e` amounts to for this repository: pip cannot build an
editable install offline when the system site lacks setuptools' bdist_wheel (the `wheel`
package, or setuptools >= 70.1), and with build isolation it would download them.

Each baseline trial is one run of the baseline's own bench (`<venv python> -m bench --systems
kera`, one configuration, one repeat) with the checkout as cwd and PYTHONPATH, so its clients
and daemons import only the baseline's modules (checked once per run: `imports` in
results.json). Its trial joins this run as system `kera-baseline`. Its cluster starts for that
trial and first runs the same unrecorded warm-up trial a fresh cluster gets here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from .runner import END_TO_END, TrialError, TrialResult
from .workload import Workload

SYSTEM = "kera-baseline"
READY = "ready.json"            # written last: a directory without it is rebuilt
PTH_NAME = "kera-baseline.pth"
# The baseline bench's flags a trial uses (every bench/cli.py since 56ee98c has them, e.g.
# 7a24f2f's).
REQUIRED_FLAGS = ("--preset", "--systems", "--where", "--set", "--repeats", "--no-ceiling",
                  "--no-plots", "--plain", "--out", "--work-dir")
PROBE_TIMEOUT_S = 120.0
TRIAL_TIMEOUT_S = 600.0         # plus twice the workload's warm-up and window
STOP_TIMEOUT_S = 30.0
# Environment variables that would make the baseline import something else than its checkout.
DROPPED_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV")
# Run in the baseline's environment: where its modules come from, and its Workload's fields.
PROBE = """\
import dataclasses, json, sys, kera, bench
try:
    from bench.workload import Workload
    fields = [f.name for f in dataclasses.fields(Workload)]
except Exception:
    fields = []
print(json.dumps({"python": sys.executable, "kera_file": kera.__file__,
                  "bench_file": bench.__file__, "workload_fields": fields}))
"""


class BaselineError(RuntimeError):
    """The baseline cannot be prepared; the message says what to do."""


def repo_root() -> Path:
    """The repository this bench belongs to (refs are resolved there)."""
    return Path(__file__).resolve().parent.parent


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kera-bench" / "baseline"


def _git(repo: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, **kw)


def resolve_ref(ref: str, repo: Path | None = None) -> str:
    """The full sha of commit `ref` in `repo`."""
    repo = repo or repo_root()
    got = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", text=True)
    if got.returncode != 0 or not got.stdout.strip():
        raise BaselineError(f"--baseline {ref!r}: no such commit in {repo}; give a branch, tag or "
                            f"sha of this repository (e.g. main~1 or 7a24f2f; see git log "
                            f"--oneline)")
    return got.stdout.strip()


# ---------------------------------------------------------------------- the environment

@dataclasses.dataclass
class BaselineEnv:
    """A prepared baseline: its checkout, its venv, and what a probe found in them."""
    ref: str
    sha: str
    root: Path
    imports: dict = dataclasses.field(default_factory=dict)

    @property
    def checkout(self) -> Path:
        return self.root / "src"

    @property
    def python(self) -> Path:
        # Not resolved: a venv's python is a symlink, and the venv is what makes it the baseline's.
        return self.root / "venv" / "bin" / "python"

    @property
    def short(self) -> str:
        return self.sha[:7]

    def env(self, base: dict | None = None) -> dict:
        return baseline_environ(self.checkout, self.root / "venv",
                                os.environ if base is None else base)

    def describe(self) -> dict:
        return {"ref": self.ref, "sha": self.sha, "short": self.short,
                "checkout": str(self.checkout), "python": str(self.python),
                "imports": self.imports}


def baseline_environ(checkout: Path, venv: Path, base) -> dict:
    """The environment of the baseline's processes: the checkout first on sys.path (its bench
    process, the daemons its clusters start and the workers they spawn all inherit it), and
    nothing from this run's PYTHONPATH or venv."""
    env = {k: v for k, v in base.items() if k not in DROPPED_ENV}
    env["PYTHONPATH"] = str(checkout)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), base.get("PATH", os.defpath)])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def prepare(ref: str, *, repo: Path | None = None, cache_dir: Path | None = None,
            python: str = sys.executable, note=print) -> BaselineEnv:
    """Resolve `ref`, build (or reuse) its checkout and venv, check its bench and imports."""
    repo = repo or repo_root()
    sha = resolve_ref(ref, repo)
    env = BaselineEnv(ref, sha, Path(cache_dir or default_cache_dir()) / sha)
    if (env.root / READY).is_file():
        note(f"baseline {env.short} ({ref}): reusing {env.root}")
    else:
        note(f"preparing baseline {sha} ({ref}) in {env.root} ...")
        build(env, repo, python)
    check_flags(env)
    env.imports = check_imports(probe(env), env.checkout)
    note(f"baseline {env.short}: kera from {env.imports['kera_file']}")
    return env


def build(env: BaselineEnv, repo: Path, python: str) -> None:
    """Checkout, venv, .pth; the READY marker last, so an interrupted build is redone."""
    shutil.rmtree(env.root, ignore_errors=True)
    extract(repo, env.sha, env.checkout)
    make_venv(python, env.root / "venv")
    link_checkout(env.python, env.checkout)
    (env.root / READY).write_text(json.dumps({"ref": env.ref, "sha": env.sha}) + "\n")


def extract(repo: Path, sha: str, dest: Path) -> None:
    """`git archive` of `sha` into `dest` (no worktree: nothing registered in the repository)."""
    if _git(repo, "cat-file", "-e", f"{sha}:bench/cli.py").returncode != 0:
        raise BaselineError(f"--baseline {sha[:7]}: that commit has no bench/cli.py; pick a "
                            f"commit whose bench has {', '.join(REQUIRED_FLAGS)} (e.g. "
                            f"7a24f2f)")
    got = _git(repo, "archive", "--format=tar", sha)
    if got.returncode != 0:
        raise BaselineError(f"git archive {sha[:7]} failed: {got.stderr.decode().strip()}")
    dest.mkdir(parents=True)
    # The "data" filter (Python >= 3.11.4) refuses links out of `dest` and device files.
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(fileobj=io.BytesIO(got.stdout)) as tar:
        tar.extractall(dest, **safe)


def make_venv(python: str, venv: Path) -> None:
    # --without-pip: nothing is installed with pip (see the module docstring), so no ensurepip.
    cmd = [python, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)]
    try:
        got = subprocess.run(cmd, capture_output=True, text=True)
        why = got.returncode and ((got.stderr or got.stdout).strip()[-500:] or
                                  f"exit status {got.returncode}")
    except OSError as e:
        why = str(e)
    if why:
        raise BaselineError(f"could not create the baseline's venv ({' '.join(cmd)}): "
                            f"{why}\nInstall Python's venv "
                            f"module (Debian/Ubuntu: apt-get install python3-venv) or point "
                            f"--baseline-cache at a writable directory")


def link_checkout(venv_python: Path, checkout: Path) -> None:
    """Name the checkout in the venv's site-packages (an editable install without pip)."""
    got = subprocess.run([str(venv_python), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True)
    if got.returncode != 0:
        raise BaselineError(f"the baseline's venv python does not run: {got.stderr.strip()}")
    (Path(got.stdout.strip()) / PTH_NAME).write_text(f"{checkout}\n")


def _run_in(env: BaselineEnv, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(env.python), *args], cwd=env.checkout, env=env.env(),
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)


def missing_flags(help_text: str) -> list[str]:
    return [f for f in REQUIRED_FLAGS if f not in help_text]


def check_flags(env: BaselineEnv) -> None:
    got = _run_in(env, ["-m", "bench", "--help"])
    missing = missing_flags(got.stdout) if got.returncode == 0 else list(REQUIRED_FLAGS)
    if missing:
        raise BaselineError(f"--baseline {env.ref} ({env.short}): its bench lacks "
                            f"{', '.join(missing)} (python -m bench --help: exit "
                            f"{got.returncode} {got.stderr.strip()[-300:]}); pick a commit whose "
                            f"bench selects one configuration with these flags (e.g. 7a24f2f)")


def probe(env: BaselineEnv) -> dict:
    got = _run_in(env, ["-c", PROBE])
    if got.returncode != 0:
        raise BaselineError(f"the baseline {env.short} does not import kera and bench in its "
                            f"venv: {got.stderr.strip()[-500:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def check_imports(info: dict, checkout: Path) -> dict:
    """The probe's modules must come from the checkout, never from the working tree."""
    for key in ("kera_file", "bench_file"):
        if not Path(info[key]).resolve().is_relative_to(Path(checkout).resolve()):
            raise BaselineError(f"the baseline's python imports {key[:-5]} from {info[key]}, "
                                f"not from its checkout {checkout}; remove that path from "
                                f"sys.path (PYTHONPATH, .pth files) and rerun")
    return info


# ---------------------------------------------------------------------- one trial

def set_value(v) -> str | None:
    """A workload value as the baseline's `--set` parses it back (None as "none"), or None
    for a string it cannot pass: `--set` reads "none" as None, so compression="none" is left
    to the preset (trial_from_results checks the baseline ran the same workload)."""
    if isinstance(v, str) and v.lower() in ("none", "null"):
        return None
    return "none" if v is None else str(v)


def workload_fields(w: Workload) -> list[str]:
    return [f.name for f in dataclasses.fields(w) if f.name not in ("name", "tags")]


def trial_command(env: BaselineEnv, preset: str, w: Workload, out: Path,
                  work: Path) -> list[str]:
    """The baseline's bench run for exactly `w`: selected by name, every field it knows set to
    this run's value (so a preset changed since the baseline still runs the same workload)."""
    known = env.imports.get("workload_fields") or []
    sets = []
    for name in workload_fields(w):
        value = set_value(getattr(w, name))
        if name in known and value is not None:
            sets += ["--set", f"{name}={value}"]
    return [str(env.python), "-m", "bench", "--preset", preset, "--systems", "kera",
            "--where", f"name={w.name}", *sets, "--repeats", "1", "--no-ceiling",
            "--no-plots", "--plain", "--out", str(out), "--work-dir", str(work)]


def unknown_fields(env: BaselineEnv) -> list[str]:
    """This run's workload fields the baseline's bench has not got (it uses its defaults)."""
    known = set(env.imports.get("workload_fields") or [])
    return [name for name in workload_fields(Workload("w")) if name not in known]


def workload_differences(w: Workload, ran: dict) -> list[str]:
    """Fields (both benches have) whose value the baseline ran differs from `w`'s."""
    return [f"{name}={ran[name]!r} (here {getattr(w, name)!r})" for name in workload_fields(w)
            if name in ran and ran[name] != getattr(w, name)]


def trial_from_results(results: dict, w: Workload, repeat: int) -> TrialResult:
    """The baseline's one kera trial of `w`, as a `kera-baseline` trial of this run. Fields
    the baseline's TrialResult lacks are None; fields this one lacks are dropped."""
    errors = results.get("errors") or []
    if errors:
        raise TrialError(f"baseline trial failed: {errors[0]['error'].strip().splitlines()[-1]}")
    differ = [d for c in results.get("configurations", [])
              for d in workload_differences(w, c.get("workload") or {})]
    if differ:
        raise TrialError(f"the baseline ran another workload: {', '.join(differ)}")
    trials = [t for c in results.get("configurations", []) for t in c.get("trials", [])
              if t.get("system") == "kera"]
    if len(trials) != 1:
        raise TrialError(f"baseline run recorded {len(trials)} kera trials, expected 1")
    names = [f.name for f in dataclasses.fields(TrialResult)]
    values = {n: trials[0].get(n) for n in names}
    values.update(system=SYSTEM, label=w.label(), repeat=repeat,
                  latency_hist=values["latency_hist"] or [],
                  latency_kind=values["latency_kind"] or END_TO_END, tool=values["tool"] or {})
    return TrialResult(**values)


class BaselineSystem:
    """The baseline in the alternation: each trial is a subprocess running the baseline's bench
    (which starts, warms up and stops its own cluster), so there is nothing to keep running."""
    name = SYSTEM
    bootstrap = "(the baseline bench's own cluster)"

    def __init__(self, env: BaselineEnv, preset: str, work_dir: Path, out_dir: Path):
        self.env, self.preset = env, preset
        # Absolute: the baseline's bench runs with its own checkout as working directory.
        self.work_dir = Path(work_dir).absolute() / SYSTEM
        self.out_dir = Path(out_dir).absolute() / "baseline"

    def ensure(self, w: Workload) -> bool:
        return False   # no cluster here to warm up: the baseline bench warms up its own

    def client_env(self):
        return contextlib.nullcontext()

    def settings(self, w: Workload) -> dict:
        cmd = trial_command(self.env, self.preset, w, Path("<out>"), Path("<work>"))
        return {**self.env.describe(), "cwd": str(self.env.checkout), "command": cmd,
                "fields_not_in_baseline": unknown_fields(self.env)}

    def trial(self, w: Workload, prefix: str, repeat: int = 0) -> TrialResult:
        out = self.out_dir / prefix
        out.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        cmd = trial_command(self.env, self.preset, w, out, self.work_dir)
        timeout = TRIAL_TIMEOUT_S + 2 * (w.warmup_s + w.duration_s)
        code = run_logged(cmd, self.env.checkout, self.env.env(), out / "bench.log", timeout)
        if not (out / "results.json").is_file():
            raise TrialError(f"baseline bench exited {code} without results; see "
                             f"{out / 'bench.log'}")
        return trial_from_results(json.loads((out / "results.json").read_text()), w, repeat)

    def stop(self) -> None:
        pass

    def check_alive(self) -> None:
        pass


def run_logged(cmd: list[str], cwd: Path, env: dict, log_path: Path, timeout_s: float) -> int:
    """Run `cmd` with its output in `log_path`; if it outlives `timeout_s` or this run is
    interrupted, stop it with SIGINT (its bench then stops its cluster and workers, as on
    Ctrl-C), then SIGKILL (its daemons stop once their parent is gone)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TrialError(f"baseline bench still running after {timeout_s:.0f} s; see "
                             f"{log_path}") from None
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
