"""Records like Kafka's through real daemons: headers, tombstones (None, distinct from b""),
an explicit streamlet, and lz4/zstd chunk compression, read back transparently."""

import time

import pytest

from kera.client.admin import Admin
from kera.consumer import Consumer
from kera.producer import Producer

# Generous for a loaded 2-core machine: the records are produced and flushed before polling.
POLL_DEADLINE_S = 30


def _consume(bootstrap: str, stream: str, count: int, by_record: bool = False) -> list:
    """`count` records through poll_batch (columnar) or, `by_record`, through poll()."""
    consumer = Consumer(bootstrap, stream, start="earliest")
    records, deadline = [], time.monotonic() + POLL_DEADLINE_S
    try:
        while len(records) < count and time.monotonic() < deadline:
            if by_record:
                record = consumer.poll(timeout_s=1)
                records += [record] if record is not None else []
                continue
            for batch in consumer.poll_batch(timeout_s=1):
                records.extend(batch.records())
    finally:
        consumer.close()
    return records


@pytest.mark.parametrize("compression,by_record",
                         [(None, False), ("lz4", False), ("zstd", False), ("zstd", True)])
def test_headers_tombstones_and_compression_round_trip(local_cluster, compression, by_record):
    cluster = local_cluster(brokers=1)
    stream = f"hdr_{compression}_{by_record}"
    with Admin(cluster.bootstrap) as admin:
        admin.create_stream(stream, streamlets=3)
    sent = []
    with Producer(cluster.bootstrap, compression=compression) as p:
        for i in range(300):
            value = None if i % 7 == 0 else (b"" if i % 11 == 0 else b"value %d " % i * 5)
            headers = [("trace", b"%d" % i), ("é", b"\x00\xff")] if i % 2 else []
            p.send(stream, value, key=b"k%d" % (i % 5), headers=headers, streamlet=i % 3)
            sent.append((i % 3, value, tuple(headers)))
        batch_headers = [[("b", b"%d" % i)] if i % 2 else None for i in range(50)]
        p.send_batch(stream, [b"batch"] * 50, headers=batch_headers)
        p.flush()
    got = _consume(cluster.bootstrap, stream, len(sent) + 50, by_record)
    assert len(got) == len(sent) + 50
    assert sorted(r.headers for r in got if r.value == b"batch") == sorted(
        tuple(h or ()) for h in batch_headers)
    by_streamlet = {sl: [(sl, r.value, r.headers) for r in got if r.streamlet == sl and r.value != b"batch"]
                    for sl in range(3)}
    for sl in range(3):
        assert by_streamlet[sl] == [s for s in sent if s[0] == sl]
    assert sum(r.value is None for r in got) == sum(s[1] is None for s in sent) > 0
    assert any(r.value == b"" for r in got)


def test_compressed_chunks_with_headers_survive_failover_from_backups(fresh_cluster):
    """Backups store the compressed chunks as-is (their checksums are over the stored bytes);
    the broker that takes over rebuilds from them and consumers still decompress them."""
    cluster = fresh_cluster(brokers=2, backups=2, log_level="WARNING")
    with cluster.admin() as admin:
        admin.create_stream("hdr_failover", streamlets=2, replication=2)
    sent = []
    with Producer(cluster.bootstrap, compression="zstd") as p:
        for i in range(400):
            value = None if i % 9 == 0 else b"payload %d" % i * 4
            headers = [("n", b"%d" % i)]
            p.send("hdr_failover", value, headers=headers, streamlet=i % 2)
            sent.append((i % 2, value, tuple(headers)))
        sid = p.stream_info("hdr_failover").id
        owners = {p._meta.address_of(sid, sl) for sl in range(2)}
    assert cluster.brokers[0].address in owners  # the kill below moves a streamlet
    cluster.kill_broker(0)  # its streamlet fails over to broker 1, rebuilt from the backups
    with cluster.admin() as admin:
        admin.wait_ready("hdr_failover", 30.0)
    got = _consume(cluster.bootstrap, "hdr_failover", len(sent))
    for sl in range(2):
        assert [(r.streamlet, r.value, r.headers) for r in got if r.streamlet == sl] == \
            [s for s in sent if s[0] == sl]
