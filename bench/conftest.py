"""pytest setup for `make bench` (python -m pytest bench --benchmark-enable): prints the core
benchmarks' summary table, with kera's ingest as a fraction of the raw pyzmq ceiling."""

from .core_summary import table


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    text = table()
    if text:
        terminalreporter.section("kera core summary")
        terminalreporter.write_line(text)
