# Fresh machine: `make demo` sets up and runs the main job; `make test` sets up and runs the tests.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .venv-stamp

.PHONY: setup demo test test-fast test-slow bench clean

$(STAMP): pyproject.toml
	$(PIP) install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PYTHON) -m kera.demo --records 1000000

test: setup
	$(PYTHON) -m pytest tests -q -m "not slow" --durations=40

# Long soaks (e.g. the 50,000-message control-plane fuzz), kept out of `make test`.
test-slow: setup
	$(PYTHON) -m pytest tests -q -m slow

test-fast: setup
	$(PYTHON) -m pytest tests -q -m "not kafka and not spark and not slow"

bench: setup
	$(PYTHON) -m pytest bench -q --benchmark-enable -p no:randomly

clean:
	rm -rf $(STAMP) build dist *.egg-info .pytest_cache

# The Spark connector on a real standalone cluster (a master and two worker JVMs; ~2 minutes).
.PHONY: test-spark-standalone
test-spark-standalone: setup
	$(PYTHON) -m pytest tests/spark/test_standalone.py -q -p no:randomly

# A cluster across six test hosts made of network namespaces (needs root and iproute2; ~2 minutes).
.PHONY: test-hosts
test-hosts: setup
	$(PYTHON) -m pytest tests/hosts -q -p no:randomly
