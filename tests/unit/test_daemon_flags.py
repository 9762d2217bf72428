"""kera.daemon.flags: the coordinator, broker and backup parse their shared flags one way."""

from __future__ import annotations

import argparse
import importlib

import pytest

from kera.daemon import flags as daemon_flags
from kera.coordinator.server import DEFAULT_PORT

DAEMONS = {   # module -> the arguments it needs besides the shared ones
    "kera.coordinator.server": ["--dir", "/tmp/x"],
    "kera.broker.server": ["--coordinator", "127.0.0.1:1"],
    "kera.backup.server": ["--coordinator", "127.0.0.1:1", "--dir", "/tmp/x"],
}
GiB = 1 << 30


def parse(module: str, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    return parser.parse_args([*DAEMONS[module], *argv])


@pytest.mark.parametrize("module", DAEMONS)
def test_every_daemon_has_the_shared_flags_with_the_same_defaults(module):
    args = parse(module)
    assert args.host == "127.0.0.1" and args.metrics_port == 0 and args.log_level == "INFO"
    assert args.port == (DEFAULT_PORT if "coordinator" in module else 0)
    assert args.advertise is None   # the bound address unless given


@pytest.mark.parametrize("module", DAEMONS)
def test_metrics_stay_on_loopback_when_the_daemon_binds_a_routable_address(module):
    args = parse(module, "--host", "0.0.0.0", "--metrics-port", "9100")
    assert args.metrics_host == "127.0.0.1"   # plaintext and names streams: only when asked
    assert parse(module, "--metrics-host", "0.0.0.0").metrics_host == "0.0.0.0"


@pytest.mark.parametrize("module", DAEMONS)
def test_log_level_is_validated_and_case_blind(module):
    assert parse(module, "--log-level", "debug").log_level == "DEBUG"
    with pytest.raises(SystemExit):
        parse(module, "--log-level", "verbose")


@pytest.mark.parametrize("module", DAEMONS)
@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_ports_are_checked(module, flag):
    assert getattr(parse(module, flag, "65535"), flag[2:].replace("-", "_")) == 65535
    for bad in ("65536", "-1", "http"):
        with pytest.raises(SystemExit):
            parse(module, flag, bad)


@pytest.mark.parametrize("module,flag,attr", [
    ("kera.broker.server", "--memory-limit", "memory_limit"),
    ("kera.broker.server", "--disk-limit", "disk_limit"),
    ("kera.backup.server", "--disk-limit", "disk_limit"),
    ("kera.backup.server", "--max-memory-bytes", "max_memory_bytes"),
])
def test_size_flags_take_every_size_spelling(module, flag, attr):
    assert getattr(parse(module, flag, "512MiB"), attr) == 512 << 20
    assert getattr(parse(module, flag, "1GiB"), attr) == GiB
    assert getattr(parse(module, flag, "4096"), attr) == 4096
    with pytest.raises(SystemExit):
        parse(module, flag, "lots")


def test_limits_default_to_numbers_not_strings():
    broker = parse("kera.broker.server")
    assert broker.memory_limit is None and broker.disk_limit == 0
    assert parse("kera.backup.server").disk_limit == 0


def test_a_bad_size_says_how_to_write_one(capsys):
    with pytest.raises(SystemExit):
        parse("kera.broker.server", "--memory-limit", "lots")
    assert "512MiB" in capsys.readouterr().err


def test_size_bytes_and_port_number_as_argparse_types():
    assert daemon_flags.size_bytes("64mb") == 64_000_000
    with pytest.raises(argparse.ArgumentTypeError):
        daemon_flags.size_bytes("-5")
    assert daemon_flags.port_number("0") == 0
    with pytest.raises(argparse.ArgumentTypeError):
        daemon_flags.port_number(str(daemon_flags.PORT_MAX + 1))
