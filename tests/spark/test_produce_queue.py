"""The sink's send queue against a model broker with the protocol's produce rules, under lost
requests, lost replies and refusals: every chunk is stored exactly once, in sequence order."""

import random

import pytest

from kera.errors import KeraError, Timeout
from kera.spark.produce import ProduceQueue
from kera.spark.sink import producer_id


class ModelBroker:
    """PROTOCOL.md produce rules: duplicates acknowledged, gaps refused (retriable)."""

    def __init__(self):
        self.last: dict = {}
        self.stored: dict = {}

    def produce(self, chunks, refuse: set):
        results = []
        for key, seq, data in chunks:
            last = self.last.get(key, -1)
            if key in refuse:
                results.append(["throttled", "busy", True])
            elif seq <= last:
                results.append([0, 0, 0])  # duplicate: acknowledged, not stored
            elif seq == last + 1:
                self.last[key] = seq
                self.stored.setdefault(key, []).append(data)
                results.append([0, 0, seq])
            else:
                results.append(["sequence_gap", f"expected {last + 1}", True])
        return results


@pytest.mark.parametrize("seed", range(20))
def test_every_chunk_stored_once_in_order_despite_faults(seed):
    rnd = random.Random(seed)
    print("seed", seed)
    q = ProduceQueue(in_flight_per_broker=3, request_size_bytes=40, attempts_max=1000)
    broker = ModelBroker()
    keys = [(9, 1, sl) for sl in range(4)]
    want = {}
    for i in range(200):
        key = rnd.choice(keys)
        seq = len(want.setdefault(key, []))
        data = f"{key}-{seq}".encode().ljust(10)
        want[key].append(data)
        q.add(key, seq, data, "b0")
    now = 0.0
    in_transit = []  # (token, results or None when the reply is lost)
    for _ in range(100_000):
        if q.done:
            break
        now += 0.01
        for req in q.next_requests(now):
            fate = rnd.random()
            if fate < 0.1:
                in_transit.append((req.token, None))          # request lost
                continue
            refuse = {k for k in keys if rnd.random() < 0.1}
            results = broker.produce(req.chunks, refuse)
            in_transit.append((req.token, None if fate < 0.2 else results))  # reply lost
        rnd.shuffle(in_transit) if rnd.random() < 0.05 else None
        if in_transit:
            token, results = in_transit.pop(0)
            if results is None:
                q.on_failure(token, Timeout("lost"), now)
            else:
                q.on_reply(token, results, now)
    assert q.done
    assert broker.stored == want
    assert q.stale == {1}  # timeouts mark the stream for a placement refresh


def test_non_retriable_refusal_fails_the_task():
    q = ProduceQueue(1, 1000)
    q.add((9, 1, 0), 0, b"x", "b0")
    (req,) = q.next_requests(0.0)
    with pytest.raises(KeraError) as err:
        q.on_reply(req.token, [["corrupt_chunk", "bad", False]], 0.0)
    assert err.value.code == "corrupt_chunk"


def test_retries_are_bounded():
    q = ProduceQueue(1, 1000, attempts_max=3)
    q.add((9, 1, 0), 0, b"x", "b0")
    now = 0.0
    with pytest.raises(KeraError):
        for _ in range(10):
            now += 10
            for req in q.next_requests(now):
                q.on_failure(req.token, Timeout("lost"), now)


def test_requests_carry_one_chunk_per_streamlet_and_respect_the_window():
    q = ProduceQueue(in_flight_per_broker=2, request_size_bytes=1 << 20)
    for seq in range(3):
        q.add((9, 1, 0), seq, b"a", "b0")
        q.add((9, 1, 1), seq, b"b", "b0")
    q.add((9, 1, 2), 0, b"c", "b1")
    reqs = q.next_requests(0.0)
    per_broker = {}
    for r in reqs:
        per_broker.setdefault(r.address, []).append(r)
        assert len({k[1:] for k, _, _ in r.chunks}) == len(r.chunks)
    assert len(per_broker["b0"]) == 2 and len(per_broker["b1"]) == 1
    assert [[(k, s) for k, s, _ in r.chunks] for r in per_broker["b0"]] == [
        [((9, 1, 0), 0), ((9, 1, 1), 0)], [((9, 1, 0), 1), ((9, 1, 1), 1)]]
    assert q.next_requests(0.0) == []  # window full on b0, nothing left for b1


def test_two_producers_of_one_streamlet_never_share_a_request():
    q = ProduceQueue(in_flight_per_broker=4, request_size_bytes=1 << 20)
    q.add((1, 5, 0), 3, b"a", "b0")   # a later part of producer 1's sequence
    q.add((2, 5, 0), 0, b"b", "b0")
    reqs = q.next_requests(0.0)
    assert sorted(len(r.chunks) for r in reqs) == [1, 1]
    with pytest.raises(AssertionError):
        q.add((1, 5, 0), 5, b"skip", "b0")


def test_producer_id_is_stable_and_distinct():
    a = producer_id("q", "7", 1)
    assert a == producer_id("q", "7", 1)
    assert len({a, producer_id("q", "7", 2), producer_id("q", "8", 1), producer_id("r", "7", 1)}) == 4
    assert 0 < a < 2 ** 64


def test_sender_gives_up_on_an_unreachable_broker():
    import time

    from kera.local import free_port
    from kera.spark.metadata import Metadata, StreamInfo
    from kera.spark.produce import Sender

    sender = Sender(Metadata(f"127.0.0.1:{free_port()}", timeout_s=0.2), 1, 1 << 20, 1 << 20, timeout_s=0.2)
    info = StreamInfo("s", 1, 1, 1, (0,), {"0": f"127.0.0.1:{free_port()}"})
    started = time.monotonic()
    with pytest.raises(Timeout):
        sender.send(5, info, 0, 0, b"chunk")
        sender.flush()
    assert time.monotonic() - started < 10
    sender.close()
