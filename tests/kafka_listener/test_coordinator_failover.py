"""Kafka clients through a coordinator failover and a broker kill: three coordinators on a real
etcd (one leads), three brokers with Kafka listeners, an R=3 topic; a confluent-kafka
idempotent producer (acks=all) and a consumer group of two members committing as they read
keep running while the leading coordinator and the broker coordinating the group are killed
-9 together (issue 35).

What must hold: every acknowledged record is read by the group; a record is read twice only at
or after the partition's last commit before the rebalance that handed it on (a member resumes
exactly at the commit, never before it, never past what it had not read); the offsets committed
through the old leader are the ones OffsetFetch answers once another coordinator leads and
another broker coordinates the group; and the partitions stay dense and in the order sent."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition

from kafkit import Wire, create_topic, wait_for, zero_request

TOPIC = "orders-through-failover"
GROUP = "billing-through-failover"
PARTITIONS = 6
HEARTBEAT_MS = 100
LEASE_S = 2                  # a killed leader is replaced within about this long
SENDS_PER_TURN = 4           # records produced per turn of the test's loop
COMMIT_EVERY_S = 0.3
ACKED_BEFORE_KILL = 1_500
RUN_AFTER_S = 4.0            # production and commits after the failover
DELIVERY_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_MS = 5_000
SETTLE_S = 60.0              # a failover, a rebalance, on a loaded 2-core machine


def start(fresh_cluster, etcd):
    return fresh_cluster(
        coordinators=3, brokers=3, backups=3, kafka_port=0, heartbeat_interval_ms=HEARTBEAT_MS,
        log_level="INFO", extra_coordinator_args=[
            "--metadata", etcd.url, "--metadata-prefix", "kafka-failover",
            "--leader-lease-s", str(LEASE_S)])


def leading(cluster, found: list[int], not_this: int | None = None) -> bool:
    """Whether a coordinator other than `not_this` leads (appended to `found`)."""
    i = cluster.leader_index()
    if i is not None and i != not_this:
        found.append(i)
        return True
    return False


def group_coordinator(cluster) -> int:
    """The broker FindCoordinator names for GROUP (asked of the first running broker, over
    the wire, as clients ask)."""
    address = next(a for d, a in zip(cluster.brokers, cluster.kafka_addresses) if d.running())
    with Wire(address) as wire:
        reply = wire.request(zero_request(10, 1, key=GROUP, key_type=0))
    assert reply.error_code == 0, reply
    return reply.node_id


class Run:
    """The producer and the group's two members, driven from the test's thread, and the log
    of what happened in order: reads, successful commits, assignments."""

    def __init__(self, cluster):
        common = {"bootstrap.servers": cluster.kafka_bootstrap, "broker.address.family": "v4",
                  "socket.timeout.ms": CLIENT_TIMEOUT_MS,
                  "socket.connection.setup.timeout.ms": CLIENT_TIMEOUT_MS,
                  "error_cb": self._client_error}
        self.producer = Producer({
            **common, "enable.idempotence": True, "acks": "all", "linger.ms": 5,
            "message.timeout.ms": int(DELIVERY_TIMEOUT_S * 1000),
            "request.timeout.ms": CLIENT_TIMEOUT_MS})
        self.members = [Consumer({
            **common, "group.id": GROUP, "auto.offset.reset": "earliest",
            "enable.auto.commit": False, "session.timeout.ms": 10_000,
            "heartbeat.interval.ms": 500, "partition.assignment.strategy": "range"})
            for _ in range(2)]
        for m, member in enumerate(self.members):
            member.subscribe([TOPIC], on_assign=lambda c, ps, m=m: self._assigned(m, ps))
        self.sent = 0
        self.acked: dict[tuple[int, int], bytes] = {}
        self.failed: list = []
        self.fatal: list = []
        # What happened, in order: ("read", member, partition, offset, value), ("try",
        # partition, offset), ("commit", partition, offset), ("assign", member, partitions).
        self.log: list[tuple] = []
        self._last_commit = 0.0

    def _client_error(self, err) -> None:
        # Transport errors are expected while brokers die; a fatal one ends the client.
        if err.fatal():
            self.fatal.append(err)

    def _assigned(self, m: int, parts) -> None:
        self.log.append(("assign", m, sorted(tp.partition for tp in parts)))

    def _report(self, err, msg) -> None:
        if err is None:
            self.acked[(msg.partition(), msg.offset())] = msg.value()
        else:
            self.failed.append((msg.value(), err))

    def turn(self, produce: bool = True) -> None:
        if produce:
            for _ in range(SENDS_PER_TURN):
                self.producer.produce(TOPIC, value=b"%07d" % self.sent,
                                      partition=self.sent % PARTITIONS, on_delivery=self._report)
                self.sent += 1
        self.producer.poll(0)
        for m, member in enumerate(self.members):
            for msg in member.consume(num_messages=200, timeout=0.02):
                if msg.error() is None:
                    self.log.append(("read", m, msg.partition(), msg.offset(), msg.value()))
        if time.monotonic() - self._last_commit > COMMIT_EVERY_S:
            self.commit()

    def commit(self) -> None:
        """Each member commits its positions, synchronously; the log gets what was tried and
        what succeeded (a failed commit may still have been stored, as with Kafka)."""
        self._last_commit = time.monotonic()
        for member in self.members:
            parts = [tp for tp in member.position(member.assignment()) if tp.offset >= 0]
            if not parts:
                continue
            self.log += [("try", tp.partition, tp.offset) for tp in parts]
            try:
                done = member.commit(offsets=parts, asynchronous=False)
            except KafkaException:   # a rebalance, a coordinator moving
                continue
            self.log += [("commit", tp.partition, tp.offset) for tp in done if tp.error is None]

    def run_until(self, done, what: str, timeout_s: float = SETTLE_S, produce: bool = True) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
            assert not self.fatal, self.fatal
            self.turn(produce)

    def committed(self) -> dict[int, int]:
        """The last successful commit of each partition, from the log."""
        return {e[1]: e[2] for e in self.log if e[0] == "commit"}

    def may_be_committed(self) -> dict[int, set[int]]:
        """Per partition, the offsets OffsetFetch may answer now: the last successful commit,
        or one tried after it (failed, perhaps stored)."""
        out: dict[int, set[int]] = {}
        for e in self.log:
            if e[0] == "commit":
                out[e[1]] = {e[2]}
            elif e[0] == "try":
                out.setdefault(e[1], set()).add(e[2])
        return out

    def read_up_to(self) -> dict[int, int]:
        """Per partition, one past the highest offset read."""
        out: dict[int, int] = {}
        for e in self.log:
            if e[0] == "read":
                out[e[2]] = max(out.get(e[2], 0), e[3] + 1)
        return out

    def close(self) -> None:
        for member in self.members:
            member.close()
        self.producer.purge()    # (nothing is left after a flush; a failed test may leave some)
        self.producer.close()


def offset_fetch(cluster) -> dict[int, int]:
    """The group's committed offsets, as a fresh client (not a member) is told them."""
    asker = Consumer({"bootstrap.servers": cluster.kafka_bootstrap, "group.id": GROUP,
                      "broker.address.family": "v4", "enable.auto.commit": False})
    try:
        parts = asker.committed([TopicPartition(TOPIC, p) for p in range(PARTITIONS)],
                                timeout=CLIENT_TIMEOUT_MS / 1000)
    finally:
        asker.close()
    assert all(tp.error is None for tp in parts), parts
    return {tp.partition: tp.offset for tp in parts if tp.offset >= 0}


def test_a_group_reads_every_acknowledged_record_through_a_leader_and_broker_kill(
        etcd_cluster, fresh_cluster):
    etcd = etcd_cluster(members=1)
    cluster = start(fresh_cluster, etcd)
    create_topic(cluster, TOPIC, partitions=PARTITIONS, replication=3)
    run = Run(cluster)
    try:
        run.run_until(lambda: len(run.acked) >= ACKED_BEFORE_KILL and
                      len(run.read_up_to()) == PARTITIONS,
                      "records acknowledged and read from every partition")
        found: list[int] = []
        wait_for(lambda: leading(cluster, found), SETTLE_S, "a coordinator leading")
        old_leader, victim = found[-1], group_coordinator(cluster)
        with cluster.admin() as admin:
            placement = admin.describe_stream(TOPIC)["placement"]
        assert victim in placement, f"broker {victim} leads no partition: {placement}"
        killed_at = len(run.log)
        cluster.kill_coordinator(old_leader)
        cluster.kill_broker(victim)
        # Another coordinator leads, the group moves to another broker and rebalances, the
        # producer follows the killed broker's partitions to their new leaders: all while the
        # clients keep going.
        run.run_until(lambda: leading(cluster, found, not_this=old_leader),
                      "another coordinator to lead")
        new_leader = found[-1]
        run.run_until(lambda: group_coordinator(cluster) != victim,
                      "another broker to coordinate the group")
        # Every commit acknowledged before, through the old leader or the new, is kept.
        check_committed(offset_fetch(cluster), run,
                        f"after coordinator {new_leader} took over from {old_leader}")
        resumed = time.monotonic()
        run.run_until(lambda: time.monotonic() - resumed > RUN_AFTER_S, "production after")
        assert run.producer.flush(DELIVERY_TIMEOUT_S) == 0, "records left undelivered"
        ends = {}
        for p, o in run.acked:
            ends[p] = max(ends.get(p, 0), o + 1)
        run.run_until(lambda: all(run.read_up_to().get(p, 0) >= end for p, end in ends.items()),
                      "the group to read every acknowledged record", produce=False)
        run.commit()
    finally:
        run.close()
    check_committed(offset_fetch(cluster), run, "at the end")
    rebalanced = [e for e in run.log[killed_at:] if e[0] == "assign"]
    reads = [e for e in run.log if e[0] == "read"]
    print(f"coordinator {old_leader} -> {new_leader}, broker {victim} killed; sent {run.sent}, "
          f"{len(reads)} reads of {len({(e[2], e[3]) for e in reads})} records, "
          f"{sum(e[0] == 'commit' for e in run.log)} of {sum(e[0] == 'try' for e in run.log)} "
          f"partition commits acknowledged, assignments after the kill: "
          f"{[e[1:] for e in rebalanced]}")
    assert rebalanced, "the group did not rebalance when its coordinating broker died"

    assert not run.failed, f"{len(run.failed)} records not delivered: {run.failed[:3]}"
    assert len(run.acked) == run.sent, "two records acknowledged at one offset"
    check_reads(run.log, run.acked)


def check_committed(fetched: dict[int, int], run: Run, when: str) -> None:
    """What OffsetFetch answers is, per partition, the last acknowledged commit or one tried
    after it; a partition with an acknowledged commit has one."""
    acknowledged, possible = run.committed(), run.may_be_committed()
    for p, tried in possible.items():
        if p not in acknowledged:
            tried.add(None)               # none acknowledged: perhaps none stored
    wrong = {p: (fetched.get(p), acknowledged.get(p), sorted(possible.get(p, ()), key=str))
             for p in set(fetched) | set(possible)
             if fetched.get(p) not in possible.get(p, ())}
    assert not wrong, f"committed offsets {when}: (fetched, acknowledged, possible) by " \
                      f"partition: {wrong}"


def check_reads(log: list[tuple], acked: dict[tuple[int, int], bytes]) -> None:
    """Every acknowledged record read, with its value; each read either follows the member's
    previous one in its partition or starts where the partition was last committed (0 before
    any commit: auto.offset.reset=earliest; or a commit tried since, which may have been
    stored), so a record is read twice only at or after the last acknowledged commit."""
    committed: dict[int, int] = {}
    tried: dict[int, set[int]] = {}              # commits tried since the last acknowledged one
    last: dict[tuple[int, int], int] = {}        # (member, partition) -> offset last read
    seen: dict[tuple[int, int], bytes] = {}
    for event in log:
        if event[0] == "commit":
            committed[event[1]], tried[event[1]] = event[2], set()
        elif event[0] == "try":
            tried.setdefault(event[1], set()).add(event[2])
        elif event[0] == "assign":
            for p in range(PARTITIONS):
                last.pop((event[1], p), None)    # a new assignment starts afresh
        else:
            _, m, p, o, v = event
            previous = last.get((m, p))
            if previous is None or o != previous + 1:
                assert o == committed.get(p, 0) or o in tried.get(p, ()), \
                    f"member {m} read partition {p} from offset {o}, after {previous}, where " \
                    f"the last acknowledged commit was {committed.get(p)}"
            last[(m, p)] = o
            if (p, o) in seen:
                assert o >= committed.get(p, 0), f"partition {p} offset {o} read again below " \
                                                 f"the acknowledged commit {committed[p]}"
                assert seen[(p, o)] == v, f"partition {p} offset {o} changed"
            seen[(p, o)] = v
    missing = sorted(k for k, v in acked.items() if seen.get(k) != v)
    assert not missing, f"{len(missing)} acknowledged records not read, e.g. {missing[:5]}"
    for p in range(PARTITIONS):
        mine = sorted((o, v) for (q, o), v in seen.items() if q == p)
        assert [o for o, _ in mine] == list(range(len(mine))), f"partition {p}: offsets not dense"
        assert [v for _, v in mine] == sorted(v for _, v in mine), \
            f"partition {p}: records not in the order sent"
        assert len(mine) == sum(q == p for q, _ in acked), f"partition {p}: records not sent"
