"""Per-stream traffic: a broker core counts appends and fetches per stream, brokers' counts add
up per stream, rates come from two samples, and the view puts the busiest stream first."""

from kera.cli import main as cli

from kera.codec import chunk
from kera.broker.core import Broker, BrokerConfig
from kera.cli.stats_view import render_streams
from kera.daemon.stream_traffic import FIELDS, StreamTraffic, summed


def descriptor(name: str, sid: int) -> dict:
    return {"name": name, "id": sid, "streamlets": 1, "active_groups": 1, "replication": 1,
            "group_segments": 4, "segment_size_bytes": 1 << 16, "durability": "memory",
            "replication_capacity": 0, "placement": [1], "brokers": {"1": "127.0.0.1:1"},
            "version": 1, "ready": True}


def test_a_broker_counts_appends_and_fetches_per_stream():
    b = Broker("n1", BrokerConfig(), broker_id=1)
    b.apply_metadata([descriptor("a", 1), descriptor("b", 2)], 1)
    b.produce("p", [chunk.encode(7, 0, 1, 0, [b"x" * 10] * 3), chunk.encode(8, 0, 2, 0, [b"y"])], 0.0)
    b.produce("p", [chunk.encode(7, 1, 1, 0, [b"z"] * 2)], 0.0)
    b.reads.fetch([[1, 0, {"low": 0, "offsets": {}}, 1 << 20]])
    traffic = b.reads.stream_traffic()
    assert traffic["a"]["records_in"] == 5 and traffic["a"]["chunks_in"] == 2
    assert traffic["b"]["records_in"] == 1 and traffic["b"]["chunks_out"] == 0
    assert traffic["a"]["chunks_out"] == 2 and traffic["a"]["bytes_out"] == traffic["a"]["bytes_in"]


def test_brokers_add_up_and_bad_values_count_nothing():
    one, two = StreamTraffic(), StreamTraffic()
    one.appended(3, 100)
    two.appended(4, 50)
    two.fetched(2, 150)
    total = summed([{"s": one.as_dict()}, {"s": two.as_dict(), "t": {"records_in": "x"}}])
    assert total["s"] == {"records_in": 7, "chunks_in": 2, "bytes_in": 150, "chunks_out": 2,
                          "bytes_out": 150}
    assert total["t"] == dict.fromkeys(FIELDS, 0)


def test_rates_per_second_and_a_restarted_broker_counts_from_zero():
    before = {"s": {"records_in": 100, "bytes_in": 1000}}
    after = {"s": {"records_in": 300, "bytes_in": 400}, "new": {"records_in": 10}}
    assert cli._rates(before, after, 2.0) == {"s": {"records_in": 100.0, "bytes_in": 200.0},
                                             "new": {"records_in": 5.0}}


def test_the_view_lists_the_busiest_stream_first():
    text = render_streams({"small": {"bytes_in": 10}, "big": {"bytes_in": 5000}}, False)
    assert [line.split()[0] for line in text.splitlines()[2:]] == ["big", "small"]
    assert render_streams({}, True).startswith("no stream")
