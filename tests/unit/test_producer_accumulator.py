"""The producer's source side: accumulation, sealing, sticky streamlets, linger. No sockets."""

import pytest
from crc32c import crc32c

from kera.codec import chunk
from kera.errors import RecordTooLarge
from kera.client.metadata import StreamInfo
from kera.producer.accumulator import OPENED, SEALED, Accumulator
from kera.producer.pipeline import Pipeline

PID = 0x1234_5678_9ABC_DEF0
CHUNK = 1024


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def info(streamlets=4, sid=9, active_groups=2, name="s"):
    return StreamInfo(name=name, id=sid, streamlets=streamlets, active_groups=active_groups,
                      replication=1, placement=tuple([1] * streamlets), brokers={1: "h:1"},
                      version=1, ready=True)


def make(chunk_size=CHUNK, max_record=64 * 1024, linger_s=0.005):
    pipe = Pipeline(request_size_bytes=1 << 20, in_flight_per_broker=4, retries_max=5,
                    request_timeout_s=1.0)
    clock = Clock()
    stamps = iter(range(1_000_000, 10_000_000))
    acc = Accumulator(pipe, PID, chunk_size_bytes=chunk_size, max_record_bytes=max_record,
                      linger_s=linger_s, clock=clock, wall_clock_us=lambda: next(stamps))
    return acc, pipe, clock


def sealed(pipe):
    """Every queued chunk, decoded, by (streamlet) in queue order."""
    out = {}
    for (sid, sl), lane in pipe.lanes.items():
        out[sl] = [chunk.Chunk(c.data) for c in lane.chunks]
    return out


def test_keyed_records_go_to_crc32c_streamlet_and_decode_exactly():
    acc, pipe, _ = make()
    st = acc.stream_state(info())
    sent = []
    for i in range(200):
        key = f"user-{i % 7}".encode()
        value = f"value-{i}".encode() * (i % 5)
        acc.append(st, value, key, 1000 + i)
        sent.append((crc32c(key) % 4, key, value, 1000 + i))
    acc.seal_all()
    got = sealed(pipe)
    for sl in range(4):
        want = [(k, v, t) for s, k, v, t in sent if s == sl]
        have = [r for c in got.get(sl, []) for r in c.records()]
        assert have == want
        seqs = [c.header.sequence for c in got.get(sl, [])]
        assert seqs == list(range(len(seqs)))  # dense per (producer, streamlet)
        for c in got.get(sl, []):
            assert c.header.producer_id == PID and c.header.stream_id == 9 and c.header.streamlet == sl
            assert len(c.buf) <= CHUNK
    assert acc.open_bytes == 0
    assert pipe.pending_bytes == sum(len(c.data) for lane in pipe.lanes.values() for c in lane.chunks)


def test_full_chunk_is_sealed_and_never_exceeds_chunk_size():
    acc, pipe, _ = make()
    st = acc.stream_state(info(streamlets=1))
    events = [acc.append(st, b"x" * 100, None, None) for _ in range(30)]
    assert events[0] == OPENED
    assert SEALED in events
    chunks = sealed(pipe)[0]
    assert len(chunks) >= 2
    for c in chunks:
        assert len(c.buf) <= CHUNK
        # full: one more record would not have fit
        assert len(c.buf) + 112 > CHUNK
    assert sum(len(c) for c in chunks) + len(st.open[0].values) == 30


def test_keyless_records_stick_to_one_streamlet_then_move_round_robin():
    acc, pipe, _ = make()
    st = acc.stream_state(info(streamlets=3))
    for i in range(100):
        acc.append(st, b"v" * 50, None, i)
    acc.seal_all()
    got = sealed(pipe)
    # Chunks fill in streamlet order 0, 1, 2, 0, 1, ... and each (but the last) is full.
    order = sorted((c.timestamps[0], sl) for sl, cs in got.items() for c in cs)
    assert [sl for _, sl in order] == [i % 3 for i in range(len(order))]
    stamps = [t for _, sl in order for c in got[sl] if c.timestamps[0] == _ for t in c.timestamps.tolist()]
    assert stamps == list(range(100))


def test_record_larger_than_a_chunk_gets_a_chunk_of_its_own():
    acc, pipe, _ = make()
    st = acc.stream_state(info(streamlets=1))
    acc.append(st, b"a", None, 1)
    acc.append(st, b"B" * 5000, b"k", 2)
    acc.append(st, b"c", None, 3)
    acc.seal_all()
    chunks = sealed(pipe)[0]
    assert [c.values() for c in chunks] == [[b"a"], [b"B" * 5000], [b"c"]]
    assert chunks[1].keys() == [b"k"]


def test_record_over_max_record_bytes_is_refused_and_nothing_changes():
    acc, pipe, _ = make(max_record=1000)
    st = acc.stream_state(info(streamlets=1))
    acc.append(st, b"a", None, 1)
    with pytest.raises(RecordTooLarge):
        acc.append(st, b"x" * 1001, None, 2)
    acc.seal_all()
    assert [c.values() for c in sealed(pipe)[0]] == [[b"a"]]


def test_linger_seals_only_chunks_open_long_enough():
    acc, pipe, clock = make(linger_s=0.005)
    st = acc.stream_state(info(streamlets=2))
    acc.append(st, b"a", b"k0", 1)
    first_sl = crc32c(b"k0") % 2
    clock.now += 0.003
    other = next(k for k in (b"k1", b"k2", b"k3", b"k4") if crc32c(k) % 2 != first_sl)
    acc.append(st, b"b", other, 2)
    assert acc.next_linger_deadline() == pytest.approx(100.005)
    clock.now += 0.002
    assert acc.seal_lingering(clock.now) == 1
    assert st.open[first_sl] is None and st.open[1 - first_sl] is not None
    clock.now += 0.003
    assert acc.seal_lingering(clock.now) == 1
    assert acc.next_linger_deadline() is None


def test_keyless_and_keyed_records_mix_in_one_chunk():
    acc, pipe, _ = make()
    st = acc.stream_state(info(streamlets=1))
    acc.append(st, b"a", None, 1)
    acc.append(st, b"b", b"key", 2)
    acc.seal_all()
    (c,) = sealed(pipe)[0]
    assert list(c.records()) == [(None, b"a", 1), (b"key", b"b", 2)]


def test_default_timestamp_comes_from_the_wall_clock():
    acc, pipe, _ = make()
    st = acc.stream_state(info(streamlets=1))
    acc.append(st, b"a", None, None)
    acc.append(st, b"b", None, None)
    acc.seal_all()
    (c,) = sealed(pipe)[0]
    assert c.timestamps.tolist() == [1_000_000, 1_000_001]


def test_drop_stream_discards_open_chunks():
    acc, pipe, _ = make()
    st = acc.stream_state(info(streamlets=2))
    for i in range(5):
        acc.append(st, b"v", str(i).encode(), i)
    assert acc.drop_stream(st) == 5
    assert acc.open_bytes == 0 and acc.seal_all() == 0
