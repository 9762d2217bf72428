"""kera.cli.stats_view: `kera stats` grouped by daemon kind and topic, with legends and units."""

from kera.cli.stats_view import format_bytes, render, unit_of

STATS = {
    "coordinator": {"requests_heartbeat": 25, "brokers_alive": 2, "persist_ms_total": 3.29,
                    "metadata_version": 3},
    "brokers": {"1": {"bytes_appended": 3 * 1024 * 1024, "chunks_appended": 12,
                      "chunks_per_replication_write": 1.5, "recovery_replay_s": 0.25,
                      "brand_new_counter": 7},
                "0": {"bytes_appended": 100, "chunks_appended": 1}},
    "backups": {"0": {"registered": True, "unflushed_bytes": 2048, "replicas_open": 4}},
}


def section(text: str, title: str) -> str:
    return text.split(f"== {title} ==", 1)[1].split("\n== ", 1)[0]


def test_each_daemon_kind_has_a_section_with_one_column_per_daemon_in_id_order():
    text = render(STATS)
    assert text.index("== coordinator ==") < text.index("== brokers ==") < text.index("== backups ==")
    header = next(line for line in section(text, "brokers").splitlines() if line.startswith("COUNTER"))
    assert header.split() == ["COUNTER", "UNIT", "broker-0", "broker-1"]


def test_counters_are_grouped_under_a_legend_line():
    brokers = section(render(STATS), "brokers")
    produce = brokers.index("produce: ")
    replication = brokers.index("replication: ")
    assert produce < brokers.index("chunks_appended") < replication
    assert replication < brokers.index("chunks_per_replication_write")
    assert brokers.index("recovery: ") < brokers.index("recovery_replay_s")


def test_an_unknown_counter_is_shown_under_other_not_hidden():
    brokers = section(render(STATS), "brokers")
    assert brokers.index("other: ") < brokers.index("brand_new_counter")


def test_units_come_from_the_name_and_bytes_are_readable():
    rows = {line.split()[0]: line.split() for line in render(STATS).splitlines() if line}
    assert rows["bytes_appended"][1:] == ["bytes", "100", "B", "3.0", "MiB"]
    assert rows["persist_ms_total"][1:] == ["ms", "3.29"]
    assert rows["recovery_replay_s"][1] == "s"
    assert rows["chunks_per_replication_write"][1] == "ratio"
    assert rows["requests_heartbeat"][1:] == ["count", "25"]
    assert rows["registered"][1:] == ["yes/no", "yes"]
    assert rows["unflushed_bytes"][1:] == ["bytes", "2.0", "KiB"]


def test_a_counter_one_daemon_lacks_is_blank_in_its_column():
    line = next(l for l in section(render(STATS), "brokers").splitlines() if l.startswith("recovery_replay_s"))
    assert line.split() == ["recovery_replay_s", "s", "0.25"]


def test_unit_and_size_helpers():
    assert unit_of("memory_limit_bytes", 1) == "bytes"
    assert unit_of("metadata_version", 3) == "id"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(5 * 1024**5) == "5,120.0 TiB"


def test_missing_kinds_are_left_out():
    assert render({"coordinator": {"streams": 1}, "brokers": {}, "backups": {}}).count("==") == 2
