"""An embedded local cluster: a coordinator, N brokers and K backups, each its own subprocess.

    with LocalCluster("/tmp/kera-data", brokers=2, backups=1) as cluster:
        Admin(cluster.bootstrap).create_stream("s", replication=2)

Every daemon runs as `python -m kera <kind> ...` on a free loopback port with its log in
`DATA_DIR/logs/`; its identity (`--id`, `--node`, data dir, port) is fixed at start so the
`restart_*` helpers bring back the same daemon after a `kill_*` (SIGKILL), as fault tests need.
Children stop themselves when the process that started them dies (`kera.cli.main.main` watches the
parent named by PARENT_PID_ENV), so a killed test run leaves no daemons behind.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from kera.net import certs, kafka_users
from kera.net import keys as keyfiles
from kera.net.scram import new_password
from kera.cli.security import format_properties, kafka_client_properties
from kera.cli.supervisor import Supervisor
from kera.net.security import is_loopback
from kera.client.coordinator_client import CoordinatorClient
from kera.net.rpc import call as rpc_call
from kera.errors import KeraError

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
POLL_S = 0.02
LOG_TAIL_BYTES = 4000
# The Kafka user of a secure local cluster: the same principal as the `client` key, so one
# `kera acl add --principal client` grant serves kera's and Kafka's clients.
KAFKA_USER = "client"


# Set in a daemon's environment to the pid of the LocalCluster that started it.
PARENT_PID_ENV = "KERA_PARENT_PID"
PARENT_POLL_S = 0.5


def watch_parent_from_env() -> None:
    """In a daemon started by LocalCluster: SIGTERM ourselves once that parent is gone (we get
    re-parented), so no daemon outlives a killed test run. A thread polling getppid() works
    whatever thread of the parent started us, unlike PR_SET_PDEATHSIG."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if not parent or not parent.isdigit():
        return
    parent_pid = int(parent)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        log.warning("parent process %d is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(STOP_TIMEOUT_S)
        os._exit(1)  # the daemon ignored SIGTERM

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ClusterError(RuntimeError):
    """A local daemon failed to start or register."""


# Ports kera picks for its daemons lie below the kernel's ephemeral range: a port from inside it
# (the kernel's own pick for a bind to port 0) can be taken by any outgoing connection between
# the pick and the daemon's bind, which failed about one `kera local` start in ten.
PICKED_PORT_LOW = 20_000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
EPHEMERAL_LOW_DEFAULT = 32_768   # Linux's default, when the range cannot be read
PORT_PICK_ATTEMPTS = 200         # random tries before giving up: the range holds ~12,000 ports


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections' local ports)."""
    try:
        low = int(Path(EPHEMERAL_RANGE_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW_DEFAULT
    return low if low > PICKED_PORT_LOW + 1000 else EPHEMERAL_LOW_DEFAULT


def free_port(host: str = HOST, exclude: set[int] | frozenset = frozenset()) -> int:
    """A port nobody listens on right now, outside the ephemeral range and `exclude`, chosen
    at random so that concurrent pickers (parallel tests) rarely meet."""
    rng, high = random.SystemRandom(), ephemeral_low() - 1
    for _ in range(PORT_PICK_ATTEMPTS):
        port = rng.randint(PICKED_PORT_LOW, high)
        if port not in exclude and port_free(host, port):
            return port
    raise ClusterError(f"no free port found in {PICKED_PORT_LOW}..{high} on {host} "
                       f"after {PORT_PICK_ATTEMPTS} tries")


def port_free(host: str, port: int) -> bool:
    """Whether nothing listens on (host, port) now (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


@dataclass(frozen=True)
class Where:
    """Where a daemon runs: the address it binds and advertises, the `--node` it names for
    placement (None: `local-<name>`), and a command prefix that enters its host (for example
    `("ip", "netns", "exec", "kera-ab12-h2")`; the prefix must exec the command, not fork it,
    so the process started is the daemon and signals reach it)."""
    host: str = HOST
    node: str | None = None
    prefix: tuple[str, ...] = ()


def on_loopback(name: str) -> Where:
    """The default placement: every daemon on this machine's loopback."""
    return Where()


@dataclass
class Daemon:
    """One daemon process and what is needed to start it again identically."""
    kind: str                 # "coordinator", "broker" or "backup"
    index: int
    port: int
    args: list[str]
    log_path: Path
    host: str = HOST
    prefix: tuple[str, ...] = ()
    proc: subprocess.Popen | None = None
    starts: int = 0
    killed: bool = False      # stopped on purpose: its exit is not a failure
    # A registration at a metadata version above this one is this process's (0: any will do):
    # set on a restart so waiting does not mistake the dead process's registration for it.
    registered_after: int = 0

    @property
    def name(self) -> str:
        if self.kind == "coordinator" and self.index == 0:
            return self.kind
        return f"{self.kind}-{self.index}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, env: dict) -> None:
        assert not self.running(), f"{self.name} is already running"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**env, PARENT_PID_ENV: str(os.getpid())}
        with open(self.log_path, "ab") as logf:
            logf.write(f"==== start {self.starts}: {' '.join(self.args)}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-P", "-m", "kera", *self.args], stdin=subprocess.DEVNULL,
                stdout=logf, stderr=subprocess.STDOUT, env=env,
                # Own session: a Ctrl-C meant for `kera local` reaches the daemons only through
                # its orderly stop().
                start_new_session=True)
        self.starts += 1
        self.killed = False

    def signal(self, signum: int) -> None:
        if self.running():
            try:
                self.proc.send_signal(signum)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, nbytes: int = LOG_TAIL_BYTES) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - nbytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"


def _advertise(where: Where, port: int) -> list[str]:
    """`--advertise` for a daemon off loopback (on loopback the bound address is the one)."""
    return [] if where.host == HOST else ["--advertise", f"{where.host}:{port}"]


class LocalKeys:
    """The keys of a secure local cluster, created on first use and kept across restarts:
    one per daemon (`coordinator`, `broker-I`, `backup-I`), an `admin` and a `client`."""

    def __init__(self, keys_dir: Path, brokers: int, backups: int):
        self.dir = keys_dir
        wanted = [("coordinator", "coordinator"), ("admin", "admin"), ("client", "client")]
        wanted += [(f"broker-{i}", "broker") for i in range(brokers)]
        wanted += [(f"backup-{i}", "backup") for i in range(backups)]
        for name, role in wanted:
            if not self.secret(name).exists():
                keyfiles.create_key(keys_dir, name, role)

    def secret(self, name: str) -> Path:
        return self.dir / (name + keyfiles.SECRET_SUFFIX)

    @property
    def admin(self) -> Path:
        return self.secret("admin")

    @property
    def client(self) -> Path:
        return self.secret("client")

    def kafka(self, broker_hosts: list[str]) -> str:
        """What a SASL_SSL Kafka listener needs: broker i's certificate for loopback and
        `broker_hosts[i]`, and the Kafka user KAFKA_USER with a new password (returned)."""
        for i, host in enumerate(broker_hosts):
            if not certs.cert_paths(self.dir, f"broker-{i}")[0].exists():
                certs.create_cert(self.dir, f"broker-{i}", [*certs.DEFAULT_HOSTS, host])
        password = new_password()
        kafka_users.set_user(self.dir, KAFKA_USER, password, "client")
        return password


class LocalCluster:
    """Daemons: `.coordinator`, `.brokers[i]`, `.backups[i]` (each a Daemon with `.address`,
    `.pid`, `.log_path`); broker i registers as broker id i, backup i as backup id i."""

    def __init__(self, data_dir: str | os.PathLike, port: int = 0, brokers: int = 1,
                 backups: int = 0, virtual_logs: int | None = None, log_level: str = "INFO",
                 extra_broker_args=(), extra_backup_args=(), extra_coordinator_args=(),
                 heartbeat_interval_ms: int | None = None,
                 start_timeout_s: float = START_TIMEOUT_S, start: bool = True,
                 secure: bool = False, coordinators: int = 1, where=on_loopback,
                 kafka_port: int | None = None):
        """`secure`: CURVE on every daemon, keys in DATA_DIR/keys (see `keys`). `where(name)`
        places each daemon (`coordinator`, `coordinator-I`, `broker-I`, `backup-I`) on a host
        (see `Where`). `coordinators` > 1 (with `--metadata etcd://...` in
        extra_coordinator_args): one leads and the others stand by
        (kera.coordinator.leadership); `bootstrap` lists them all. `kafka_port`: every broker
        runs a Kafka listener, broker i on `kafka_port + i` (0: free ports), topics created
        on first use as in a Kafka test cluster; `kafka_bootstrap` lists them."""
        self.data_dir = Path(data_dir).absolute()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.keys = LocalKeys(self.data_dir / "keys", brokers, backups) if secure else None
        # This process's own calls (waiting for registration, `admin()`) use the admin key.
        self.key_file = str(self.keys.admin) if secure else None
        self.log_dir = self.data_dir / "logs"
        self.start_timeout_s = start_timeout_s
        self.env = dict(os.environ)
        self.env.setdefault("PYTHONUNBUFFERED", "1")  # logs reach the file as they are written
        used: set[int] = set()

        def pick(wanted: int = 0) -> int:
            p = wanted or free_port(exclude=used)
            used.add(p)
            return p

        level = ["--log-level", log_level]
        self.coordinators: list[Daemon] = []
        for i in range(coordinators):
            cport = pick(port if i == 0 else 0)
            suffix = "" if i == 0 else f"-{i}"
            cwhere = where(f"coordinator{suffix}")
            coord_args = ["coordinator", "--host", cwhere.host, "--port", str(cport),
                          "--dir", str(self.data_dir / f"coordinator{suffix}"), *level]
            if heartbeat_interval_ms is not None:
                coord_args += ["--heartbeat-interval-ms", str(heartbeat_interval_ms)]
            coord_args += self._key_args("coordinator", cwhere.host)
            self.coordinators.append(Daemon("coordinator", i, cport,
                                            coord_args + list(extra_coordinator_args),
                                            self.log_dir / f"coordinator{suffix}.log",
                                            cwhere.host, cwhere.prefix))
        self.coordinator = self.coordinators[0]
        self.bootstrap = ",".join(c.address for c in self.coordinators)
        self.brokers: list[Daemon] = []
        self.kafka_addresses: list[str] = []
        for i in range(brokers):
            p, w = pick(), where(f"broker-{i}")
            args = ["broker", "--coordinator", self.bootstrap, "--host", w.host, "--port", str(p),
                    "--node", w.node or f"local-broker-{i}", "--id", str(i),
                    "--dir", str(self.data_dir / f"broker-{i}"), *level, *_advertise(w, p)]
            if kafka_port is not None:
                args += self._kafka_args(w.host, pick(kafka_port + i if kafka_port else 0))
            if virtual_logs is not None:
                args += ["--virtual-logs", str(virtual_logs)]
            args += self._key_args(f"broker-{i}", w.host)
            self.brokers.append(Daemon("broker", i, p, args + list(extra_broker_args),
                                       self.log_dir / f"broker-{i}.log", w.host, w.prefix))
        self.backups = [self._backup(i, pick(), where(f"backup-{i}"), level, extra_backup_args)
                        for i in range(backups)]
        # A secure cluster's Kafka clients: SASL_SSL, as user KAFKA_USER (kafka_config()).
        self.kafka_properties = self._secure_kafka_properties() if secure and kafka_port \
            is not None else {}
        if start:
            self.start()

    def _secure_kafka_properties(self) -> dict:
        """Certificates for the brokers' Kafka listeners, the user KAFKA_USER with a new
        password, and the properties a Kafka client needs to log in as it."""
        password = self.keys.kafka([d.host for d in self.brokers])
        return kafka_client_properties(self.kafka_bootstrap, KAFKA_USER, password,
                                       certs.ca_path(self.keys.dir))

    def _backup(self, i: int, p: int, w: Where, level: list, extra) -> Daemon:
        args = ["backup", "--coordinator", self.bootstrap, "--host", w.host, "--port", str(p),
                "--dir", str(self.data_dir / f"backup-{i}"), "--node", w.node or f"local-backup-{i}",
                "--id", str(i), *level, *self._key_args(f"backup-{i}", w.host), *_advertise(w, p)]
        return Daemon("backup", i, p, args + list(extra), self.log_dir / f"backup-{i}.log",
                      w.host, w.prefix)

    def _kafka_args(self, host: str, port: int) -> list[str]:
        """A broker's Kafka listener, creating topics on first use as a test Kafka does."""
        self.kafka_addresses.append(f"{host}:{port}")
        return ["--kafka-port", str(port), "--kafka-auto-create-topics"]

    @property
    def kafka_bootstrap(self) -> str:
        """Kafka clients' `bootstrap.servers` (empty without `kafka_port`)."""
        return ",".join(self.kafka_addresses)

    def kafka_config(self, **more) -> dict:
        """A Kafka client's settings (librdkafka's names): bootstrap.servers, and on a secure
        cluster SASL_SSL as user KAFKA_USER; `more` on top."""
        return {"bootstrap.servers": self.kafka_bootstrap, **self.kafka_properties, **more}

    def kafka_summary(self) -> str:
        """What `kera local` prints for Kafka clients."""
        if not self.kafka_properties:
            return f"Kafka clients: bootstrap.servers={self.kafka_bootstrap}"
        return (f"Kafka clients (SASL_SSL; user {KAFKA_USER!r} needs grants: kera acl add "
                f"--principal {KAFKA_USER} ...):\n" + format_properties(self.kafka_properties))

    def _key_args(self, name: str, host: str) -> list[str]:
        """A daemon's keys; without them, a test host's routable address is served only
        with --insecure (the daemons refuse it otherwise)."""
        if self.keys is None:
            return [] if is_loopback(host) else ["--insecure"]
        return ["--keys-dir", str(self.keys.dir), "--key-file", str(self.keys.secret(name))]

    # ------------------------------------------------------------------ lifecycle
    @property
    def daemons(self) -> list[Daemon]:
        return [*self.coordinators, *self.brokers, *self.backups]

    def start(self) -> "LocalCluster":
        self._check_ports_free()
        try:
            for c in self.coordinators:
                c.start(self.env)
            self.wait_coordinator()
            self._bind_to_cluster()
            for d in self.brokers + self.backups:
                d.start(self.env)
            self.wait_registered()
        except BaseException:
            self.stop()
            raise
        log.info("local cluster up at %s: %d brokers, %d backups", self.bootstrap,
                 len(self.brokers), len(self.backups))
        return self

    def _bind_to_cluster(self) -> None:
        """Start brokers and backups with --cluster-id: should an address of theirs reach
        another cluster's coordinator (a port taken meanwhile), it refuses them."""
        client = CoordinatorClient(self.bootstrap, key_file=self.key_file)   # follows the leader
        try:
            cluster_id = client.call("cluster")[0]["cluster_id"]
        finally:
            client.close()
        for d in self.brokers + self.backups:
            if "--cluster-id" not in d.args:
                d.args += ["--cluster-id", cluster_id]

    def _check_ports_free(self) -> None:
        """Refuse to start on a port something already listens on: a daemon would fail to
        bind, or a broker would join the cluster that owns the coordinator's port."""
        ports = [(d.name, d.host, d.port) for d in self.daemons if not d.prefix]
        ports += [(f"broker-{i} Kafka listener", *_host_port(a))
                  for i, a in enumerate(self.kafka_addresses) if not self.brokers[i].prefix]
        for name, host, port in ports:
            if not port_free(host, port):
                raise ClusterError(f"port {port} ({name}) is in use on {host}: another kera "
                                   f"local or service listens there; stop it, or pick other "
                                   f"ports (--port 0 for free ones)")

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every daemon (brokers and backups first), SIGKILL what is left after
        `timeout_s`."""
        for group in (self.brokers + self.backups, self.coordinators):
            for d in group:
                d.killed = True
                d.signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for d in group:
                if d.proc is not None and d.wait(max(0.0, deadline - time.monotonic())) is None:
                    log.warning("%s did not stop within %.1f s: killing it", d.name, timeout_s)
                    d.signal(signal.SIGKILL)
                    d.wait(5.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ faults
    def kill_broker(self, i: int) -> None:
        self._kill(self.brokers[i])

    def kill_backup(self, i: int) -> None:
        self._kill(self.backups[i])

    def kill_coordinator(self, i: int = 0) -> None:
        self._kill(self.coordinators[i])

    def restart_broker(self, i: int, wait: bool = True) -> None:
        self._restart(self.brokers[i], wait)

    def restart_backup(self, i: int, wait: bool = True) -> None:
        self._restart(self.backups[i], wait)

    def restart_coordinator(self, wait: bool = True, i: int = 0) -> None:
        """Start coordinator `i` again on the same port and data dir; with `wait`, until every
        running broker and backup has re-registered and heartbeats again."""
        self._restart(self.coordinators[i], False)
        if wait:
            self.wait_coordinator()
            self.wait_registered()

    def supervisor(self) -> Supervisor:
        """A Supervisor (kera.cli.supervisor) that knows every daemon as started now."""
        supervisor = Supervisor()
        now = time.monotonic()
        for d in self.daemons:
            supervisor.started(d.name, now)
        return supervisor

    def supervise(self, supervisor: Supervisor, now: float) -> None:
        """One look: note daemons that exited (logged with their log file), restart those
        whose back-off has passed."""
        for d in self.daemons:
            if d.proc is not None and d.proc.poll() is not None and not d.killed \
                    and not supervisor.waiting(d.name):
                what = supervisor.exited(d.name, d.proc.returncode, now)
                log.warning("%s exited with code %s (see %s): %s", d.name, d.proc.returncode,
                            d.log_path, what)
        by_name = {d.name: d for d in self.daemons}
        for name in supervisor.due(now):
            log.info("restarting %s", name)
            by_name[name].start(self.env)
            supervisor.started(name, now)

    def _kill(self, d: Daemon) -> None:
        d.killed = True
        d.signal(signal.SIGKILL)
        d.wait(5.0)

    def _restart(self, d: Daemon, wait: bool) -> None:
        if d.running():
            self._kill(d)
        if d.kind != "coordinator":
            d.registered_after = self._metadata_version()
        d.start(self.env)
        if wait and d.kind != "coordinator":
            self.wait_registered()

    # ------------------------------------------------------------------ waiting
    def wait_coordinator(self, timeout_s: float | None = None) -> None:
        self._wait(lambda c: True, "the coordinator to answer", timeout_s)

    def wait_registered(self, timeout_s: float | None = None) -> dict:
        """Wait until every running broker and backup shows alive in `cluster`; returns it."""
        def registered(d: Daemon, members: list[dict]) -> bool:
            for m in members:
                if (m["id"] == d.index or m["address"] == d.address) and m["alive"] and \
                        (not d.registered_after or m.get("registered_version", 0) > d.registered_after):
                    return True
            return False

        def done(cluster: dict) -> bool:
            waiting = [d for kind, daemons in (("brokers", self.brokers), ("backups", self.backups))
                       for d in daemons if d.running() and not registered(d, cluster[kind])]
            if waiting:
                return False
            for d in self.brokers + self.backups:
                d.registered_after = 0
            return True
        return self._wait(done, "every broker and backup to register", timeout_s)

    def _metadata_version(self) -> int:
        try:
            with closing(CoordinatorClient(self.bootstrap, timeout_s=1.0, key_file=self.key_file)) as c:
                return c.call("cluster")[0]["metadata_version"]
        except KeraError:
            return 0

    def _wait(self, done, what: str, timeout_s: float | None) -> dict:
        budget = self.start_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        last_error = None
        with closing(CoordinatorClient(self.bootstrap, timeout_s=1.0, key_file=self.key_file)) as conn:
            while True:
                self._check_running()
                try:
                    header, _ = conn.call("cluster", timeout_s=min(1.0, budget))
                    if done(header):
                        return header
                except KeraError as err:
                    last_error = err
                if time.monotonic() > deadline:
                    raise ClusterError(f"timed out after {budget:.1f} s waiting for {what}"
                                       f" (last error: {last_error})\n" + self._tails())
                time.sleep(POLL_S)

    def _check_running(self) -> None:
        for d in self.daemons:
            if d.proc is not None and not d.killed and d.proc.poll() is not None:
                raise ClusterError(f"{d.name} exited with code {d.proc.returncode}; "
                                   f"log {d.log_path}:\n{d.log_tail()}")

    def _tails(self) -> str:
        return "\n".join(f"--- {d.name} ({d.log_path}):\n{d.log_tail(1500)}"
                         for d in self.daemons if d.proc is not None)

    def leader_index(self) -> int | None:
        """Which running coordinator answers as the leader (several on etcd), if one does."""
        for i, c in enumerate(self.coordinators):
            if not c.running():
                continue
            try:
                rpc_call(c.address, "cluster", timeout_s=1.0, key_file=self.key_file)
                return i
            except KeraError:   # not_leader, or not answering
                continue
        return None

    # ------------------------------------------------------------------ conveniences
    def admin(self, timeout_s: float = 10.0):
        from kera.client.admin import Admin
        return Admin(self.bootstrap, timeout_s=timeout_s, key_file=self.key_file)

    def summary(self) -> str:
        return (f"kera local cluster at {self.bootstrap}: coordinator pid {self.coordinator.pid}, "
                f"{len(self.brokers)} brokers ({', '.join(d.address for d in self.brokers) or '-'}), "
                f"{len(self.backups)} backups ({', '.join(d.address for d in self.backups) or '-'}); "
                f"data and logs in {self.data_dir}")
