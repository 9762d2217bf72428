"""Run a real Apache Kafka cluster (KRaft mode) on loopback for benchmarks.

The broker jars come from Maven Central through ``bench/kafka/pom.xml`` and are
cached in ``bench/kafka/lib/`` (git-ignored).  Every node is a combined
broker+controller JVM listening on 127.0.0.1 on free ports chosen at run time.

    with KafkaCluster(work_dir, brokers=3) as cluster:
        cluster.create_topic("t", partitions=6, replication=3, min_insync=2)
        ... produce to cluster.bootstrap ...

Command line (starts a cluster and prints the bootstrap until Ctrl-C):

    python -m bench.kafka.cluster --brokers 1
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
TEMPLATE = HERE / "server.properties.template"
LOG4J_CONFIG = HERE / "log4j2.properties"
DEFAULT_LIB_DIR = HERE / "lib"
COMPLETE_MARKER = ".complete"

KAFKA_MAIN = "kafka.Kafka"
# Kafka 3.x and 4.x both keep the storage tool in the Scala core jar.
STORAGE_TOOL = "kafka.tools.StorageTool"

# Same GC settings as Kafka's own bin/kafka-run-class.sh.
JVM_GC_OPTS = (
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
)
# Short-lived tool JVMs (StorageTool): small heap, C1 only, start fast.
JVM_TOOL_OPTS = ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
                 "-Djava.awt.headless=true")

MAVEN_TIMEOUT_S = 900.0
FORMAT_TIMEOUT_S = 120.0
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
TOPIC_TIMEOUT_S = 60.0
LOG_TAIL_LINES = 40


class KafkaClusterError(RuntimeError):
    """Raised when the Kafka jars cannot be built or a cluster misbehaves."""


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"<no {path}>"
    return "\n".join(text.splitlines()[-lines:])


def _free_ports(count: int) -> list[int]:
    """Return ``count`` distinct free TCP ports on 127.0.0.1.

    All sockets are held open until every port is chosen so none repeats.
    """
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
        return ports


def new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding.

    Same format as ``kafka-storage random-uuid``; like Kafka's Uuid.randomUuid,
    ids starting with '-' are avoided (they look like command-line flags).
    """
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").exists():
        return str(Path(java_home) / "bin" / "java")
    java = shutil.which("java")
    if not java:
        raise KafkaClusterError("java not found on PATH (Kafka 4.x needs Java 17+)")
    return java


# --------------------------------------------------------------------------
# Jars
# --------------------------------------------------------------------------


def ensure_jars(lib_dir: Path = DEFAULT_LIB_DIR, timeout: float = MAVEN_TIMEOUT_S) -> Path:
    """Gather the Kafka broker classpath into ``lib_dir`` with Maven, once.

    Idempotent and safe to call from concurrent processes: a file lock
    serialises builders, and jars are copied to a temporary folder that is
    renamed into place only when Maven succeeded.  Returns ``lib_dir``.
    """
    lib_dir = Path(lib_dir)
    if _jars_current(lib_dir):
        return lib_dir
    lib_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(lib_dir.parent / f".{lib_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _jars_current(lib_dir):
            _run_maven(lib_dir, timeout)
    return lib_dir


def _pom_stamp() -> str:
    """Identifies the pom the jars came from, so editing it refreshes them."""
    return "pom-sha256=" + hashlib.sha256(POM.read_bytes()).hexdigest()


def _jars_current(lib_dir: Path) -> bool:
    marker = lib_dir / COMPLETE_MARKER
    return marker.exists() and marker.read_text().splitlines()[:1] == [_pom_stamp()]


def _run_maven(lib_dir: Path, timeout: float) -> None:
    mvn = shutil.which("mvn")
    if not mvn:
        raise KafkaClusterError("mvn not found on PATH; install Maven 3.8+")
    staging = Path(tempfile.mkdtemp(prefix=f".{lib_dir.name}-", dir=lib_dir.parent))
    cmd = [mvn, "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
           f"-DoutputDirectory={staging}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise KafkaClusterError(f"Maven timed out after {timeout:.0f}s: {' '.join(cmd)}") from exc
    if proc.returncode != 0 or not any(staging.glob("kafka_2.13-*.jar")):
        shutil.rmtree(staging, ignore_errors=True)
        output = "\n".join((proc.stdout + proc.stderr).splitlines()[-LOG_TAIL_LINES:])
        raise KafkaClusterError(
            f"Maven failed (exit {proc.returncode}): {' '.join(cmd)}\n{output}")
    jars = sorted(p.name for p in staging.glob("*.jar"))
    (staging / COMPLETE_MARKER).write_text("\n".join([_pom_stamp(), *jars]) + "\n")
    shutil.rmtree(lib_dir, ignore_errors=True)
    staging.rename(lib_dir)


# --------------------------------------------------------------------------
# Cluster
# --------------------------------------------------------------------------


@dataclass
class KafkaNode:
    """One combined broker+controller process."""

    node_id: int
    broker_port: int
    controller_port: int
    root: Path
    process: subprocess.Popen | None = None

    @property
    def config_path(self) -> Path:
        return self.root / "server.properties"

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def metadata_dir(self) -> Path:
        return self.root / "metadata"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def stdout_path(self) -> Path:
        return self.logs_dir / "stdout.log"

    @property
    def server_log_path(self) -> Path:
        return self.logs_dir / "server.log"

    def describe_failure(self) -> str:
        code = None if self.process is None else self.process.poll()
        return (f"--- node {self.node_id} (exit code {code}) {self.stdout_path} ---\n"
                f"{_tail(self.stdout_path)}\n"
                f"--- {self.server_log_path} ---\n{_tail(self.server_log_path)}")


class KafkaCluster:
    """A 1- or 3-node Kafka KRaft cluster on 127.0.0.1.

    Fairness knobs: ``min_insync_replicas`` (broker default for topics),
    ``num_network_threads``, ``num_io_threads``.  Log flushing stays at Kafka's
    default (page cache only).  ``extra_config`` adds/overrides any broker
    property.
    """

    def __init__(
        self,
        work_dir: str | os.PathLike,
        brokers: int = 1,
        *,
        heap: str = "1g",
        min_insync_replicas: int = 1,
        num_network_threads: int = 3,
        num_io_threads: int = 8,
        extra_config: dict[str, object] | None = None,
        lib_dir: str | os.PathLike = DEFAULT_LIB_DIR,
        start_timeout: float = START_TIMEOUT_S,
        stop_timeout: float = STOP_TIMEOUT_S,
    ) -> None:
        if brokers < 1:
            raise ValueError("brokers must be >= 1")
        if not 1 <= min_insync_replicas <= brokers:
            raise ValueError(f"min_insync_replicas must be in 1..{brokers}")
        self.work_dir = Path(work_dir).resolve()
        self.brokers = brokers
        self.heap = heap
        self.min_insync_replicas = min_insync_replicas
        self.num_network_threads = num_network_threads
        self.num_io_threads = num_io_threads
        self.extra_config = dict(extra_config or {})
        self.lib_dir = Path(lib_dir)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.cluster_id = new_cluster_id()
        self.nodes: list[KafkaNode] = []
        self._admin = None

    # -- public API ---------------------------------------------------------

    def ensure_jars(self) -> Path:
        return ensure_jars(self.lib_dir)

    @property
    def bootstrap(self) -> str:
        if not self.nodes:
            raise KafkaClusterError("cluster not started")
        return ",".join(f"127.0.0.1:{n.broker_port}" for n in self.nodes)

    def start(self) -> "KafkaCluster":
        if any(n.process is not None and n.process.poll() is None for n in self.nodes):
            raise KafkaClusterError("cluster already running")
        self.ensure_jars()
        self.nodes = self._plan_nodes()
        _LIVE_CLUSTERS.add(self)
        try:
            for node in self.nodes:
                self._write_config(node)
            self._format_storage()
            for node in self.nodes:
                self._launch(node)
            self._wait_until_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM every node, then SIGKILL whatever is left after the timeout."""
        self._admin = None  # drop the client first: it would log refused reconnects
        running = [n.process for n in self.nodes if n.process and n.process.poll() is None]
        for proc in running:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        for proc in running:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        _LIVE_CLUSTERS.discard(self)

    def create_topic(self, name: str, partitions: int = 1, replication: int = 1,
                     min_insync: int | None = None, config: dict[str, str] | None = None,
                     timeout: float = TOPIC_TIMEOUT_S) -> None:
        """Create a topic and wait until every partition has a leader."""
        from confluent_kafka.admin import NewTopic

        topic_config = {str(k): str(v) for k, v in (config or {}).items()}
        if min_insync is not None:
            topic_config["min.insync.replicas"] = str(min_insync)
        new_topic = NewTopic(name, num_partitions=partitions,
                             replication_factor=replication, config=topic_config)
        # Keep the client referenced until the future resolves: a collected
        # AdminClient fails its pending futures with _DESTROY.
        future = self.admin().create_topics([new_topic], request_timeout=timeout)[name]
        try:
            future.result(timeout=timeout)
        except Exception as exc:  # KafkaException or TimeoutError
            raise KafkaClusterError(f"create_topic({name!r}) failed: {exc}") from exc
        self._wait_for(lambda: self._topic_ready(name, partitions), timeout,
                       f"topic {name!r} partitions to get leaders")

    def create_topics(self, names: list[str], partitions: int = 1, replication: int = 1,
                      min_insync: int | None = None, timeout: float = TOPIC_TIMEOUT_S) -> None:
        """Create many topics in one request and wait until every partition has a leader."""
        from confluent_kafka.admin import NewTopic

        config = {} if min_insync is None else {"min.insync.replicas": str(min_insync)}
        futures = self.admin().create_topics(
            [NewTopic(n, num_partitions=partitions, replication_factor=replication, config=config)
             for n in names], request_timeout=timeout)
        for name, future in futures.items():
            try:
                future.result(timeout=timeout)
            except Exception as exc:  # KafkaException or TimeoutError
                raise KafkaClusterError(f"create_topics({name!r}) failed: {exc}") from exc
        wanted = set(names)
        self._wait_for(lambda: self._topics_ready(wanted, partitions), timeout,
                       f"{len(names)} topics' partitions to get leaders")

    def delete_topics(self, names: list[str], timeout: float = TOPIC_TIMEOUT_S) -> None:
        """Delete topics (their log files go in the background)."""
        if not names:
            return
        futures = self.admin().delete_topics(list(names), request_timeout=timeout)
        for name, future in futures.items():
            try:
                future.result(timeout=timeout)
            except Exception as exc:  # noqa: BLE001
                raise KafkaClusterError(f"delete_topics({name!r}) failed: {exc}") from exc

    def admin(self):
        """A confluent_kafka AdminClient for this cluster (cached)."""
        from confluent_kafka.admin import AdminClient

        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap,
                                       "log.connection.close": False})
        return self._admin

    def __enter__(self) -> "KafkaCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- setup --------------------------------------------------------------

    def _plan_nodes(self) -> list[KafkaNode]:
        ports = _free_ports(2 * self.brokers)
        nodes = []
        for i in range(self.brokers):
            root = self.work_dir / f"node-{i + 1}"
            if root.exists():
                shutil.rmtree(root)
            nodes.append(KafkaNode(i + 1, ports[2 * i], ports[2 * i + 1], root))
        for node in nodes:
            node.logs_dir.mkdir(parents=True)
        return nodes

    def _template_values(self, node: KafkaNode) -> dict[str, object]:
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        internal_replication = min(3, self.brokers)
        return {
            "node_id": node.node_id,
            "quorum_voters": voters,
            "broker_port": node.broker_port,
            "controller_port": node.controller_port,
            "num_network_threads": self.num_network_threads,
            "num_io_threads": self.num_io_threads,
            "log_dir": node.data_dir,
            "metadata_dir": node.metadata_dir,
            "default_replication": self.brokers,
            "min_insync_replicas": self.min_insync_replicas,
            "internal_replication": internal_replication,
            "internal_min_isr": min(2, internal_replication),
        }

    def _write_config(self, node: KafkaNode) -> None:
        text = string.Template(TEMPLATE.read_text()).substitute(self._template_values(node))
        extra = "".join(f"{k}={v}\n" for k, v in self.extra_config.items())
        if extra:
            text += "\n# extra_config\n" + extra
        node.config_path.write_text(text)

    def _classpath(self) -> str:
        return str(self.lib_dir / "*")

    def _java_cmd(self, node: KafkaNode, jvm_opts: tuple[str, ...], main: str,
                  *args: str) -> list[str]:
        return [
            _java(), *jvm_opts,
            f"-Dkafka.logs.dir={node.logs_dir}",
            f"-Dlog4j2.configurationFile={LOG4J_CONFIG}",
            "-cp", self._classpath(), main, *args,
        ]

    def _format_storage(self) -> None:
        """Run StorageTool format for every node (in parallel JVMs)."""
        procs = []
        for node in self.nodes:
            cmd = self._java_cmd(node, JVM_TOOL_OPTS, STORAGE_TOOL, "format",
                                 "-t", self.cluster_id, "-c", str(node.config_path))
            log = open(node.logs_dir / "format.log", "w")
            procs.append((node, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))
        errors = []
        for node, log, proc in procs:
            try:
                code = proc.wait(timeout=FORMAT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = f"timeout after {FORMAT_TIMEOUT_S:.0f}s"
            log.close()
            if code != 0:
                errors.append(f"node {node.node_id}: {code}\n{_tail(node.logs_dir / 'format.log')}")
        if errors:
            raise KafkaClusterError("formatting storage failed:\n" + "\n".join(errors))

    def _launch(self, node: KafkaNode) -> None:
        heap = (f"-Xms{self.heap}", f"-Xmx{self.heap}")
        cmd = self._java_cmd(node, heap + JVM_GC_OPTS, KAFKA_MAIN, str(node.config_path))
        with open(node.stdout_path, "w") as out:
            # Own session: Ctrl-C in a terminal reaches Python, which then
            # stops the brokers in order.
            node.process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)

    # -- waiting ------------------------------------------------------------

    def _wait_until_serving(self) -> None:
        # Wait for the listeners first, so librdkafka does not log a stream
        # of "connection refused" while the JVMs boot.
        deadline = time.monotonic() + self.start_timeout
        self._wait_for(self._all_ports_open, self.start_timeout,
                       "broker listeners to accept connections")
        self._wait_for(self._all_brokers_registered, max(1.0, deadline - time.monotonic()),
                       f"{self.brokers} broker(s) to register")

    def _all_ports_open(self) -> bool:
        return all(_port_open(n.broker_port) for n in self.nodes)

    def _all_brokers_registered(self) -> bool:
        try:
            metadata = self.admin().list_topics(timeout=2)
        except Exception:  # KafkaException while the brokers boot
            return False
        return len(metadata.brokers) == self.brokers

    def _topic_ready(self, name: str, partitions: int) -> bool:
        metadata = self.admin().list_topics(topic=name, timeout=5)
        topic = metadata.topics.get(name)
        if topic is None or topic.error is not None or len(topic.partitions) != partitions:
            return False
        return all(p.leader >= 0 and p.error is None for p in topic.partitions.values())

    def _topics_ready(self, names: set[str], partitions: int) -> bool:
        topics = self.admin().list_topics(timeout=10).topics
        for name in names:
            topic = topics.get(name)
            if topic is None or topic.error is not None or len(topic.partitions) != partitions:
                return False
            if not all(p.leader >= 0 and p.error is None for p in topic.partitions.values()):
                return False
        return True

    def _wait_for(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            if condition():
                return
            if time.monotonic() >= deadline:
                raise KafkaClusterError(
                    f"timed out after {timeout:.0f}s waiting for {what} "
                    f"(bootstrap {self.bootstrap})\n{self._failure_report()}")
            time.sleep(0.25)

    def check_alive(self) -> None:
        """Raise KafkaClusterError (with log tails) if any node has exited."""
        dead = [n for n in self.nodes if n.process is not None and n.process.poll() is not None]
        if dead:
            raise KafkaClusterError(
                "Kafka node(s) exited unexpectedly:\n"
                + "\n".join(n.describe_failure() for n in dead))

    def _failure_report(self) -> str:
        return "\n".join(n.describe_failure() for n in self.nodes)


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


# Stop clusters that the caller forgot to stop, so no JVM outlives Python.
_LIVE_CLUSTERS: "weakref.WeakSet[KafkaCluster]" = weakref.WeakSet()


@atexit.register
def _stop_leftover_clusters() -> None:
    for cluster in list(_LIVE_CLUSTERS):
        cluster.stop()


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kafka.cluster",
        description="Start a local Apache Kafka (KRaft) cluster and print its bootstrap.")
    parser.add_argument("--brokers", type=int, default=1, choices=(1, 3))
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where node data and logs go (default: a temp dir, removed on exit)")
    parser.add_argument("--heap", default="1g", help="JVM heap per broker (default 1g)")
    parser.add_argument("--min-insync-replicas", type=int, default=1)
    parser.add_argument("--network-threads", type=int, default=3)
    parser.add_argument("--io-threads", type=int, default=8)
    parser.add_argument("--topic", action="append", default=[], metavar="NAME:PARTITIONS",
                        help="create a topic (replication = brokers); may repeat")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _serve(args)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    except KafkaClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace) -> None:
    """Start the cluster, print its bootstrap, block until interrupted.

    The ExitStack stops the brokers (and removes a temporary work dir) however
    this returns, including on Ctrl-C at any point.
    """
    with contextlib.ExitStack() as stack:
        work_dir = args.work_dir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kera-kafka-")))
        t0 = time.monotonic()
        ensure_jars()
        t1 = time.monotonic()
        cluster = stack.enter_context(KafkaCluster(
            work_dir, brokers=args.brokers, heap=args.heap,
            min_insync_replicas=args.min_insync_replicas,
            num_network_threads=args.network_threads, num_io_threads=args.io_threads))
        t2 = time.monotonic()
        for spec in args.topic:
            name, _, parts = spec.partition(":")
            cluster.create_topic(name, int(parts or 1), replication=args.brokers)
        print(f"jars ready in {t1 - t0:.1f}s, cluster started in {t2 - t1:.1f}s",
              file=sys.stderr)
        print(f"work dir: {work_dir}  (Ctrl-C to stop)", file=sys.stderr)
        print(cluster.bootstrap, flush=True)
        while True:  # until Ctrl-C / SIGTERM; fail loudly if a broker dies
            cluster.check_alive()
            time.sleep(1)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
