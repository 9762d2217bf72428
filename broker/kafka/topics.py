"""The topic admin APIs: CreateTopics, DeleteTopics, CreatePartitions, DescribeConfigs.

Each is a coordinator call (create_stream, delete_stream, alter_stream) made for the client.
Kafka's topic configs map onto a stream's settings where kera has the same thing
(`TOPIC_CONFIGS`); any other config is refused by name (INVALID_CONFIG), never ignored.
"""

from __future__ import annotations

import re
from typing import Callable

from kio.schema.errors import ErrorCode

from kera.broker.kafka.context import Call, Context, Gather
from kera.broker.kafka.errors import kafka_code
from kera.codec import cleanup
from kera.errors import BadRequest

# Kafka's legal topic names (kera's stream names allow the same characters, up to 255).
TOPIC_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,249}\Z")
RESOURCE_TOPIC = 2
CONFIG_SOURCE_TOPIC = 1         # DYNAMIC_TOPIC_CONFIG
CONFIG_SOURCE_DEFAULT = 5       # DEFAULT_CONFIG
ACTIVE_GROUPS_CONFIG = "kera.active.groups"
# Kafka config -> (stream field, kera's "none" value, Kafka's spelling of it).
TOPIC_CONFIGS = {
    "retention.ms": ("retention_ms", 0, -1),
    "retention.bytes": ("retention_bytes", 0, -1),
    "segment.bytes": ("segment_size_bytes", None, None),
    # kera's own: active groups per streamlet, each a partition (kera.broker.kafka.slots).
    ACTIVE_GROUPS_CONFIG: ("active_groups", None, None),
}
# Kafka's cleanup configs, kept by kera.codec.cleanup (a policy string, a ratio: not integers).
CLEANUP_CONFIGS = ("cleanup.policy", *cleanup.BY_KAFKA_NAME)


def valid_topic_name(name: str) -> str | None:
    """None for a legal topic name, else why not."""
    if not TOPIC_NAME_RE.match(name) or name in (".", ".."):
        return f"topic name {name!r} must be 1-249 characters of letters, digits, '.', '_', '-'"
    return None


def create_topic(ctx: Context, name: str, partitions: int, replication: int,
                 done: Callable[[ErrorCode, str | None], None], settings: dict | None = None) -> None:
    # murmur2: kera's clients then place keys in the partition Kafka's clients pick.
    fields = {"name": name, "streamlets": partitions, "replication": replication,
              "active_groups": 1, "partitioner": "murmur2", **(settings or {})}

    def reply(header, error):
        ctx.catalog.forget()
        done(ErrorCode.none, None) if error is None else done(kafka_code(error), error.message)

    ctx.catalog.calls.call("create_stream", fields, reply)


def handle_create_topics(ctx: Context, call: Call) -> None:
    topics = list(call.body.topics)
    gather = Gather(len(topics), lambda results: call.answer({"topics": results}))

    def finish(i: int, code: ErrorCode, message: str | None, topic) -> None:
        gather.put(i, {"name": topic.name, "error_code": code, "error_message": message,
                       "num_partitions": topic.num_partitions if code == 0 else -1,
                       "replication_factor": topic.replication_factor if code == 0 else -1,
                       # v5+: Java's admin client reads the list on success (null: an NPE)
                       "configs": []})

    repeated = _repeated([t.name for t in topics])
    for i, t in enumerate(topics):
        if t.name in repeated:
            finish(i, ErrorCode.invalid_request, f"topic {t.name!r} is named twice", t)
        else:
            _create_one(ctx, call, t, lambda code, msg, i=i, t=t: finish(i, code, msg, t))


def _create_one(ctx: Context, call: Call, t, done) -> None:
    why = valid_topic_name(t.name)
    if why is not None:
        return done(ErrorCode.invalid_topic_exception, why)
    settings, why = _settings(t.configs or ())
    if why is not None:
        return done(ErrorCode.invalid_config, why)
    partitions = t.num_partitions if t.num_partitions > 0 else ctx.settings.default_partitions
    replication = t.replication_factor if t.replication_factor > 0 else \
        ctx.settings.default_replication
    if t.assignments:
        return done(ErrorCode.invalid_request, "kera places partitions itself: give no "
                                               "replica assignment")
    q = settings.get("active_groups", 1)
    if q > 0 and partitions % q:
        return done(ErrorCode.invalid_partitions,
                    f"{partitions} partitions with {ACTIVE_GROUPS_CONFIG}={q}: a streamlet is "
                    f"{q} partitions, so ask for a multiple of {q}")
    if call.body.validate_only:
        return done(ErrorCode.none, None)
    create_topic(ctx, t.name, partitions // max(q, 1), replication, done, settings)


def _settings(configs) -> tuple[dict, str | None]:
    out = {}
    for c in configs:
        if c.name == "cleanup.policy" or c.name in cleanup.BY_KAFKA_NAME:
            try:
                out.update(_cleanup_setting(c.name, c.value))
            except BadRequest as err:
                return {}, err.message
            continue
        if c.name not in TOPIC_CONFIGS:
            return {}, (f"config {c.name!r} is not supported by kera; supported: "
                        f"{', '.join(sorted([*TOPIC_CONFIGS, *CLEANUP_CONFIGS]))}")
        field, none, kafka_none = TOPIC_CONFIGS[c.name]
        try:
            value = int(c.value)
        except (TypeError, ValueError):
            return {}, f"config {c.name!r} must be an integer, not {c.value!r}"
        out[field] = none if kafka_none is not None and value == kafka_none else value
    return out, None


def _cleanup_setting(name: str, value) -> dict:
    """The stream field of a Kafka cleanup config (cleanup.policy, the compaction settings)."""
    if name == "cleanup.policy":
        return {"cleanup_policy": cleanup.policy(value)}
    field = cleanup.BY_KAFKA_NAME[name]
    return {field: cleanup.from_kafka(field, value)}


def handle_delete_topics(ctx: Context, call: Call) -> None:
    body = call.body
    names = [t.name for t in body.topics] if hasattr(body, "topics") else list(body.topic_names)
    gather = Gather(len(names), lambda results: _answer_after_change(ctx, call, "responses",
                                                                      results))

    def finish(i, error, code=None):
        gather.put(i, {"name": names[i], "error_message": None if error is None else error.message,
                       "error_code": code if code is not None else ErrorCode.none
                       if error is None else kafka_code(error)})

    repeated = _repeated(names)
    for i, name in enumerate(names):
        if name in repeated or name is None:
            finish(i, BadRequest(f"topic {name!r} is named twice, or by id only"),
                   ErrorCode.invalid_request)
            continue
        ctx.catalog.calls.call("delete_stream", {"name": name},
                               lambda h, e, i=i: finish(i, e))


def handle_create_partitions(ctx: Context, call: Call) -> None:
    ctx.catalog.fresh(lambda error: _create_partitions(ctx, call))


def _create_partitions(ctx: Context, call: Call) -> None:
    topics = list(call.body.topics)
    gather = Gather(len(topics), lambda results: _answer_after_change(ctx, call, "results",
                                                                       results))

    def finish(i, error):
        gather.put(i, {"name": topics[i].name, "error_code": ErrorCode.none if error is None
                       else _partitions_code(error),
                       "error_message": None if error is None else error.message})

    repeated = _repeated([t.name for t in topics])
    for i, t in enumerate(topics):
        streamlets, why = streamlets_for(ctx.catalog.topics.get(t.name), t.count)
        if t.name in repeated:
            finish(i, BadRequest(f"topic {t.name!r} is named twice"))
        elif why is not None:
            finish(i, BadRequest(why))
        elif call.body.validate_only:
            finish(i, None)
        else:
            ctx.catalog.calls.call("alter_stream", {"name": t.name, "streamlets": streamlets},
                                   lambda h, e, i=i: finish(i, e))


def streamlets_for(info, count: int) -> tuple[int, str | None]:
    """(streamlets, None) giving a topic `count` partitions, or (0, why not): with Q active
    groups a streamlet is Q partitions (kera.broker.kafka.slots), so `count` must be a multiple
    of Q. An unknown topic keeps `count`: the coordinator refuses it by name."""
    q = 1 if info is None else info.active_groups
    if count % q:
        return 0, (f"topic {info.name!r} has {q} active groups per streamlet, so its "
                   f"partitions come {q} at a time (one per streamlet and group): ask for a "
                   f"multiple of {q}, such as {(count // q + 1) * q}")
    return count // q, None


def _answer_after_change(ctx: Context, call: Call, field: str, results: list) -> None:
    ctx.catalog.forget()      # the next Metadata lists the topics again
    call.answer({field: results})


def _repeated(names: list) -> set:
    """Names given more than once in one request: each is answered INVALID_REQUEST, as Kafka
    does, and not acted on."""
    seen: set = set()
    return {n for n in names if n in seen or seen.add(n)}


def _partitions_code(error) -> ErrorCode:
    if error.code == "bad_request":
        return ErrorCode.invalid_partitions
    return kafka_code(error)


def handle_describe_configs(ctx: Context, call: Call) -> None:
    ctx.catalog.fresh(lambda error: call.answer({"results": [
        _describe(ctx, r) for r in call.body.resources]}))


def _describe(ctx: Context, r) -> dict:
    out = {"error_code": ErrorCode.none, "error_message": None,
           "resource_type": r.resource_type, "resource_name": r.resource_name, "configs": []}
    if r.resource_type != RESOURCE_TOPIC:
        out["configs"] = []          # broker configs: none exposed
        return out
    info = ctx.catalog.topics.get(r.resource_name)
    if info is None:
        out["error_code"] = ErrorCode.unknown_topic_or_partition
        out["error_message"] = f"no topic {r.resource_name!r}"
        return out
    wanted = None if r.configuration_keys is None else set(r.configuration_keys)
    configs = topic_configs(info, ctx.catalog.settings.get(r.resource_name, {}))
    out["configs"] = [c for c in configs if wanted is None or c["name"] in wanted]
    return out


def topic_configs(info, descriptor: dict) -> list[dict]:
    """A stream's settings (its descriptor as listed) as Kafka topic configs."""
    retention_ms = descriptor.get("retention_ms", 0) or -1
    retention_bytes = descriptor.get("retention_bytes", 0) or -1
    segment = descriptor.get("segment_size_bytes")
    settings = cleanup.from_descriptor(descriptor)
    entries = {"cleanup.policy": settings["cleanup_policy"], "retention.ms": str(retention_ms),
               "retention.bytes": str(retention_bytes),
               "min.insync.replicas": str(info.replication),
               ACTIVE_GROUPS_CONFIG: str(descriptor.get("active_groups", 1))}
    for field, (name, _) in cleanup.SETTINGS.items():
        entries[name] = cleanup.kafka_value(field, settings[field])
    if segment:
        entries["segment.bytes"] = str(segment)
        entries["max.message.bytes"] = str(segment)
    return [{"name": k, "value": v, "read_only": k in ("max.message.bytes", "min.insync.replicas",
                                                       ACTIVE_GROUPS_CONFIG),
             "config_source": CONFIG_SOURCE_TOPIC, "is_sensitive": False, "synonyms": []}
            for k, v in entries.items()]
