"""The harness' pure pieces: workload assignments, send-time stamps, latency percentiles,
CPU accounting from /proc, preset selection, and what a run interrupted by Ctrl-C still writes."""

import contextlib
import json
import os
import struct
import time

import numpy as np
import pytest

from bench import cli
from bench.cli import apply_overrides, select
from bench.clients import kafka_client, kafka_producer_settings
from bench.latency import LatencyHistogram, stamp_rows, stamps_from_blob, stamps_from_values
from bench.procstat import (machine_cpu_s, process_cpu_s, process_write_bytes,
                            processes_write_bytes, self_cpu_s)
from bench.runner import TrialResult
from bench.systems import KafkaClusterShare, KeraKafkaSystem, make_system
from bench.workload import (ONE_PER_SUB_PARTITION, PRESETS, Workload, consumer_partitions,
                            producer_streams)


def test_every_partition_is_read_by_exactly_one_consumer():
    w = Workload("w", consumers=3, streams=5, streamlets=4)
    pairs = [(s, sl) for c in range(3) for s, sls in consumer_partitions(w, c).items() for sl in sls]
    assert sorted(pairs) == [(s, sl) for s in range(5) for sl in range(4)]


def test_producers_share_streams_or_all_write_every_stream():
    many = Workload("w", producers=2, streams=5)
    assert producer_streams(many, 0) + producer_streams(many, 1) == [0, 2, 4, 1, 3]
    few = Workload("w", producers=4, streams=2)
    assert all(producer_streams(few, p) == [0, 1] for p in range(4))


def test_records_per_chunk_fit_a_kera_chunk():
    w = Workload("w", chunk_size_bytes=16384, record_size_bytes=100)
    assert w.records_per_chunk == (16384 - 68) // 112
    with pytest.raises(ValueError):
        Workload("w", chunk_size_bytes=100, record_size_bytes=100)


def test_records_with_headers_fill_exactly_one_kera_chunk():
    from kera.producer import batch

    w = Workload("w", chunk_size_bytes=16384, record_size_bytes=100, headers=2)
    plain = Workload("w", chunk_size_bytes=16384, record_size_bytes=100)
    assert 0 < w.records_per_chunk < plain.records_per_chunk
    values = [b"x" * 100] * w.records_per_chunk
    capacity = 16384 - 68
    headers = [w.record_headers] * len(values)
    n, pieces = batch.plan(values, None, None, streamlets=1, capacity=capacity,
                           max_record_bytes=1 << 20, keyless_streamlet=0, headers=headers)
    assert len(list(pieces)) == 1, "a send unit is one chunk, headers included"
    _, pieces = batch.plan(values + [b"x" * 100], None, None, streamlets=1, capacity=capacity,
                           max_record_bytes=1 << 20, keyless_streamlet=0,
                           headers=headers + [w.record_headers])
    assert len(list(pieces)) == 2, "and no more than one chunk holds"


def test_layouts_for_replication():
    w = Workload("w", replication=3, streams=2, streamlets=4, active_groups=2,
                 virtual_logs=ONE_PER_SUB_PARTITION)
    assert w.kera_layout() == {"brokers": 1, "backups": 2, "virtual_logs": 16,
                               "memory_limit_mib": 0}
    assert w.kafka_layout() == {"brokers": 3, "min_insync_replicas": 2}


def test_the_memory_full_preset_gives_the_broker_a_limit_its_open_segments_fit_under():
    segment_mib = 8                       # the coordinator's default segment size
    for w in PRESETS["memory-full"].workloads:
        limit = w.kera_layout()["memory_limit_mib"]
        assert limit == w.memory_limit_mib > 0
        assert limit > w.sub_partitions * segment_mib      # open segments are counted whole
        assert w.warmup_s > w.duration_s                   # time to fill it before measuring
    assert w.kafka_layout() == Workload("k", replication=3).kafka_layout()
    with pytest.raises(ValueError):
        Workload("w", memory_limit_mib=-1)


def test_stamps_survive_both_decoders():
    values = np.zeros((4, 20), dtype=np.uint8)
    stamp_rows(values, 1_700_000_000_123_456)
    blob = values.tobytes()
    offsets = np.arange(0, 81, 20, dtype=np.uint32)
    assert stamps_from_blob(blob, offsets).tolist() == [1_700_000_000_123_456] * 4
    rows = [blob[i * 20:(i + 1) * 20] for i in range(4)]
    assert stamps_from_values(rows).tolist() == [1_700_000_000_123_456] * 4


def test_stamps_are_read_at_each_values_own_start():
    """Values of unequal lengths, each with its own stamp, in a blob that starts at the first
    value (offsets relative to a larger buffer, as a batch that skips records gives them)."""
    stamps = [1_700_000_000_000_000 + i * 7919 for i in range(6)]
    values = [struct.pack("<q", t) + b"v" * (i * 3) for i, t in enumerate(stamps)]
    offsets = np.array([0, *np.cumsum([len(v) for v in values])], dtype=np.uint32) + 40
    blob = memoryview(b"".join(values))
    assert stamps_from_blob(blob, offsets).tolist() == stamps
    assert stamps_from_blob(blob[len(values[0]):], offsets[1:]).tolist() == stamps[1:]
    assert stamps_from_blob(b"", np.array([0], dtype=np.uint32)).tolist() == []


def test_latency_percentiles_within_bucket_precision():
    h = LatencyHistogram()
    h.add(np.arange(1, 1001, dtype=np.float64) * 1000)   # 1 .. 1000 ms
    assert h.total == 1000
    assert h.percentile_ms(50) == pytest.approx(500, rel=0.03)
    assert h.percentile_ms(99) == pytest.approx(990, rel=0.03)
    merged = LatencyHistogram(h.to_list())
    merged.merge(h)
    assert merged.total == 2000
    assert LatencyHistogram().percentile_ms(50) is None


def test_cpu_accounting_from_proc():
    before = self_cpu_s()
    deadline = time.monotonic() + 10.0
    while self_cpu_s() <= before:  # burn CPU until the clock-tick counter moves
        sum(i * i for i in range(100_000))
        assert time.monotonic() < deadline, "own CPU time never increased"
    assert process_cpu_s(os.getpid()) > 0
    assert process_cpu_s(2 ** 22 + 12345) is None
    busy, total = machine_cpu_s()
    assert 0 < busy < total


def test_disk_writes_from_proc(tmp_path):
    before = process_write_bytes(os.getpid())
    with open(tmp_path / "f", "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    assert process_write_bytes(os.getpid()) - before >= 1 << 20
    assert processes_write_bytes([os.getpid(), 2 ** 22 + 12345]) >= 1 << 20
    assert process_write_bytes(2 ** 22 + 12345) is None


def test_selection_and_overrides():
    streams = list(PRESETS["streams"].workloads)
    r3 = select(streams, ["R=3"])
    assert [w.tags["streams"] for w in r3] == [8, 32, 128, 512]
    short = apply_overrides(r3, ["duration_s=1.5", "producers=1"])
    assert all(w.duration_s == 1.5 and w.producers == 1 and w.replication == 3 for w in short)


def test_kera_kafka_is_keras_layout_driven_by_the_kafka_rows_clients(tmp_path):
    share = KafkaClusterShare()
    plain, tuned, kafka = (make_system(n, tmp_path, share)
                           for n in ("kera-kafka", "kera-kafka-tuned", "kafka-tuned"))
    w = Workload("w", replication=3, streamlets=32, active_groups=4, chunk_size_bytes=16384)
    assert isinstance(plain, KeraKafkaSystem) and plain.cluster is None     # built, not started
    assert plain.layout_for(w) == w.kera_layout() and plain.cluster_options() == {"kafka_port": 0}
    assert plain.stream_settings(w) == {"streamlets": 32, "active_groups": 1, "replication": 3,
                                        "durability": "memory"}
    assert plain.settings(w)["producer"] == kafka_producer_settings(w)
    assert tuned.settings(w)["producer"] == kafka.settings(w)["producer"] \
        == kafka_producer_settings(w, tuned=True)
    assert plain.settings(w)["consumer"] == kafka.settings(w)["consumer"]
    tuned.cluster = "started"
    assert plain.cluster == "started" and kafka.cluster is None    # one kera cluster, apart
    assert [kafka_client(s) for s in ("kera", "kera-curve", "kera-kafka", "kera-kafka-tuned",
                                      "kafka", "kafka-tuned")] == [False, False] + [True] * 4


class _InterruptedSystem:
    """A system whose second trial is interrupted (Ctrl-C), as a user stopping a run."""

    def __init__(self, trial):
        self.calls = 0
        self._trial = trial

    def settings(self, w):
        return {}

    def ensure(self, w):
        return False            # no new cluster: no warm-up trial

    def client_env(self):
        return contextlib.nullcontext()

    def trial(self, w, prefix, repeat=0):
        self.calls += 1
        if self.calls > 1:
            raise KeyboardInterrupt
        return self._trial

    def stop(self):
        pass


def test_an_interrupted_run_writes_what_it_measured_and_stays_interrupted(tmp_path, monkeypatch):
    done = TrialResult(system="kera", label="w", repeat=0, producer_records_per_s=1000.0,
                       producer_mb_per_s=0.1, consumer_records_per_s=1000.0, latency_p50_ms=1.0,
                       latency_p99_ms=2.0, cpu_s_per_million=3.0, server_cpu_s_per_million=1.0,
                       acked=5, consumed=5, failed=0, window_s=1.0, window_acked=5,
                       window_consumed=5, server_cpu_s=0.1, producer_cpu_s=0.1,
                       consumer_cpu_s=0.1, machine_busy_fraction=0.5, other_cpu_s=0.0,
                       drained=True)
    monkeypatch.setattr(cli, "make_systems", lambda *a, **k: {"kera": _InterruptedSystem(done)})
    with pytest.raises(KeyboardInterrupt):     # not a KeyError from writing the report
        cli.run_benchmark([Workload("w")], preset="p", description="d", repeats=2,
                          out_dir=tmp_path, systems=("kera",), plots=False, warm_up=False)
    results = json.loads((tmp_path / "results.json").read_text())
    [config] = results["configurations"]
    assert config["summary"]["trials_per_system"]["kera"] == 1
    assert "| w | kera | 1,000 |" in (tmp_path / "results.md").read_text()


def test_a_missing_confluent_kafka_is_named_before_any_trial():
    absent = cli.confluent_missing(["kera", "kafka", "kera-kafka", "kafka-java"],
                                   find_spec=lambda name: None)
    assert 'pip install "kera[bench]"' in absent
    assert "kafka, kera-kafka need" in absent          # the Java client needs no confluent
    assert cli.confluent_missing(["kera", "kera-curve", "kafka-java"],
                                 find_spec=lambda name: None) is None
    assert cli.confluent_missing(["kafka"], find_spec=lambda name: object()) is None
