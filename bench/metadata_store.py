"""Metadata operations per second through a real coordinator: on its file store vs on etcd.

    python -m bench.metadata_store [--ops N] [--rounds R] [--etcd etcd://HOST:PORT,...]

Two local clusters (a coordinator and one broker each) run at once, one with the default file
store and one with `--metadata etcd://...` (a 1-member etcd started for the run unless --etcd
names one). Each round times N `create_stream` calls, then N consumer-group commits (one
`group_commit` request each, as `Consumer.commit()` sends), on each cluster in turn, so both
see the same machine load; the figure is the median over rounds, and the ratio file / etcd.
Every operation is acknowledged only once its change is stored (an fdatasync, or an etcd
transaction committed by a majority of the etcd members).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kera.net import rpc
from kera.cli.local import LocalCluster

GROUP = "bench"
STREAMLETS = 1


def create_streams(cluster: LocalCluster, round_no: int, n: int) -> float:
    with cluster.admin() as admin:
        started = time.perf_counter()
        for i in range(n):
            admin.create_stream(f"s-{round_no}-{i}", streamlets=STREAMLETS, wait_ready=False)
        return n / (time.perf_counter() - started)


def join_group(cluster: LocalCluster, stream: str) -> tuple[str, int]:
    """A group member holding `stream`'s streamlet: (member id, member epoch)."""
    reply = {}
    for _ in range(50):   # the assignment arrives within a few heartbeats
        reply = rpc.call(cluster.bootstrap, "group_heartbeat", {
            "group": GROUP, "member_id": reply.get("member_id", ""),
            "member_epoch": reply.get("member_epoch", 0), "streams": [stream],
            "owned": reply.get("assignment", [])})[0]
        if reply["assignment"]:
            return reply["member_id"], reply["member_epoch"]
        time.sleep(0.05)
    raise RuntimeError(f"no assignment of {stream} in group {GROUP}")


# Commits between the member's heartbeats: it must not miss its session while it commits.
COMMITS_PER_HEARTBEAT = 100


def group_commits(cluster: LocalCluster, member: tuple[str, int], stream: str, n: int) -> float:
    started = time.perf_counter()
    for i in range(n):
        if i % COMMITS_PER_HEARTBEAT == 0:
            rpc.call(cluster.bootstrap, "group_heartbeat", {
                "group": GROUP, "member_id": member[0], "member_epoch": member[1],
                "owned": [[stream, 0]]})
        rpc.call(cluster.bootstrap, "group_commit", {
            "group": GROUP, "member_id": member[0], "member_epoch": member[1],
            "positions": [[stream, 0, [[0, i, None]]]]})
    return n / (time.perf_counter() - started)


def start_etcd(tmp: Path):
    from tests.etcd_cluster import EtcdCluster, etcd_binary
    binary, why = etcd_binary()
    if binary is None:
        raise SystemExit(f"no etcd: {why}")
    return EtcdCluster(tmp / "etcd", members=1, binary=binary).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=200, help="operations per round and kind")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--etcd", help="an etcd to use (default: start a 1-member one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        etcd = None if args.etcd else start_etcd(tmp)
        url = args.etcd or etcd.url
        clusters = {}
        try:
            clusters["file"] = LocalCluster(tmp / "file", log_level="WARNING")
            clusters["etcd"] = LocalCluster(tmp / "etcd-coord", log_level="WARNING",
                                            extra_coordinator_args=["--metadata", url,
                                                                    "--metadata-prefix", "bench"])
            print(measure(clusters, args.ops, args.rounds))
        finally:
            for cluster in clusters.values():
                cluster.stop()
            if etcd is not None:
                etcd.stop()


def measure(clusters: dict, ops: int, rounds: int) -> str:
    members = {}
    for name, cluster in clusters.items():
        with cluster.admin() as admin:
            admin.create_stream("committed", streamlets=STREAMLETS)
        members[name] = join_group(cluster, "committed")
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(rounds):
        for name, cluster in clusters.items():
            rates.setdefault(("create_stream", name), []).append(create_streams(cluster, r, ops))
            rates.setdefault(("group_commit", name), []).append(
                group_commits(cluster, members[name], "committed", ops))
    lines = [f"{ops} operations per round, {rounds} rounds, median ops/s",
             f"{'operation':14s} {'file':>10s} {'etcd':>10s} {'file/etcd':>10s}"]
    for op in ("create_stream", "group_commit"):
        file_rate = statistics.median(rates[(op, "file")])
        etcd_rate = statistics.median(rates[(op, "etcd")])
        lines.append(f"{op:14s} {file_rate:10.0f} {etcd_rate:10.0f} {file_rate / etcd_rate:10.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
