"""Fixtures for tests that run a real Apache Kafka broker (bench/kafka)."""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # make `bench` importable under any rootdir
    sys.path.insert(0, str(REPO_ROOT))


# The `kafka` marker is registered in pyproject.toml ([tool.pytest.ini_options]).
