"""The benchmark harness end to end: a real Kafka broker and a real kera cluster run a tiny
workload through `bench.cli.run_benchmark`, and its numbers and files must be sane."""

import json

import pytest

from bench.cli import run_benchmark
from bench.progress import PlainProgress
from bench.report import PLOTS
from bench.workload import MiB, Workload

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-results")
    w = Workload("smoke", producers=1, consumers=1, streams=2, streamlets=2,
                 chunk_size_bytes=4096, warmup_s=0.5, duration_s=2.0,
                 tags={"smoke": "tiny"})
    results = run_benchmark([w], preset="smoke", description="harness smoke test", repeats=1,
                            out_dir=out, ceiling_bytes=8 * MiB, warm_up=False,
                            systems=("kera", "kera-curve", "kafka"),
                            work_dir=tmp_path_factory.mktemp("bench-work"),
                            progress=PlainProgress(3))
    return out, results


def test_no_errors_and_one_trial_per_system(run):
    _, results = run
    assert results["errors"] == []
    trials = results["configurations"][0]["trials"]
    assert sorted(t["system"] for t in trials) == ["kafka", "kera", "kera-curve"]


@pytest.mark.parametrize("system", ["kera", "kera-curve", "kafka"])
def test_consumers_read_exactly_what_was_acknowledged(run, system):
    _, results = run
    (t,) = [t for t in results["configurations"][0]["trials"] if t["system"] == system]
    assert t["acked"] > 0
    assert t["failed"] == 0
    assert t["drained"]
    assert t["consumed"] == t["acked"]
    assert 0 < t["window_acked"] <= t["acked"]
    assert 0 < t["window_consumed"] <= t["consumed"]


@pytest.mark.parametrize("system", ["kera", "kafka"])
def test_rates_latency_and_cpu_are_positive(run, system):
    _, results = run
    (t,) = [t for t in results["configurations"][0]["trials"] if t["system"] == system]
    assert t["producer_records_per_s"] > 0
    assert t["producer_mb_per_s"] == pytest.approx(t["producer_records_per_s"] * 100 / 1e6)
    assert t["consumer_records_per_s"] > 0
    assert 0 < t["latency_p50_ms"] <= t["latency_p99_ms"] < 60_000
    assert t["server_cpu_s"] > 0 and t["producer_cpu_s"] > 0 and t["consumer_cpu_s"] > 0
    assert t["cpu_s_per_million"] > t["server_cpu_s_per_million"] > 0
    assert 0 < t["machine_busy_fraction"] <= 1.0


def test_summary_has_ratios_and_the_ceiling(run):
    _, results = run
    summary = results["configurations"][0]["summary"]
    assert summary["integrity_ok"] == {"kera": True, "kera-curve": True, "kafka": True}
    assert summary["ratios"]["producer_records_per_s"] > 0
    assert summary["curve_ratios"]["producer_records_per_s"] > 0
    assert results["ceiling"]["4096"]["bytes_per_s"] > 0


def test_files_are_written_with_every_setting(run):
    out, results = run
    saved = json.loads((out / "results.json").read_text())
    config = saved["configurations"][0]
    assert config["workload"]["chunk_size_bytes"] == 4096
    assert config["kafka"]["producer"]["acks"] == "all"
    assert config["kafka"]["producer"]["batch.size"] == 4096
    assert config["kera"]["producer"]["chunk_size_bytes"] == 4096
    assert len(config["trials"]) == 3
    md = (out / "results.md").read_text()
    assert "kera/Kafka" in md and "CURVE/plaintext" in md and "smoke=tiny" in md
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
