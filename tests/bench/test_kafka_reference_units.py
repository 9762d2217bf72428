"""The pure pieces of the trusted-Kafka comparison: reading Kafka's Java tools' output (samples
captured from kafka-tools 4.1.2 on this machine), the tuned producer settings, the tools' rows,
the equal-load plan and its table, the systems `--kafka-java` / `--kafka-tuned` add."""

import pytest

from bench import equal_load, kafka_tools
from bench.cli import choose_systems, with_reference_systems, without_java_if_missing
from bench.clients import kafka_producer_settings, kafka_tuned_producer
from bench.kafka_java import PRODUCER_ACK, java_trial_result
from bench.report import equal_load_table, summarize
from bench.workload import KiB, MiB, PRESETS, Workload

INTERVAL = ("171677 records sent, 34335.4 records/sec (3.27 MB/sec), 605.2 ms avg latency, "
            "1632.0 ms max latency.")
SUMMARY = ("300000 records sent, 49693.6 records/sec (4.74 MB/sec), 825.56 ms avg latency, "
           "1632.00 ms max latency, 978 ms 50th, 1214 ms 95th, 1238 ms 99th, 1261 ms 99.9th.")
CONSUMER_HEADER = ("start.time, end.time, data.consumed.in.MB, MB.sec, data.consumed.in.nMsg, "
                   "nMsg.sec, rebalance.time.ms, fetch.time.ms, fetch.MB.sec, fetch.nMsg.sec")
CONSUMER_VALUES = ("2026-11-26 01:26:12:280, 2026-11-26 01:26:18:166, 28.6102, 4.8607, 300000, "
                   "50968.3996, 2375, 3511, 8.1487, 85445.7420")
TIMEOUT_WARNING = ("WARNING: Exiting before consuming the expected number of messages: timeout "
                   "(30000 ms) exceeded. You can use the --timeout option to increase the timeout.")


@pytest.mark.parametrize("text", [
    SUMMARY,
    INTERVAL + "\n" + SUMMARY + "\n",
    "SLF4J: a warning\n" + INTERVAL + "\n" + INTERVAL + "\n" + SUMMARY,
])
def test_producer_summary_is_read_whatever_comes_before(text):
    s = kafka_tools.parse_producer_summary(text)
    assert s["records"] == 300000 and isinstance(s["records"], int)
    assert (s["records_per_s"], s["mb_per_s"]) == (49693.6, 4.74)
    assert (s["latency_avg_ms"], s["latency_max_ms"]) == (825.56, 1632.0)
    assert [s[f"latency_{p}_ms"] for p in ("p50", "p95", "p99", "p999")] == [978, 1214, 1238, 1261]


@pytest.mark.parametrize("text", ["", INTERVAL, "Exception in thread main ...", SUMMARY[:80]])
def test_producer_output_without_a_summary_is_an_error(text):
    with pytest.raises(kafka_tools.ToolOutputError):
        kafka_tools.parse_producer_summary(text)


@pytest.mark.parametrize("text, steady, rate", [
    (SUMMARY, False, 49693.6),                                  # no interval line: whole run
    (INTERVAL + "\n" + SUMMARY,                                 # the rest after the first 5 s
     True, (300000 - 171677) / (300000 / 49693.6 - 171677 / 34335.4)),
    (INTERVAL + "\n" + SUMMARY.replace("300000 records", "171677 records"),  # nothing after
     False, 49693.6),
])
def test_steady_rate_leaves_out_the_first_interval(text, steady, rate):
    run = kafka_tools.parse_producer_run(text)
    assert run["steady"] is steady
    assert run["steady_records_per_s"] == pytest.approx(rate)


def test_producer_intervals_skip_the_summary():
    assert kafka_tools.parse_producer_intervals(INTERVAL + "\n" + SUMMARY) == [(171677, 34335.4)]


@pytest.mark.parametrize("text", [
    CONSUMER_HEADER + "\n" + CONSUMER_VALUES + "\n",
    TIMEOUT_WARNING + "\n" + CONSUMER_HEADER + "\n" + CONSUMER_VALUES,
    "\n\n" + CONSUMER_HEADER + "\n\n" + CONSUMER_VALUES + "\n\n",
])
def test_consumer_summary_columns(text):
    c = kafka_tools.parse_consumer_summary(text)
    assert c["data.consumed.in.nMsg"] == 300000 and isinstance(c["data.consumed.in.nMsg"], int)
    assert (c["MB.sec"], c["nMsg.sec"]) == (4.8607, 50968.3996)
    assert (c["rebalance.time.ms"], c["fetch.nMsg.sec"]) == (2375.0, 85445.742)
    assert c["start.time"] == "2026-11-26 01:26:12:280"


@pytest.mark.parametrize("text", ["", TIMEOUT_WARNING, CONSUMER_HEADER,
                                  CONSUMER_HEADER + "\n1, 2, 3"])
def test_consumer_output_without_values_is_an_error(text):
    with pytest.raises(kafka_tools.ToolOutputError):
        kafka_tools.parse_consumer_summary(text)


W = Workload("w", producers=2, streams=1, streamlets=8, replication=3,
             chunk_size_bytes=16 * KiB, rate_records_per_s=1000)


@pytest.mark.parametrize("tuned, batch, linger, buffer", [
    (False, 16 * KiB, "5", W.producer_buffer_bytes),
    (True, 256 * KiB, "20", 64 * MiB),
])
def test_java_producer_props_follow_the_workload_or_the_tuning(tuned, batch, linger, buffer):
    props = kafka_tools.producer_props(W, "127.0.0.1:9", tuned)
    assert (props["acks"], props["enable.idempotence"], props["compression.type"]) == \
        ("all", "true", "none")
    assert (props["batch.size"], props["linger.ms"], props["buffer.memory"]) == \
        (str(batch), linger, str(buffer))
    args = kafka_tools.producer_args("t", 500, 250, W, props)
    assert args[:9] == [kafka_tools.PRODUCER_PERFORMANCE, "--topic", "t", "--num-records", "500",
                        "--record-size", "100", "--throughput", "250"]
    assert f"batch.size={batch}" in args


@pytest.mark.parametrize("chunk", [4 * KiB, 64 * KiB, 1024 * KiB])
def test_tuning_never_shrinks_the_workload_and_only_touches_three_settings(chunk):
    w = W.replace(chunk_size_bytes=chunk)
    t = kafka_tuned_producer(w)
    assert t["batch_size_bytes"] == max(chunk, 256 * KiB) and t["linger_ms"] >= w.linger_ms
    plain, tuned = kafka_producer_settings(w), kafka_producer_settings(w, tuned=True)
    assert {k for k in plain if plain[k] != tuned[k]} <= {
        "batch.size", "linger.ms", "queue.buffering.max.kbytes", "queue.buffering.max.messages"}
    assert tuned["acks"] == "all" and tuned["enable.idempotence"] is True


def _producer(rate, p99):
    return {"records": 1000, "records_per_s": rate / 2, "steady_records_per_s": rate,
            "latency_p50_ms": p99 / 4, "latency_p99_ms": p99, "latency_p999_ms": p99 * 2}


def test_java_rows_sum_rates_and_take_the_worst_latency():
    produced = [(_producer(100.0, 8.0), 1.0), (_producer(300.0, 4.0), 2.0)]
    consumed = [({"data.consumed.in.nMsg": 2000, "fetch.nMsg.sec": 250.0}, 0.5)]
    t = java_trial_result("kafka-java", W, 0, produced, consumed, 10.0, 0.5, (6.0, 20.0))
    assert (t.producer_records_per_s, t.consumer_records_per_s) == (400.0, 250.0)
    assert (t.latency_p99_ms, t.latency_p999_ms, t.latency_kind) == (8.0, 16.0, PRODUCER_ACK)
    assert (t.acked, t.consumed, t.drained) == (2000, 2000, True)
    assert t.cpu_s_per_million == pytest.approx(4.0 / 0.002)
    assert t.machine_busy_fraction == 0.3 and t.other_cpu_s == pytest.approx(2.0)


@pytest.mark.parametrize("producer, consumer, expected", [
    (100.0, 80.0, 80.0), (50.0, 90.0, 50.0), (None, 70.0, 70.0), (None, None, None)])
def test_sustainable_rate_is_the_smaller_of_produced_and_consumed(producer, consumer, expected):
    medians = {"producer_records_per_s": producer, "consumer_records_per_s": consumer}
    assert equal_load.sustainable_rate(medians) == expected


def _summary(**rates):
    return {"medians": {s: {"producer_records_per_s": p, "consumer_records_per_s": c}
                        for s, (p, c) in rates.items()}}


def test_the_slowest_contender_sets_the_load_and_the_java_tools_never_do():
    summary = _summary(kera=(500.0, 400.0), kafka=(300.0, 120.0), **{"kafka-java": (90.0, 80.0)})
    assert equal_load.reference(summary, ["kera", "kafka", "kafka-java"]) == ("kafka", 120.0)
    assert equal_load.reference(_summary(**{"kafka-java": (9.0, 8.0)}), ["kafka-java"]) is None


@pytest.mark.parametrize("producers", [1, 2, 3])
def test_loads_are_fractions_split_over_producers(producers):
    w = W.replace(producers=producers, rate_records_per_s=0, tags={"R": 3, "load": "max"})
    loads = equal_load.load_workloads(w, 12_000.0, (0.25, 0.5, 0.75))
    assert [x.rate_records_per_s for x in loads] == [round(f * 12_000 / producers)
                                                     for f in (0.25, 0.5, 0.75)]
    assert [x.tags["load"] for x in loads] == ["25%", "50%", "75%"]
    assert all(x.tags["R"] == 3 and x.replication == 3 for x in loads)
    assert len({x.name for x in loads}) == 3


def _trial(system, label, rate, p50, kind="end-to-end"):
    return {"system": system, "label": label, "repeat": 0, "producer_records_per_s": rate,
            "producer_mb_per_s": rate / 1e4, "consumer_records_per_s": rate,
            "latency_p50_ms": p50, "latency_p99_ms": 2 * p50, "latency_p999_ms": 3 * p50,
            "cpu_s_per_million": 1.0, "server_cpu_s_per_million": 0.5, "acked": 10,
            "consumed": 10, "failed": 0, "window_s": 1.0, "window_acked": 10,
            "window_consumed": 10, "server_cpu_s": 0.1, "producer_cpu_s": 0.1,
            "consumer_cpu_s": 0.1, "machine_busy_fraction": 0.5, "other_cpu_s": 0.0,
            "drained": True, "latency_kind": kind}


def test_equal_load_plan_and_table():
    w = W.replace(rate_records_per_s=0, tags={"load": "max"})
    full = {"workload": w.to_dict(), "trials": [_trial("kera", "load=max", 900.0, 1.0),
                                                _trial("kafka", "load=max", 400.0, 9.0)]}
    full["summary"] = summarize(full)
    loads, notes = equal_load.plan([full], [w], ["kera", "kafka"], (0.5,))
    assert [x.rate_records_per_s for x in loads] == [100]
    assert notes[0]["reference_system"] == "kafka"
    label = loads[0].label()
    at = {"workload": loads[0].to_dict(),
          "trials": [_trial("kera", label, 200.0, 2.0),
                     _trial("kafka-java", label, 200.0, 5.0, PRODUCER_ACK)]}
    at["summary"] = summarize(at)
    text = "\n".join(equal_load_table({"equal_load": notes, "configurations": [full, at],
                                       "baseline": None}))
    assert "| 50% | 200 | kera | 200 | 200 | 2.00 | 4.00 | 6.00 | send → receipt |" in text
    assert "send → ack" in text and "400 records/s" in text


@pytest.mark.parametrize("names, java, tuned, expected", [
    ("kera,kafka", False, False, "kera,kafka"),
    ("kera,kafka", True, False, "kera,kafka,kafka-java"),
    ("kera,kafka", False, True, "kera,kafka,kafka-tuned"),
    ("kera,kafka", True, True, "kera,kafka,kafka-tuned,kafka-java,kafka-java-tuned"),
    ("kera,kafka-java", True, False, "kera,kafka-java"),
])
def test_reference_flags_add_systems_once(names, java, tuned, expected):
    assert with_reference_systems(names, java, tuned) == expected
    assert choose_systems(expected, "off", False) == expected.split(",")


@pytest.mark.parametrize("systems, missing, kept", [
    (["kera", "kafka", "kafka-java"], None, ["kera", "kafka", "kafka-java"]),
    (["kera", "kafka", "kafka-java", "kafka-java-tuned"], "no java", ["kera", "kafka"]),
    (["kera"], "no java", ["kera"]),
])
def test_java_systems_are_skipped_with_a_message_when_java_is_missing(systems, missing, kept):
    notes = []
    assert without_java_if_missing(systems, missing, notes.append) == kept
    assert bool(notes) == (kept != systems)
    assert all("no java" in n and "kafka-java" in n for n in notes)


def test_without_java_nothing_left_to_run_is_an_error():
    with pytest.raises(ValueError, match="nothing to run"):
        without_java_if_missing(["kafka-java"], "no java", lambda _: None)


def test_presets_of_the_trusted_comparison():
    latency = PRESETS["latency-r3"]
    assert latency.equal_load == (0.25, 0.5, 0.75)
    assert all(w.replication == 3 and w.rate_records_per_s == 0 for w in latency.workloads)
    assert {"kafka-java", "kafka-tuned"} <= set(PRESETS["reference"].systems)
