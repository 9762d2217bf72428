"""The two systems under test: start a cluster shaped for a workload, create and delete its
streams/topics, name the server processes whose CPU counts.

A cluster is kept across trials while the workloads need the same shape (so the alternating
kera/Kafka trials of one configuration reuse both), and restarted when the shape changes.
Each trial gets fresh streams/topics under its own name prefix, deleted afterwards.

How R copies are laid out (documented in the results):
- kera: 1 broker + R-1 backup processes (+ the coordinator); the broker replicates through its
  virtual logs; backups acknowledge from memory and flush to disk in the background.
- Kafka: R brokers (combined broker+controller KRaft nodes), replication factor R, producers
  with acks=all, min.insync.replicas=2 when R >= 3 (Kafka's recommended setting), else 1
  (acks=all still waits for every in-sync replica). Logs go to the page cache (Kafka default).
- kera-kafka: kera's layout, every broker with a Kafka listener, driven by the Kafka rows'
  confluent-kafka clients; streams of one active group (what Kafka clients write).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from .clients import kafka_consumer_settings, kafka_producer_settings, kera_producer_settings, \
    stream_name
from .runner import run_trial
from .workload import Workload

log = logging.getLogger(__name__)

KERA_READY_TIMEOUT_S = 120.0
KAFKA_HEAP = "1g"


class _System(abc.ABC):
    """A cluster kept while consecutive workloads need the same layout."""

    name = ""

    def __init__(self, work_dir: Path):
        self.work_dir = Path(work_dir) / self.name
        self.cluster = None
        self.layout: dict | None = None
        self.starts = 0

    @abc.abstractmethod
    def layout_for(self, w: Workload) -> dict:
        """The processes `w` needs (compared to decide whether to restart)."""

    @abc.abstractmethod
    def start(self, layout: dict, cluster_dir: Path):
        """A started cluster of that layout."""

    @abc.abstractmethod
    def cluster_dir(self) -> Path:
        """Where the running cluster keeps its files (removed on stop)."""

    def ensure(self, w: Workload) -> bool:
        """Make the cluster fit `w`; True if a new one was started."""
        layout = self.layout_for(w)
        if self.cluster is not None and layout == self.layout:
            return False
        self.stop()
        self.starts += 1
        self.cluster = self.start(layout, self.work_dir / f"cluster-{self.starts}")
        self.layout = layout
        return True

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    @contextlib.contextmanager
    def client_env(self):
        """The environment the trial's worker processes are spawned with (they inherit it)."""
        yield

    def trial(self, w: Workload, prefix: str, repeat: int = 0):
        """One trial on this (`ensure`d) cluster. A system that is not a cluster here (the
        `--baseline` one, bench/baseline.py) runs its trials its own way."""
        return run_trial(self, w, prefix, repeat)

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            shutil.rmtree(self.cluster_dir(), ignore_errors=True)
            self.cluster = None
            self.layout = None


class KeraSystem(_System):
    """kera in plaintext, or (`secure`, system "kera-curve") with CURVE on every daemon and
    every client authenticating with the cluster's admin key."""
    name = "kera"

    def __init__(self, work_dir: Path, secure: bool = False):
        self.secure = secure
        if secure:
            self.name = "kera-curve"
        super().__init__(work_dir)

    @contextlib.contextmanager
    def client_env(self):
        from kera.net.keys import KEY_FILE_ENV
        saved = os.environ.pop(KEY_FILE_ENV, None)
        if self.secure:
            os.environ[KEY_FILE_ENV] = self.cluster.key_file
        try:
            yield
        finally:
            os.environ.pop(KEY_FILE_ENV, None)
            if saved is not None:
                os.environ[KEY_FILE_ENV] = saved

    def layout_for(self, w: Workload) -> dict:
        return w.kera_layout()

    def start(self, layout: dict, cluster_dir: Path):
        from kera.cli.local import LocalCluster

        memory = layout.get("memory_limit_mib")
        return LocalCluster(cluster_dir, brokers=layout["brokers"], backups=layout["backups"],
                            virtual_logs=layout["virtual_logs"], log_level="WARNING",
                            extra_broker_args=["--memory-limit", f"{memory}MiB"] if memory else (),
                            **self.cluster_options())

    def cluster_options(self) -> dict:
        """LocalCluster's options that differ between the kera systems."""
        return {"secure": self.secure}

    def cluster_dir(self) -> Path:
        return self.cluster.data_dir

    def server_pids(self) -> list[int]:
        return [d.pid for d in self.cluster.daemons if d.pid is not None]

    def create(self, prefix: str, w: Workload) -> None:
        from kera.client.admin import Admin

        with Admin(self.cluster.bootstrap, timeout_s=KERA_READY_TIMEOUT_S,
                   key_file=self.cluster.key_file) as admin:
            names = [stream_name(prefix, s) for s in range(w.streams)]
            for name in names:
                admin.create_stream(name, **self.stream_settings(w), wait_ready=False)
            deadline = time.monotonic() + KERA_READY_TIMEOUT_S
            for name in names:
                admin.wait_ready(name, max(1.0, deadline - time.monotonic()))

    def delete(self, prefix: str, w: Workload) -> None:
        from kera.client.admin import Admin

        with Admin(self.cluster.bootstrap, key_file=self.cluster.key_file) as admin:
            for s in range(w.streams):
                admin.delete_stream(stream_name(prefix, s))

    def stream_settings(self, w: Workload) -> dict:
        """How each of `w`'s streams is created."""
        return {"streamlets": w.streamlets, "active_groups": w.active_groups,
                "replication": w.replication, "durability": w.durability}

    def settings(self, w: Workload) -> dict:
        return {"layout": w.kera_layout(), "producer": kera_producer_settings(w),
                "stream": self.stream_settings(w),
                "consumer": {"api": "poll_batch", "start": "earliest",
                             "one_client_for_all_streams": True},
                "producer_api": "send_batch, one call per chunk"}

    def check_alive(self) -> None:
        if self.cluster is not None:
            self.cluster._check_running()


class ClusterShare:
    """One cluster shared by systems that differ only in their clients."""

    def __init__(self):
        self.cluster = None
        self.layout: dict | None = None
        self.starts = 0


class KafkaClusterShare(ClusterShare):
    """The one Kafka cluster of a run, shared by every Kafka system (kafka, kafka-tuned,
    kafka-java...): they differ only in their clients, so they measure the same brokers.
    `kera_kafka`: likewise the one kera cluster of kera-kafka and kera-kafka-tuned."""

    def __init__(self):
        super().__init__()
        self.kera_kafka = ClusterShare()


def _in_share(field: str) -> property:
    return property(lambda self: getattr(self.share, field),
                    lambda self, v: setattr(self.share, field, v))


class _Shared:
    """A system whose cluster, layout and start count (set by _System) live in `self.share`."""
    share: ClusterShare
    cluster = _in_share("cluster")
    layout = _in_share("layout")
    starts = _in_share("starts")


class KafkaSystem(_Shared, _System):
    """Apache Kafka driven by the Python client (confluent-kafka); `tuned` (system
    "kafka-tuned"): its producer tuned for throughput (bench.clients.kafka_tuned_producer)."""
    name = "kafka"

    def __init__(self, work_dir: Path, name: str = "kafka",
                 share: KafkaClusterShare | None = None):
        self.share = share or KafkaClusterShare()
        self.name = name
        self.tuned = name.endswith("-tuned")
        super().__init__(work_dir)
        self.work_dir = Path(work_dir) / "kafka"    # one cluster folder for all of them

    def layout_for(self, w: Workload) -> dict:
        return w.kafka_layout()

    def start(self, layout: dict, cluster_dir: Path):
        from .kafka.cluster import KafkaCluster

        cluster = KafkaCluster(cluster_dir, brokers=layout["brokers"], heap=KAFKA_HEAP,
                               min_insync_replicas=layout["min_insync_replicas"])
        cluster.start()
        return cluster

    def cluster_dir(self) -> Path:
        return self.cluster.work_dir

    def server_pids(self) -> list[int]:
        return [n.process.pid for n in self.cluster.nodes if n.process is not None]

    def create(self, prefix: str, w: Workload) -> None:
        self.cluster.create_topics([stream_name(prefix, s) for s in range(w.streams)],
                                   partitions=w.streamlets, replication=w.replication,
                                   min_insync=w.kafka_layout()["min_insync_replicas"])

    def delete(self, prefix: str, w: Workload) -> None:
        self.cluster.delete_topics([stream_name(prefix, s) for s in range(w.streams)])

    def settings(self, w: Workload) -> dict:
        return {"layout": {**w.kafka_layout(), "heap": KAFKA_HEAP, "version": "4.1.2",
                           "num.network.threads": 3, "num.io.threads": 8},
                "topic": {"partitions": w.streamlets, "replication.factor": w.replication},
                **kafka_client_settings(w, self.tuned)}

    def check_alive(self) -> None:
        if self.cluster is not None:
            self.cluster.check_alive()


class KeraKafkaSystem(_Shared, KeraSystem):
    """kera driven through its brokers' Kafka listeners by the Kafka rows' own clients
    (bench.clients' KafkaProducerClient and KafkaConsumerClient, the same settings; `tuned`,
    system "kera-kafka-tuned": kafka-tuned's producer). kera's layout (1 broker + R-1 backups),
    each stream made with kera's Admin: the workload's streamlets (= partitions), replication
    and durability, one active group (Kafka clients write no other). kera-kafka and
    kera-kafka-tuned share one cluster, as the Kafka systems do."""
    name = "kera-kafka"

    def __init__(self, work_dir: Path, name: str = "kera-kafka",
                 share: ClusterShare | None = None):
        self.share = share or ClusterShare()
        self.name = name
        self.tuned = name.endswith("-tuned")
        super().__init__(work_dir)
        self.work_dir = Path(work_dir) / "kera-kafka"    # one cluster folder for both

    @property
    def bootstrap(self) -> str:
        """The workers' `bootstrap.servers`: every broker's Kafka listener."""
        return self.cluster.kafka_bootstrap

    def cluster_options(self) -> dict:
        return {"kafka_port": 0}     # a free port per broker

    def stream_settings(self, w: Workload) -> dict:
        return {**super().stream_settings(w), "active_groups": 1}

    def settings(self, w: Workload) -> dict:
        return {"layout": {**w.kera_layout(), "kafka_listener": "every broker"},
                "stream": self.stream_settings(w), **kafka_client_settings(w, self.tuned)}


def kafka_client_settings(w: Workload, tuned: bool) -> dict:
    """The confluent-kafka producer and consumer of the Kafka rows and the kera-kafka rows."""
    return {"producer": kafka_producer_settings(w, tuned),
            "consumer": {**kafka_consumer_settings(), "api": "consume(10000)",
                         "assignment": "manual assign() from the beginning"},
            "producer_api": "produce_batch() of records_per_chunk records to one "
                            "partition, rotating partitions (like kera's keyless "
                            "send_batch rotates chunks over streamlets)"}


KAFKA_SYSTEMS = ("kafka", "kafka-tuned", "kafka-java", "kafka-java-tuned")
KERA_KAFKA_SYSTEMS = ("kera-kafka", "kera-kafka-tuned")


def make_system(name: str, work_dir: Path, share: KafkaClusterShare | None = None):
    """System `name`; the Kafka ones run on `share`'s cluster (one cluster for all of them),
    kera-kafka and kera-kafka-tuned on its `kera_kafka` one."""
    if name == "kera":
        return KeraSystem(work_dir)
    if name == "kera-curve":
        return KeraSystem(work_dir, secure=True)
    if name in KERA_KAFKA_SYSTEMS:
        return KeraKafkaSystem(work_dir, name, share.kera_kafka if share else None)
    if name in ("kafka", "kafka-tuned"):
        return KafkaSystem(work_dir, name, share)
    if name in ("kafka-java", "kafka-java-tuned"):
        from .kafka_java import KafkaJavaSystem
        return KafkaJavaSystem(work_dir, name, share)
    raise ValueError(f"unknown system {name!r} (kera, kera-curve, {', '.join(KERA_KAFKA_SYSTEMS)}, "
                     f"{', '.join(KAFKA_SYSTEMS)})")
