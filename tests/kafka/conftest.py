"""Fixtures for tests that run a real Apache Kafka broker (bench/kafka)."""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # make `bench` importable under any rootdir
    sys.path.insert(0, str(REPO_ROOT))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kafka: runs a real Apache Kafka broker (JVM; Maven fetches jars on first run)")
