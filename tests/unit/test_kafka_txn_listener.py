"""The Kafka listener's transactions, sans-IO: the broker core verifies a Kafka client's first
transactional batch of a transaction without adding the partition (Kafka's TV1 rule: the
client added it), refuses a plain batch from a producer whose transaction is open, and the
Fetch pieces (LSO, aborted list, kera transactional chunks as transactional batches); the
error codes per API version; the TransactionalId ACLs."""

from __future__ import annotations

from types import SimpleNamespace

from kio.index import load_request_schema
from kio.schema.errors import ErrorCode

from kera.broker.core import Broker, BrokerConfig
from kera.broker.kafka import authorize, transactions
from kera.broker.kafka.context import Advertised, Call, Context, Settings
from kera.broker.kafka.messages import KafkaRequest, build
from kera.broker.kafka.sasl import KafkaSecurity
from kera.broker.kafka.fetch import Part, aborted, as_batch, last_stable
from kera.broker.kafka.transactions import txn_code
from kera.codec import chunk, kafka_batch, txn
from kera.codec.chunk import wrap
from kera.errors import InvalidTxnState, PeerUnreachable, ProducerFenced
from kera.net.access import Guard
from kera.net.acl import Acl
from kera.net.keys import Principal

ME = 7
PID = 4242


def broker():
    b = Broker("n1", BrokerConfig(), broker_id=ME)
    b.apply_metadata([{"name": "s1", "id": 1, "streamlets": 1, "active_groups": 1,
                       "replication": 1, "group_segments": 4, "segment_size_bytes": 64 * 1024,
                       "durability": "memory", "replication_capacity": 0, "placement": [ME],
                       "brokers": {str(ME): "127.0.0.1:1"}, "version": 1, "ready": True}], 1)
    return b


def kafka_chunk(seq: int, transactional: bool = True, pid: int = PID, epoch: int = 0) -> bytes:
    batch = kafka_batch.build([(1000, None, b"v%d" % seq, ())], producer_id=pid,
                              producer_epoch=epoch, base_sequence=seq,
                              attributes=kafka_batch.TRANSACTIONAL if transactional else 0)
    return wrap(batch, txn.kera_producer_id(pid, epoch), seq, 1, 0)


def test_kafka_transactional_batch_is_verified_without_adding_the_partition():
    b = broker()
    assert b.produce("r1", [kafka_chunk(0)], 0.0) is None          # held for txn_verify
    [(key, fields)] = b.take_txn_verifies()
    assert fields == {"producer_id": PID, "epoch": 0, "part": ["s1", 0], "add": False}
    b.txn_verified(key, {"txn": 1}, None)
    assert dict(b.take_replies())["r1"] == [[0, 0, 0, 0]]
    assert b.produce("r2", [kafka_chunk(1)], 0.0) == [[0, 0, 1, 1]]  # open here: not asked
    assert b.take_txn_verifies() == []


def test_a_partition_not_added_refuses_the_batch():
    b = broker()
    b.produce("r1", [kafka_chunk(0)], 0.0)
    [(key, _)] = b.take_txn_verifies()
    b.txn_verified(key, None, InvalidTxnState("producer 4242 has no open transaction"))
    [result] = dict(b.take_replies())["r1"]
    assert result[0] == InvalidTxnState.code
    assert b.reads.number_span(1, 0) == (0, 0), "nothing stored"


def test_plain_batch_from_a_producer_in_a_transaction_is_refused_until_it_ends():
    b = broker()
    b.produce("r1", [kafka_chunk(0)], 0.0)
    [(key, _)] = b.take_txn_verifies()
    b.txn_verified(key, {"txn": 1}, None)
    [refused] = b.produce("r2", [kafka_chunk(1, transactional=False)], 0.0)
    assert refused[0] == InvalidTxnState.code
    assert b.txn_markers("m", [["tid", PID, 0, 1, True, "s1", 0]], 0.0) is not None
    assert b.produce("r3", [kafka_chunk(1, transactional=False)], 0.0)[0][3] == 2


def test_lso_and_aborted_list_of_a_fetched_span():
    b = broker()
    b.produce("r1", [kafka_chunk(0), kafka_chunk(1)], 0.0)
    [(key, _)] = b.take_txn_verifies()
    b.txn_verified(key, {"txn": 1}, None)
    assert last_stable(b, 1, 0, 0, 2)[0] == 0                      # open from offset 0
    b.txn_markers("m", [["tid", PID, 0, 1, False, "s1", 0]], 0.0)  # aborted: marker at 2
    lso, txns = last_stable(b, 1, 0, 0, 3)
    assert lso == 3
    part = Part("s1", SimpleNamespace(partition=0, fetch_offset=1, partition_max_bytes=1))
    part.txns, part.served_end = txns, 3
    assert aborted(part) == [{"producer_id": PID, "first_offset": 0}]
    part.offset = 3                                                # past it: none
    assert aborted(part) == []
    assert last_stable(broker(), 1, 0, 0, 5) == (5, None)          # no transaction ever


def test_kera_transactional_chunk_is_served_as_a_transactional_batch():
    c = bytearray(chunk.encode(txn.kera_producer_id(PID, 3), txn.txn_sequence(0), 1, 0,
                               [b"a", b"b"]))
    chunk.stamp(c, 0, 0, 0, 10)
    h = kafka_batch.check(as_batch(memoryview(c)))
    assert (h.transactional, h.producer_id, h.producer_epoch, h.base_offset) == (True, PID, 3, 10)
    plain = bytearray(chunk.encode(77, 0, 1, 0, [b"a"]))
    chunk.stamp(plain, 0, 0, 0, 0)
    assert not kafka_batch.check(as_batch(memoryview(plain))).transactional


def test_error_codes_per_api_version():
    fenced = ProducerFenced("fenced")
    assert txn_code(fenced, 26, 2) == ErrorCode.producer_fenced          # EndTxn v2+
    assert txn_code(fenced, 26, 1) == ErrorCode.invalid_producer_epoch   # before KIP-588
    assert txn_code(fenced, 22, 3) == ErrorCode.invalid_producer_epoch   # InitProducerId < 4
    assert txn_code(PeerUnreachable("down"), 24, 3) == ErrorCode.coordinator_not_available
    assert txn_code(None, 25, 3) == ErrorCode.none


# ---------------------------------------------------------------------- ACLs
class Conn:
    def __init__(self):
        self.state = {"principal": Principal("bob", "client")}
        self.peer = "test"
        self.closed = None

    def close(self, why) -> None:
        self.closed = why


class Answered(Call):
    """A call whose answer is kept as the handler's (or the rule's) dict."""
    __slots__ = ("data",)

    def answer(self, data) -> None:
        self.data = data


def grants(*rules) -> Context:
    guard = Guard(daemon="broker")
    guard.acls.replace(Acl.parse(["bob", "allow", *r, "literal"]) for r in rules)
    return Context(core=None, catalog=None, clock=SimpleNamespace(monotonic=lambda: 0.0),
                   wake_at=lambda t: None,
                   settings=Settings(security=KafkaSecurity(tls=None, users=None, guard=guard)))


def call(key: int, version: int, body: dict) -> Answered:
    entity = build(load_request_schema(key, version), body)
    return Answered(Conn(), KafkaRequest(key, version, 1, "t", entity), None)


def test_init_producer_id_needs_write_on_the_transactional_id():
    body = {"transactional_id": "t1", "transaction_timeout": 60_000}
    refused = call(22, 4, body)
    assert not authorize.admit(grants(), refused)
    assert refused.data["error_code"] == ErrorCode.transactional_id_authorization_failed
    assert authorize.admit(grants(["write", "transactional_id", "t1"]), call(22, 4, body))
    assert authorize.admit(grants(), call(22, 4, {**body, "transactional_id": None}))


def test_add_partitions_needs_the_id_and_the_topics_and_is_all_or_nothing():
    body = {"v3_and_below_transactional_id": "t1", "v3_and_below_producer_id": 1,
            "v3_and_below_producer_epoch": 0, "v3_and_below_topics": [
                {"name": "mine", "partitions": [0]}, {"name": "theirs", "partitions": [0, 1]}]}
    ctx = grants(["write", "transactional_id", "t1"], ["write", "stream", "mine"])
    refused = call(24, 3, body)
    assert not authorize.admit(ctx, refused)
    codes = {t["name"]: [p["partition_error_code"] for p in t["results_by_partition"]]
             for t in refused.data["results_by_topic_v3_and_below"]}
    assert codes == {"mine": [ErrorCode.operation_not_attempted],
                     "theirs": [ErrorCode.topic_authorization_failed] * 2}
    assert authorize.admit(grants(["write", "transactional_id", "t1"], ["write", "stream", "mine"],
                                  ["write", "stream", "theirs"]), call(24, 3, body))


def test_end_txn_and_add_offsets_need_the_id_and_the_group():
    end = {"transactional_id": "t1", "producer_id": 1, "producer_epoch": 0, "committed": True}
    refused = call(26, 3, end)
    assert not authorize.admit(grants(), refused)
    assert refused.data["error_code"] == ErrorCode.transactional_id_authorization_failed
    assert authorize.admit(grants(["write", "transactional_id", "t1"]), call(26, 3, end))
    offsets = {"transactional_id": "t1", "producer_id": 1, "producer_epoch": 0, "group_id": "g"}
    no_group = call(25, 3, offsets)
    assert not authorize.admit(grants(["write", "transactional_id", "t1"]), no_group)
    assert no_group.data["error_code"] == ErrorCode.group_authorization_failed


def test_describe_transactions_answers_the_ids_not_described():
    ctx = grants(["describe", "transactional_id", "seen"])
    c = call(65, 0, {"transactional_ids": ["seen", "hidden"]})
    assert authorize.admit(ctx, c)
    assert list(c.body.transactional_ids) == ["seen"]
    states = c.amend({"transaction_states": [{"transactional_id": "seen"}]})["transaction_states"]
    assert [(s["transactional_id"], s.get("error_code", 0)) for s in states] == \
        [("seen", 0), ("hidden", ErrorCode.transactional_id_authorization_failed)]


# ---------------------------------------------------------------------- handlers
class Calls:
    """The coordinator as the handlers see it: records each call, answers `reply`/`error`."""

    def __init__(self, reply=None, error=None):
        self.made: list = []
        self.reply, self.error = reply or {}, error

    def call(self, op, fields, done) -> None:
        self.made.append((op, fields))
        done(None if self.error else self.reply, self.error)


def handler_ctx(calls: Calls) -> Context:
    topics = {"t": SimpleNamespace(streamlets=2, active_groups=1),
              "q": SimpleNamespace(streamlets=1, active_groups=2)}
    catalog = SimpleNamespace(brokers={}, calls=calls, topics=topics,
                              fresh=lambda then: then(None))
    return Context(core=SimpleNamespace(broker_id=0), catalog=catalog,
                   clock=SimpleNamespace(monotonic=lambda: 0.0), wake_at=lambda t: None,
                   settings=Settings(advertise=Advertised("127.0.0.1", 9092)))


def txn_commit_body(generation: int, member: str) -> dict:
    return {"transactional_id": "t1", "group_id": "g", "producer_id": 5, "producer_epoch": 1,
            "generation_id": generation, "member_id": member, "topics": [
                {"name": "t", "partitions": [{"partition_index": 1, "committed_offset": 40,
                                              "committed_leader_epoch": -1,
                                              "committed_metadata": "m"}]}]}


def codes_of(data: dict, topics: str, parts: str, code: str) -> list:
    return [p[code] for t in data[topics] for p in t[parts]]


def test_txn_offset_commit_checks_the_member_then_joins_kafka_positions():
    calls = Calls()
    stale = call(28, 3, txn_commit_body(3, "gone-member"))
    transactions.handle_txn_offset_commit(handler_ctx(calls), stale)
    assert codes_of(stale.data, "topics", "partitions", "error_code") == \
        [ErrorCode.illegal_generation] and calls.made == []
    ok = call(28, 3, txn_commit_body(-1, ""))
    transactions.handle_txn_offset_commit(handler_ctx(calls), ok)
    assert codes_of(ok.data, "topics", "partitions", "error_code") == [ErrorCode.none]
    assert calls.made == [("txn_add_positions", {
        "transactional_id": "t1", "producer_id": 5, "epoch": 1, "group": "g", "kafka": True,
        "positions": [["t", 1, [40, "m"]]]})]
    for version, code in ((3, ErrorCode.producer_fenced), (2, ErrorCode.invalid_producer_epoch)):
        fenced = call(28, version, txn_commit_body(-1, ""))
        transactions.handle_txn_offset_commit(handler_ctx(Calls(error=ProducerFenced("x"))),
                                              fenced)
        assert codes_of(fenced.data, "topics", "partitions", "error_code") == [code]


def test_add_partitions_refuses_unknown_and_multi_slot_partitions_all_or_nothing():
    def body(*topics) -> dict:
        return {"v3_and_below_transactional_id": "t1", "v3_and_below_producer_id": 5,
                "v3_and_below_producer_epoch": 1,
                "v3_and_below_topics": [{"name": n, "partitions": ps} for n, ps in topics]}
    calls = Calls()
    refused = call(24, 3, body(("t", [0, 2]), ("q", [0])))
    transactions.handle_add_partitions(handler_ctx(calls), refused)
    assert codes_of(refused.data, "results_by_topic_v3_and_below", "results_by_partition",
                    "partition_error_code") == [ErrorCode.operation_not_attempted,
                                                ErrorCode.unknown_topic_or_partition,
                                                ErrorCode.invalid_request]
    assert calls.made == []
    added = call(24, 3, body(("t", [0, 1])))
    transactions.handle_add_partitions(handler_ctx(calls), added)
    assert calls.made == [("txn_add_parts", {"transactional_id": "t1", "producer_id": 5,
                                             "epoch": 1, "parts": [["t", 0], ["t", 1]]})]
    assert set(codes_of(added.data, "results_by_topic_v3_and_below", "results_by_partition",
                        "partition_error_code")) == {ErrorCode.none}
