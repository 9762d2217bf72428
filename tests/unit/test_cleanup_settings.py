"""The cleanup policy end to end without sockets (issue 38, docs/COMPACTION.md): parsing and
bounds (kera.codec.cleanup), the coordinator's create / alter / persist, the broker's stream
descriptors, keyless records refused on a compacted stream (kera and Kafka chunks, plain and
compressed), retention skipped for `compact` alone, and the Kafka listener's CreateTopics
configs and DescribeConfigs."""

from types import SimpleNamespace

import pytest
from kio.schema.errors import ErrorCode

from kera.broker.kafka import produce as kproduce
from kera.broker.kafka import topics
from kera.broker.streams import StreamInfo
from kera.codec import chunk, cleanup, kafka_batch
from kera.coordinator.core import Coordinator
from kera.coordinator.validate import StreamSpec
from kera.errors import BadRequest

from tests.unit.test_retention_core import MIN, broker, desc


def compacted(sid=1, policy="compact", **kw):
    return {**desc(sid, **kw), "cleanup_policy": policy}


# ---------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, canonical", [
    ("delete", "delete"), ("compact", "compact"), ("compact,delete", "compact,delete"),
    ("delete,compact", "compact,delete"), (" compact , delete", "compact,delete")])
def test_policy_spellings(text, canonical):
    assert cleanup.policy(text) == canonical


@pytest.mark.parametrize("bad", ["", "keep", "compact,keep", None, 1, "x" * 100])
def test_policy_refused_naming_the_choices(bad):
    with pytest.raises(BadRequest, match="compact,delete"):
        cleanup.policy(bad)


def test_settings_bounds():
    assert cleanup.setting("min_cleanable_dirty_ratio", 1) == 1.0
    for field, bad in [("min_cleanable_dirty_ratio", 1.5), ("min_cleanable_dirty_ratio", True),
                       ("delete_retention_ms", -1), ("min_compaction_lag_ms", 0.5),
                       ("max_compaction_lag_ms", "1")]:
        with pytest.raises(BadRequest, match=field):
            cleanup.setting(field, bad)
    with pytest.raises(BadRequest, match="max_compaction_lag_ms"):
        StreamSpec("s", min_compaction_lag_ms=10, max_compaction_lag_ms=5)
    with pytest.raises(BadRequest, match="active_groups 1"):
        StreamSpec("s", cleanup_policy="compact", active_groups=2)
    assert StreamSpec("s", active_groups=2).cleanup_policy == "delete"


def test_kafka_spellings_round_trip():
    assert cleanup.from_kafka("max_compaction_lag_ms", str(cleanup.KAFKA_LONG_MAX)) == 0
    assert cleanup.kafka_value("max_compaction_lag_ms", 0) == str(cleanup.KAFKA_LONG_MAX)
    assert cleanup.from_kafka("min_cleanable_dirty_ratio", "0.25") == 0.25
    with pytest.raises(BadRequest, match="delete.retention.ms"):
        cleanup.from_kafka("delete_retention_ms", "soon")


# ---------------------------------------------------------------------- coordinator

def coordinator():
    c = Coordinator(0.0)
    c.register(0.0, "broker", "127.0.0.1:1", "n")
    return c


def test_coordinator_create_alter_persist():
    c = coordinator()
    plain = c.create_stream(StreamSpec("plain"))
    assert plain["cleanup_policy"] == "delete" and "delete_retention_ms" not in plain
    d = c.handle("create_stream", {"name": "s", "cleanup_policy": "delete,compact",
                                   "delete_retention_ms": 5000,
                                   "min_cleanable_dirty_ratio": 0.1}, 0.0)["stream"]
    assert d["cleanup_policy"] == "compact,delete" and d["delete_retention_ms"] == 5000
    assert d["min_cleanable_dirty_ratio"] == 0.1 and d["max_compaction_lag_ms"] == 0
    v = d["version"]
    d = c.handle("alter_stream", {"name": "s", "cleanup_policy": "compact",
                                  "min_compaction_lag_ms": 100}, 0.0)["stream"]
    assert d["cleanup_policy"] == "compact" and d["min_compaction_lag_ms"] == 100
    assert d["delete_retention_ms"] == 5000 and d["version"] > v
    with pytest.raises(BadRequest, match="cleanup_policy"):
        c.handle("alter_stream", {"name": "s", "cleanup_policy": "forever"}, 0.0)
    with pytest.raises(BadRequest, match="min_cleanable_dirty_ratio"):
        c.handle("alter_stream", {"name": "s", "min_cleanable_dirty_ratio": 2}, 0.0)
    c2 = Coordinator(0.0, state=c.to_state())
    assert c2.describe_stream("s")["min_compaction_lag_ms"] == 100
    assert c2.describe_stream("s")["cleanup_policy"] == "compact"
    old = c.to_state()                          # written before cleanup policies existed
    for s in old["streams"]:
        for name in ("cleanup_policy", *cleanup.SETTINGS):
            s.pop(name, None)
    assert Coordinator(0.0, state=old).describe_stream("s")["cleanup_policy"] == "delete"


# ---------------------------------------------------------------------- broker

def test_broker_descriptor_fields():
    info = StreamInfo.from_descriptor(compacted(policy="compact,delete"))
    assert info.compacted and info.delete_retention_ms == cleanup.DEFAULT_DELETE_RETENTION_MS
    plain = StreamInfo.from_descriptor(desc())
    assert not plain.compacted and plain.cleanup_policy == "delete"
    with pytest.raises(BadRequest, match="cleanup_policy"):
        StreamInfo.from_descriptor(compacted(policy="sometimes"))


def keyed(seq, keys, compression=None, size=1):
    return chunk.encode(1, seq, 1, 0, [b"v" * size] * len(keys), keys=keys,
                        compression=compression)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_keyless_records_refused_on_a_compacted_stream(compression):
    b = broker(compacted())
    assert not isinstance(b.produce(0, [keyed(0, [b"a", b"b"], compression)], 0.0)[0][0], str)
    results = b.produce(1, [keyed(1, [b"a", None], compression),
                            chunk.encode(1, 1, 1, 0, [b"x"] * 3, compression=compression)], 0.0)
    for r in results:
        assert r[0] == "keyless_record" and r[2] is False, r
    assert "give every record a key" in results[0][1] and "1 of the 2" in results[0][1]
    assert not isinstance(b.produce(2, [keyed(1, [b"c"], compression)], 0.0)[0][0], str)
    assert b.stats()["refused_keyless_record"] == 2


def test_keyless_records_kept_on_a_delete_stream():
    b = broker(desc())
    r = b.produce(0, [chunk.encode(1, 0, 1, 0, [b"x"] * 3)], 0.0)
    assert not isinstance(r[0][0], str)


def test_keyless_kafka_batch_refused():
    b = broker(compacted())
    rows = [(1000, b"k", b"v", ()), (1001, None, b"w", ())]
    wrapped = chunk.wrap(kafka_batch.build(rows), 7 << 8, 0, 1, 0)
    assert b.produce(0, [wrapped], 0.0)[0][0] == "keyless_record"
    good = chunk.wrap(kafka_batch.build(rows[:1]), 7 << 8, 0, 1, 0)
    assert not isinstance(b.produce(1, [good], 0.0)[0][0], str)


@pytest.mark.parametrize("version, code", [(9, ErrorCode.invalid_record),
                                           (7, ErrorCode.corrupt_message)])
def test_kafka_produce_answers_keyless_as_kafka_does(version, code):
    e = kproduce.Entry("t", 0)
    e.frame = 0
    out = kproduce._partition(e, [["keyless_record", "no key", False]], version)
    assert out["error_code"] == code and out["error_message"] == "no key"


def test_retention_skips_a_compact_only_stream():
    keep = broker(compacted(retention_ms=MIN))
    both = broker(compacted(policy="compact,delete", retention_ms=MIN))
    for b in (keep, both):
        b.set_wall_clock(0)
        for seq in range(8):
            b.produce(seq, [keyed(seq, [b"k"] * 4, size=200)], 0.0)
    assert keep.enforce_retention(10 * MIN) == 0
    assert both.enforce_retention(10 * MIN) > 0


# ---------------------------------------------------------------------- Kafka listener

def test_create_topics_cleanup_configs():
    cfg = [SimpleNamespace(name="cleanup.policy", value="compact"),
           SimpleNamespace(name="delete.retention.ms", value="1000"),
           SimpleNamespace(name="max.compaction.lag.ms", value=str(cleanup.KAFKA_LONG_MAX)),
           SimpleNamespace(name="min.cleanable.dirty.ratio", value="0.3")]
    settings, why = topics._settings(cfg)
    assert why is None and settings == {"cleanup_policy": "compact", "delete_retention_ms": 1000,
                                        "max_compaction_lag_ms": 0,
                                        "min_cleanable_dirty_ratio": 0.3}
    settings, why = topics._settings([SimpleNamespace(name="cleanup.policy", value="never")])
    assert settings == {} and "cleanup_policy" in why


def test_describe_configs_shows_the_policy():
    info = SimpleNamespace(replication=1)
    plain = {c["name"]: c["value"] for c in topics.topic_configs(info, {"segment_size_bytes": 1})}
    assert plain["cleanup.policy"] == "delete"
    assert plain["delete.retention.ms"] == str(cleanup.DEFAULT_DELETE_RETENTION_MS)
    d = {"cleanup_policy": "compact", "min_compaction_lag_ms": 5, "max_compaction_lag_ms": 0,
         "delete_retention_ms": 7, "min_cleanable_dirty_ratio": 0.2}
    shown = {c["name"]: c for c in topics.topic_configs(info, d)}
    assert shown["cleanup.policy"]["value"] == "compact"
    assert shown["min.compaction.lag.ms"]["value"] == "5"
    assert shown["max.compaction.lag.ms"]["value"] == str(cleanup.KAFKA_LONG_MAX)
    assert shown["min.cleanable.dirty.ratio"]["value"] == "0.2"
    assert shown["delete.retention.ms"]["value"] == "7"


def test_conditional_appends_refused_on_a_compacted_stream():
    b = broker(compacted())
    c = chunk.encode(1, 0, 1, 0, [b"v"], keys=[b"k"], condition=([7], -1))
    r = b.produce(0, [c], 0.0)[0]
    assert r[0] == "bad_request" and "conditional appends" in r[1], r
    plain = broker(desc())
    assert not isinstance(plain.produce(0, [c], 0.0)[0][0], str)
