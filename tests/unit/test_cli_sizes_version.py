"""Size flags share one syntax (plain bytes, 64MiB, 1GiB) and `kera --version` names the version."""
import subprocess
import sys

import pytest

import kera
from kera.cli import main as cli


def test_version_prints_package_version():
    out = subprocess.run([sys.executable, "-m", "kera", "--version"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0
    assert out.stdout.strip() == f"kera {kera.__version__}"


@pytest.mark.parametrize("text,expected", [("64MiB", 64 * 1024 * 1024), ("1GiB", 1 << 30),
                                           ("4096", 4096)])
def test_segment_size_flag_takes_units(text, expected):
    args = cli.build_parser(["stream", "create", "s", "--segment-size-bytes", text]).parse_args(
        ["stream", "create", "s", "--segment-size-bytes", text])
    assert args.segment_size_bytes == expected


def test_size_flag_refuses_garbage_with_examples(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["stream", "create", "s", "--segment-size-bytes", "64 apples"])
    assert "512MiB" in capsys.readouterr().err


def _daemon_args(module, argv):
    import argparse
    import importlib
    parser = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(parser)
    return parser.parse_args(["--coordinator", "127.0.0.1:1", *argv])


@pytest.mark.parametrize("module,flag,attr", [
    ("kera.broker.server", "--virtual-segment-bytes", "virtual_segment_bytes"),
    ("kera.backup.server", "--max-unflushed-bytes", "max_unflushed_bytes"),
    ("kera.backup.server", "--max-memory-bytes", "max_memory_bytes"),
    ("kera.backup.server", "--max-replica-bytes", "max_replica_bytes"),
])
def test_daemon_size_flags_take_units(module, flag, attr):
    extra = ["--dir", "/tmp/x"] if "backup" in module else []
    args = _daemon_args(module, [*extra, flag, "64MiB"])
    assert getattr(args, attr) == 64 * 1024 * 1024
