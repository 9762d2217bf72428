"""What compaction shows (docs/COMPACTION.md, "Visible") and a quiet streamlet's deletes: per
compacted stream the dirty ratio, passes, bytes before and after and their time, in the
broker's `stats` (kera.broker.compactor.Compactor.stream_stats), `kera stats`
(kera.cli.stats_view) and Prometheus gauges labelled by stream; and tombstones that go once
past delete.retention.ms although nothing new was written (KIP-534's delete horizon makes a
pass due)."""

import re

from kera.broker import compactor
from kera.broker.compaction_service import timed_pass
from kera.cli.stats_view import compaction_streams, render
from kera.daemon.metrics import labelled_text

from tests.unit.test_broker_replication import FakeBackups, ack, broker
from kera.codec import chunk
from tests.unit.test_compactor import desc, finished_end, latest, produce, rows


def swap_pass(b, c, backups, now_ms):
    job = c.next_pass(now_ms)
    assert job is not None
    c.built(timed_pass(job), None)
    ack(b, backups, b.sync(1.0), 1.0)
    c.on_durable()
    assert c.pending is None


def test_stream_stats_show_the_dirty_ratio_passes_bytes_and_time():
    backups = FakeBackups()
    b = broker(desc(), {**desc(), "name": "plain", "id": 2, "cleanup_policy": "delete"})
    produce(b, backups)
    c = compactor.Compactor(b)
    before = c.stream_stats(1000)
    assert set(before) == {"s1"}              # only compacted streams have a row
    row = before["s1"]
    assert row["dirty_ratio"] == 1.0 and row["clean_bytes"] == 0 and row["dirty_bytes"] > 0
    assert row["passes"] == 0 and row["bytes_before"] == row["bytes_after"] == 0
    swap_pass(b, c, backups, 1000)
    row = c.stream_stats(1000)["s1"]
    assert row["passes"] == 1 and row["dirty_ratio"] == 0.0 and row["dirty_bytes"] == 0
    assert 0 < row["bytes_after"] < row["bytes_before"] and row["seconds"] > 0
    assert (c.passes, c.bytes_before, c.bytes_after, c.seconds) == \
        (1, row["bytes_before"], row["bytes_after"], row["seconds"])
    assert row["clean_bytes"] < before["s1"]["dirty_bytes"]   # the memory it holds shrank


def test_a_deleted_streams_counters_go_with_it():
    backups = FakeBackups()
    b = broker(desc())
    produce(b, backups)
    c = compactor.Compactor(b)
    swap_pass(b, c, backups, 1000)
    b.apply_metadata([], 3, deleted=[[1, 2]])
    assert c.stream_stats(1000) == {} and c.streams == {}
    assert c.passes == 1   # the broker's own count since start stays


def pad(b, backups, written, chunks=30):
    """Keys written once after the deletes, so the groups holding them finish."""
    n = len(written)
    for seq in range(len(written) // 8, len(written) // 8 + chunks):
        keys = [b"pad%04d" % (seq * 8 + i) for i in range(8)]
        b.produce(seq, [chunk.encode(1, seq, 1, 0, [b"." * 100] * 8, keys=keys)], 0.0)
        ack(b, backups, b.sync(0.0))
        written += [(n + i, keys[i], b"." * 100) for i in range(8)]
        n += 8


def test_tombstones_go_past_delete_retention_without_new_writes():
    backups = FakeBackups()
    b = broker(desc(delete_retention_ms=5000))
    written = produce(b, backups)
    pad(b, backups, written)
    c = compactor.Compactor(b)
    swap_pass(b, c, backups, 1000)              # stamps the tombstones at 1000
    end = finished_end(b)
    assert rows(b) == latest(written, end)
    assert all(n < end for n, _, v in written if v is None)   # the deletes were compacted
    assert {r[1] for r in rows(b) if r[2] is None} == {b"k03", b"k17"}
    assert c.next_pass(5999) is None            # nothing dirty, no tombstone due yet
    swap_pass(b, c, backups, 6000)
    got = rows(b)
    assert not any(r[2] is None for r in got)
    assert got == [r for r in latest(written, end) if r[1] not in (b"k03", b"k17")]
    assert c.next_pass(10**9) is None           # no tombstone left: nothing due again


def test_kera_stats_adds_up_each_compacted_stream_over_brokers():
    brokers = {
        "0": {"compaction_passes": 2, "compaction_streams": {"t": {
            "clean_bytes": 1000, "dirty_bytes": 1000, "passes": 2, "bytes_before": 50000,
            "bytes_after": 2000, "seconds": 0.5, "dirty_ratio": 0.5}}},
        "1": {"compaction_passes": 1, "compaction_streams": {"t": {
            "clean_bytes": 3000, "dirty_bytes": 0, "passes": 1, "bytes_before": 5000,
            "bytes_after": 1000, "seconds": 0.25, "dirty_ratio": 0.0}}},
    }
    summed = compaction_streams(brokers)["t"]
    assert summed["dirty_ratio"] == 0.2 and summed["passes"] == 3
    assert (summed["bytes_before"], summed["bytes_after"], summed["seconds"]) == (55000, 3000, 0.75)
    text = render({"brokers": brokers, "backups": {}})
    assert "compaction_streams" not in text       # not flattened into the counters
    row = next(ln for ln in text.splitlines() if ln.startswith("t "))
    assert row.split() == ["t", "0.200", "1000", "B", "3.9", "KiB", "3", "53.7", "KiB",
                           "2.9", "KiB", "0.75"]


def test_metrics_have_one_gauge_per_field_labelled_by_stream():
    text = labelled_text("kera_broker_compaction", "stream", {"t": {
        "dirty_ratio": 0.25, "passes": 3, "bytes_before": 10, "bytes_after": 4, "seconds": 0.5}})
    samples = dict(re.findall(r'^(kera_broker_compaction_\w+)\{stream="t"\} (\S+)$', text, re.M))
    assert samples == {"kera_broker_compaction_dirty_ratio": "0.25",
                       "kera_broker_compaction_passes": "3",
                       "kera_broker_compaction_bytes_before": "10",
                       "kera_broker_compaction_bytes_after": "4",
                       "kera_broker_compaction_seconds": "0.5"}
