"""Delivery results through real daemons: send() futures and on_delivery resolve to the
positions consumers see; with one streamlet's broker killed (SIGKILL), flush() names that
streamlet and its record count, and the records of the live broker are reported delivered."""

import pytest

from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.errors import Undelivered
from kera.producer import Producer

RECORDS_PER_STREAMLET = 100
# Shorter than the 2 s dead-broker declaration and the 10 s request timeout: the killed
# broker's records are certainly still unacknowledged when flush gives up.
FLUSH_TIMEOUT_S = 1.5
# Generous for a loaded machine: a live broker acknowledges within milliseconds.
RESULT_TIMEOUT_S = 20


def test_futures_resolve_to_the_positions_consumers_read(local_cluster):
    cluster = local_cluster(brokers=1)
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream("delivered", streamlets=2)
    calls = []
    with Producer(cluster.bootstrap) as p:
        futures = [p.send("delivered", b"v%d" % i, streamlet=i % 2,
                          on_delivery=lambda err, md: calls.append((err, md))) for i in range(10)]
        batch_futures = p.send_batch("delivered", [b"b"] * 5)
        p.flush()
    got = [f.result(RESULT_TIMEOUT_S) for f in futures]
    assert sorted((err, md) for err, md in calls) == sorted((None, md) for md in got)
    assert sum(f.result(RESULT_TIMEOUT_S).count for f in batch_futures) == 5
    consumer = Consumer(cluster.bootstrap, "delivered", start="earliest")
    try:
        read, numbers = {}, {}
        while len(read) < 15:
            r = consumer.poll(timeout_s=RESULT_TIMEOUT_S)
            assert r is not None
            read[(r.streamlet, r.group, r.offset)] = r.value
            numbers[(r.streamlet, r.group, r.offset)] = r.number
    finally:
        consumer.close()
    for i, md in enumerate(got):
        assert (md.stream, md.streamlet) == ("delivered", i % 2)
        assert read[(md.streamlet, md.group, md.offset)] == b"v%d" % i
        # The record number the producer is told is the one consumers read.
        assert numbers[(md.streamlet, md.group, md.offset)] == md.number
    # One active group per streamlet: each streamlet's records are numbered 0..N-1.
    for sl in (0, 1):
        assert sorted(n for (s, _, _), n in numbers.items() if s == sl) == list(
            range(sum(1 for k in numbers if k[0] == sl)))


def test_flush_names_the_dead_streamlet_and_the_rest_are_delivered(fresh_cluster):
    cluster = fresh_cluster(brokers=2)
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream("halfdead", streamlets=4)
    p = Producer(cluster.bootstrap)
    try:
        info = p.stream_info("halfdead")
        owner = {sl: p._meta.address_of(info.id, sl) for sl in range(info.streamlets)}
        dead_index = next(i for i, b in enumerate(cluster.brokers) if b.address == owner[0])
        dead_sl = 0
        live_sl = next(sl for sl, a in owner.items() if a != owner[0])
        cluster.kill_broker(dead_index)
        live = [p.send("halfdead", b"x", streamlet=live_sl) for _ in range(RECORDS_PER_STREAMLET)]
        dead = [p.send("halfdead", b"y", streamlet=dead_sl) for _ in range(RECORDS_PER_STREAMLET)]
        with pytest.raises(Undelivered) as caught:
            p.flush(timeout=FLUSH_TIMEOUT_S)
        err = caught.value
        assert err.streamlets == [("halfdead", dead_sl)] and err.streams == ["halfdead"]
        assert err.records == RECORDS_PER_STREAMLET
        assert f"'halfdead' streamlet {dead_sl} ({RECORDS_PER_STREAMLET})" in str(err)
        offsets = sorted(f.result(RESULT_TIMEOUT_S).offset for f in live)
        assert offsets == list(range(RECORDS_PER_STREAMLET))
        assert not any(f.done() for f in dead)
    finally:
        try:
            p.close(timeout=FLUSH_TIMEOUT_S)
        except Undelivered:
            pass  # the dead broker's records: what the test is about
