"""`python -m bench --baseline REF` without a cluster: resolving refs, preparing (and reusing)
the baseline's checkout and venv, the baseline bench's command and environment, reading its
results back as `kera-baseline` trials, the kera/kera@REF ratios and table rows."""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bench import baseline as bl
from bench.cli import add_arguments, apply_overrides, choose_systems, make_systems
from bench.report import markdown, paired_spread, summarize, write_plots
from bench.runner import TrialError, TrialResult
from bench.workload import PRESETS, Workload

SHA = "abc1234" + "0" * 33


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A repository whose first commit has no bench and whose second has bench/cli.py."""
    r = tmp_path / "repo"
    r.mkdir()
    _git(r, "init", "-q")
    (r / "README").write_text("x\n")
    _git(r, "add", "README")
    _git(r, "commit", "-qm", "no bench")
    (r / "bench").mkdir()
    (r / "bench" / "cli.py").write_text("# bench\n")
    _git(r, "add", "bench")
    _git(r, "commit", "-qm", "bench")
    return r


def _env(tmp_path, fields=None) -> bl.BaselineEnv:
    fields = [f.name for f in dataclasses.fields(Workload)] if fields is None else fields
    return bl.BaselineEnv("main~1", SHA, tmp_path / SHA,
                          imports={"workload_fields": fields, "kera_file": "k"})


def _trial(system: str, rate: float, **kw) -> TrialResult:
    values = dict(system=system, label="c", repeat=0, producer_records_per_s=rate,
                  producer_mb_per_s=rate / 1e4, consumer_records_per_s=rate,
                  latency_p50_ms=10.0, latency_p99_ms=20.0, cpu_s_per_million=2.0,
                  server_cpu_s_per_million=1.0, acked=5, consumed=5, failed=0, window_s=1.0,
                  window_acked=5, window_consumed=5, server_cpu_s=0.1, producer_cpu_s=0.1,
                  consumer_cpu_s=0.1, machine_busy_fraction=0.5, other_cpu_s=0.0,
                  drained=True)
    return TrialResult(**{**values, **kw})


# ---------------------------------------------------------------------- refs, checkout, venv

def test_resolve_ref_gives_the_full_sha(repo):
    head = _git(repo, "rev-parse", "HEAD")
    assert bl.resolve_ref("HEAD", repo) == head
    assert bl.resolve_ref(head[:7], repo) == head
    assert bl.resolve_ref("HEAD~1", repo) == _git(repo, "rev-parse", "HEAD~1")


def test_unknown_ref_says_what_to_give(repo):
    with pytest.raises(bl.BaselineError, match=r"'no-such-ref'.*no such commit.*git log"):
        bl.resolve_ref("no-such-ref", repo)


def test_extract_needs_a_commit_with_a_bench(repo, tmp_path):
    with pytest.raises(bl.BaselineError, match="has no bench/cli.py.*7a24f2f"):
        bl.extract(repo, _git(repo, "rev-parse", "HEAD~1"), tmp_path / "old")
    bl.extract(repo, _git(repo, "rev-parse", "HEAD"), tmp_path / "new")
    assert (tmp_path / "new" / "bench" / "cli.py").read_text() == "# bench\n"
    assert not (tmp_path / "new" / ".git").exists()   # an archive, not a worktree


def test_venv_failure_says_what_to_do(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'No module named venv' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(bl.BaselineError, match=r"(?s)No module named venv.*python3-venv"):
        bl.make_venv(str(fake), tmp_path / "venv")
    with pytest.raises(bl.BaselineError, match="python3-venv"):
        bl.make_venv(str(tmp_path / "missing"), tmp_path / "venv")


def _stub_checks(monkeypatch, tmp_path):
    monkeypatch.setattr(bl, "check_flags", lambda env: None)
    monkeypatch.setattr(bl, "probe", lambda env: {"kera_file": str(env.checkout / "kera/x.py"),
                                                  "bench_file": str(env.checkout / "bench/x.py")})


def test_prepare_builds_once_then_reuses_by_sha(repo, tmp_path, monkeypatch):
    _stub_checks(monkeypatch, tmp_path)
    built, notes = [], []

    def build(env, repo, python):
        built.append(env.sha)
        env.root.mkdir(parents=True)
        (env.root / bl.READY).write_text("{}")

    monkeypatch.setattr(bl, "build", build)
    sha = _git(repo, "rev-parse", "HEAD")
    env = bl.prepare("HEAD", repo=repo, cache_dir=tmp_path / "cache", note=notes.append)
    assert env.root == tmp_path / "cache" / sha and built == [sha]
    assert notes[0].startswith(f"preparing baseline {sha}")
    again = bl.prepare(sha[:8], repo=repo, cache_dir=tmp_path / "cache", note=notes.append)
    assert again.root == env.root and built == [sha]      # the cache was reused
    assert "reusing" in notes[2]


def test_a_bench_without_the_flags_is_refused(tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert bl.missing_flags(parser.format_help()) == []
    old_help = parser.format_help().replace("--no-ceiling", "--ceiling-off")
    monkeypatch.setattr(bl, "_run_in", lambda env, args: subprocess.CompletedProcess(
        args, 0, old_help, ""))
    with pytest.raises(bl.BaselineError, match=r"lacks --no-ceiling.*7a24f2f"):
        bl.check_flags(_env(tmp_path))


def test_imports_must_come_from_the_checkout(tmp_path):
    checkout = tmp_path / "src"
    ok = {"kera_file": str(checkout / "kera/__init__.py"),
          "bench_file": str(checkout / "bench/__init__.py")}
    assert bl.check_imports(ok, checkout) == ok
    elsewhere = {**ok, "kera_file": "/work/main/kera/__init__.py"}
    with pytest.raises(bl.BaselineError, match="imports kera from /work/main.*not from its"):
        bl.check_imports(elsewhere, checkout)


# ---------------------------------------------------------------------- one trial's command

def test_command_selects_exactly_this_workload(tmp_path):
    preset = PRESETS["throughput"].workloads[0]
    w = preset.replace(duration_s=2.0, linger_ms=0.5, buffer_bytes=None, virtual_logs=None)
    cmd = bl.trial_command(_env(tmp_path), "throughput", w, tmp_path / "o", tmp_path / "w")
    assert cmd[:3] == [str(tmp_path / SHA / "venv/bin/python"), "-m", "bench"]
    for flag in ("--no-ceiling", "--no-plots", "--plain"):
        assert flag in cmd
    pairs = {flag: cmd[cmd.index(flag) + 1] for flag in
             ("--preset", "--systems", "--where", "--repeats", "--out", "--work-dir")}
    assert pairs == {"--preset": "throughput", "--systems": "kera", "--where": f"name={w.name}",
                     "--repeats": "1", "--out": str(tmp_path / "o"),
                     "--work-dir": str(tmp_path / "w")}
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert "virtual_logs=none" in sets
    assert not any(s.startswith("compression=") for s in sets)   # "none" would read as None
    assert apply_overrides([preset], sets) == [w]          # the baseline parses back `w`
    lz4 = bl.trial_command(_env(tmp_path), "compression", w.replace(compression="lz4"),
                           tmp_path, tmp_path)
    assert "compression=lz4" in lz4


def test_fields_the_baseline_lacks_are_not_set(tmp_path):
    known = [f.name for f in dataclasses.fields(Workload) if f.name != "payload"]
    env = _env(tmp_path, known)
    cmd = bl.trial_command(env, "quick", Workload("quick"), tmp_path, tmp_path)
    assert not any(a.startswith("payload=") for a in cmd)
    assert bl.unknown_fields(env) == ["payload"]


def test_environment_puts_the_checkout_first(tmp_path):
    env = _env(tmp_path).env({"PYTHONPATH": "/work/wt-baseline", "PATH": "/usr/bin",
                              "VIRTUAL_ENV": "/work/.venv", "HOME": "/root"})
    assert env["PYTHONPATH"] == str(tmp_path / SHA / "src")
    assert env["VIRTUAL_ENV"] == str(tmp_path / SHA / "venv")
    assert env["PATH"].split(os.pathsep) == [str(tmp_path / SHA / "venv/bin"), "/usr/bin"]
    assert env["HOME"] == "/root"


# ---------------------------------------------------------------------- its results, merged

def test_the_baseline_trial_joins_as_kera_baseline():
    t = _trial("kera", 1000.0).to_dict()
    t["future_metric"] = 1          # a newer baseline's extra field: dropped
    del t["other_cpu_s"]            # an older baseline's missing field: None
    w = Workload("t", duration_s=2.0, tags={"R": 1, "chunk_KiB": 4})
    ran = {**w.to_dict(), "future_field": 1}
    got = bl.trial_from_results({"errors": [], "configurations": [{"workload": ran,
                                                                    "trials": [t]}]}, w, 3)
    assert (got.system, got.label, got.repeat) == ("kera-baseline", "R=1 chunk_KiB=4", 3)
    assert got.producer_records_per_s == 1000.0 and got.other_cpu_s is None


def test_a_baseline_that_ran_another_workload_is_a_failed_trial():
    w = Workload("t", duration_s=2.0)
    ran = {**w.to_dict(), "duration_s": 5.0, "compression": "lz4"}
    with pytest.raises(TrialError, match=r"another workload: duration_s=5.0 \(here 2.0\), "
                                         r"compression='lz4' \(here 'none'\)"):
        bl.trial_from_results({"errors": [], "configurations": [
            {"workload": ran, "trials": [_trial("kera", 1.0).to_dict()]}]}, w, 0)


def test_a_failed_or_empty_baseline_run_is_a_failed_trial():
    with pytest.raises(TrialError, match="baseline trial failed: boom"):
        bl.trial_from_results({"errors": [{"error": "Traceback\nboom\n"}]}, Workload("c"), 0)
    with pytest.raises(TrialError, match="0 kera trials"):
        bl.trial_from_results({"errors": [], "configurations": [{"trials": []}]},
                              Workload("c"), 0)


@pytest.mark.parametrize("relative_out", [False, True])
def test_trial_runs_the_baseline_bench_in_its_checkout(tmp_path, monkeypatch, relative_out):
    """A stand-in for the baseline's python: records its cwd, argv and PYTHONPATH, and writes
    a results.json with one kera trial where --out says (an --out relative to where the bench
    was started must still be found: the baseline runs in its own checkout)."""
    env = _env(tmp_path)
    env.checkout.mkdir(parents=True)
    env.python.parent.mkdir(parents=True)
    env.python.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, os, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        json.dump({{"cwd": os.getcwd(), "argv": sys.argv[1:],
                   "path": os.environ["PYTHONPATH"]}}, open(os.path.join(out, "seen.json"), "w"))
        trial = {_trial("kera", 777.0).to_dict()!r}
        json.dump({{"errors": [], "configurations": [{{"trials": [trial]}}]}},
                  open(os.path.join(out, "results.json"), "w"))
        """))
    env.python.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    out = Path("out") if relative_out else tmp_path / "out"
    system = bl.BaselineSystem(env, "quick", tmp_path / "work", out)
    got = system.trial(Workload("quick", tags={"load": "max"}), "t00-1-kera-baseline", 1)
    assert (got.system, got.label, got.producer_records_per_s) == ("kera-baseline", "load=max",
                                                                   777.0)
    seen = json.loads((tmp_path / "out/baseline/t00-1-kera-baseline/seen.json").read_text())
    assert seen["cwd"] == str(env.checkout) and seen["path"] == str(env.checkout)
    assert seen["argv"][:2] == ["-m", "bench"]


# ---------------------------------------------------------------------- systems, report

def test_the_baseline_alternates_after_the_working_trees_kera():
    assert choose_systems("kera,kafka", "off", False) == ["kera", "kafka"]
    assert choose_systems("kera", "off", True) == ["kera", "kera-baseline"]
    assert choose_systems("kera,kafka", "both", True) == ["kera", "kera-curve", "kera-baseline",
                                                          "kafka"]
    with pytest.raises(ValueError, match="keep kera in --systems"):
        choose_systems("kafka", "off", True)


def test_make_systems_runs_the_baseline_through_its_bench(tmp_path):
    running = make_systems(["kera", "kera-baseline"], tmp_path, _env(tmp_path), "quick",
                           tmp_path)
    assert list(running) == ["kera", "kera-baseline"]
    assert isinstance(running["kera-baseline"], bl.BaselineSystem)
    assert running["kera-baseline"].ensure(Workload("quick")) is False


def test_help_explains_the_flag():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "--baseline REF" in text and "kera/kera@REF" in text and "--baseline-cache" in text


def _results(tmp_path) -> dict:
    config = {"workload": Workload("c", chunk_size_bytes=4096).to_dict(),
              "trials": [_trial("kera", 1200.0).to_dict(),
                         _trial("kera-baseline", 1000.0, cpu_s_per_million=4.0).to_dict(),
                         _trial("kera", 1200.0, repeat=1).to_dict(),
                         _trial("kera-baseline", 1000.0, repeat=1,
                                cpu_s_per_million=4.0).to_dict()]}
    config["summary"] = summarize(config)
    return {"preset": "p", "description": "d", "started": "now", "ceiling": {},
            "machine": {"cpus": 2, "load_average": [0, 0, 0], "python": "3", "versions": {}},
            "configurations": [config], "baseline": _env(tmp_path).describe()}


def test_ratios_against_the_baseline(tmp_path):
    s = _results(tmp_path)["configurations"][0]["summary"]
    assert s["trials_per_system"]["kera-baseline"] == 2
    assert s["baseline_ratios"]["producer_records_per_s"] == pytest.approx(1.2)
    assert s["baseline_ratios"]["consumer_records_per_s"] == pytest.approx(1.2)
    assert s["baseline_ratios"]["cpu_s_per_million"] == pytest.approx(0.5)
    assert s["baseline_ratios"]["latency_p99_ms"] == pytest.approx(1.0)
    assert s["ratios"]["producer_records_per_s"] is None       # no Kafka in this run


def test_table_has_the_baseline_column_and_ratio_row(tmp_path):
    text = markdown(_results(tmp_path))
    assert "| c | kera@abc1234 | 1,000 |" in text
    assert "| c | **kera/kera@abc1234** | **1.20x** | | **1.20x** |" in text
    assert "kera/Kafka" not in text.split("## Settings")[0].split("|---|")[-1]
    assert "--baseline main~1" in text


def test_plots_draw_the_baseline(tmp_path):
    paths = write_plots(tmp_path, _results(tmp_path))
    assert paths and all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


# ---------------------------------------------------------------------- spread over rounds

def _rounds(*pairs, a="kera", b="kera-baseline") -> list[TrialResult]:
    """Trials of two systems, round by round: pairs of (a rate, b rate, a CPU, b CPU)."""
    trials = []
    for i, (ra, rb, ca, cb) in enumerate(pairs):
        trials += [_trial(a, ra, repeat=i, cpu_s_per_million=ca),
                   _trial(b, rb, repeat=i, cpu_s_per_million=cb)]
    return trials


def test_the_spread_pairs_each_round_with_its_partner():
    trials = _rounds((1200.0, 1000.0, 1.0, 2.0), (1500.0, 1000.0, 1.5, 2.0),
                     (900.0, 600.0, 1.0, 1.6))
    spread = paired_spread(trials, "kera", "kera-baseline")
    assert spread["producer_records_per_s"] == pytest.approx([1.2, 1.5, 3])
    assert spread["cpu_s_per_million"] == pytest.approx([0.5, 0.75, 3])


def test_a_round_without_its_partner_or_a_single_round_gives_no_spread():
    one = _rounds((1200.0, 1000.0, 1.0, 2.0))
    assert paired_spread(one, "kera", "kera-baseline") == {}
    unpaired = one + [_trial("kera", 3000.0, repeat=1)]      # its baseline trial failed
    assert paired_spread(unpaired, "kera", "kera-baseline") == {}


def test_rate_only_rows_give_no_cpu_spread():
    trials = _rounds((1200.0, 1000.0, 1.0, 2.0), (1500.0, 1000.0, 1.5, 2.0), b="kafka-java")
    spread = paired_spread(trials, "kera", "kafka-java", rates_only=True)
    assert set(spread) == {"producer_records_per_s"}


def test_the_ratio_row_shows_the_spread_of_the_rounds(tmp_path):
    results = _results(tmp_path)
    config = results["configurations"][0]
    config["trials"] = [t.to_dict() for t in _rounds((1200.0, 1000.0, 1.0, 2.0),
                                                       (1500.0, 1000.0, 1.5, 2.0))]
    config["summary"] = summarize(config)
    row = [line for line in markdown(results).splitlines() if "**kera/kera@abc1234**" in line]
    assert len(row) == 1
    assert "rounds 1.20-1.50x rec/s, 0.50-0.75x CPU (2); busy 50%" in row[0]
    assert "**1.35x**" in row[0]           # the median ratio stays the headline


def test_results_written_before_spreads_still_render(tmp_path):
    results = _results(tmp_path)
    del results["configurations"][0]["summary"]["ratio_spreads"]
    row = [line for line in markdown(results).splitlines() if "**kera/kera@abc1234**" in line]
    assert row and "rounds" not in row[0]
