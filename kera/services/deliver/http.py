"""The HTTP delivery target: POST JSON batches to a URL, GET what it applied last.

The receiver's contract (a reference one is examples/deliver_receiver.py):
    GET  URL  -> 200 {"applied": [{"stream", "streamlet", "group", "offset", "number"}, ...]}
                 per streamlet its last applied record: its record number, its position
                 (group, offset), or both (a missing or null field is unknown); a receiver
                 keeping only the number, as LogPlayer's targets keep an index, is resumed
                 from the number after it
    POST URL  <- {"records": [{"stream", "streamlet", "group", "offset", "key", "value",
                               "timestamp_us", "number"}, ...]}   key/value: base64 or null;
                                      number: the record number (null before record numbers)
                 header Idempotency-Key: the batch's first and last positions
              -> any 2xx once the records and the new last-applied positions are stored
                 atomically. A receiver must skip records at or below its last applied record
                 of their streamlet: a retried batch (same Idempotency-Key) may arrive again.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

from kera.services.deliver.core import Applied, as_applied, idempotency_key
from kera.services.deliver.targets import Target
from kera.errors import BadRequest, TargetFailed
from kera.codec.position import Record

# One request's wait for the receiver: a hung receiver fails an attempt (then retried with
# backoff) rather than blocking its delivery thread forever.
HTTP_TIMEOUT_S = 10.0


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def records_to_json(records: list[Record]) -> bytes:
    return json.dumps({"records": [
        {"stream": r.stream, "streamlet": r.streamlet, "group": r.group, "offset": r.offset,
         "key": _b64(r.key), "value": _b64(r.value), "timestamp_us": r.timestamp,
         "number": r.number}
        for r in records]}).encode()


def records_from_json(body: bytes) -> list[Record]:
    return [Record(_unb64(r["key"]), _unb64(r["value"]), r["timestamp_us"], r["stream"],
                   r["streamlet"], r["group"], r["offset"], number=r.get("number"))
            for r in json.loads(body)["records"]]


def applied_to_json(applied: dict) -> bytes:
    entries = [as_applied(a) for a in applied.values()]
    return json.dumps({"applied": [
        {"stream": a.stream, "streamlet": a.streamlet, "group": a.group, "offset": a.offset,
         "number": a.number} for a in entries]}).encode()


def applied_from_json(body: bytes) -> dict[tuple[str, int], Applied]:
    out = {}
    try:
        for p in json.loads(body)["applied"]:
            out[(p["stream"], p["streamlet"])] = as_applied(Applied(
                p["stream"], p["streamlet"], p.get("group"), p.get("offset"), p.get("number")))
    except (ValueError, KeyError, TypeError) as err:
        raise BadRequest(f"the receiver's last applied is not {{\"applied\": [{{\"stream\", "
                         f"\"streamlet\", \"group\", \"offset\", \"number\"}}, ...]}}: "
                         f"{err!r}") from err
    return out


class HttpTarget(Target):
    """A URL speaking the contract above."""

    def __init__(self, url: str, timeout_s: float = HTTP_TIMEOUT_S):
        self.name = self.url = url
        self.timeout_s = timeout_s

    def _call(self, request: urllib.request.Request) -> bytes:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                return reply.read()
        except urllib.error.HTTPError as err:
            raise TargetFailed(f"{request.get_method()} {self.url} answered {err.code} "
                               f"{err.reason}: check the receiver's log") from err
        except (urllib.error.URLError, OSError) as err:
            raise TargetFailed(f"{request.get_method()} {self.url} failed ({err}): is the "
                               f"receiver running and reachable?") from err

    def last_applied(self) -> dict[tuple[str, int], Applied]:
        return applied_from_json(self._call(urllib.request.Request(self.url, method="GET")))

    def apply(self, records: list[Record]) -> None:
        self._call(urllib.request.Request(
            self.url, data=records_to_json(records), method="POST",
            headers={"Content-Type": "application/json",
                     "Idempotency-Key": idempotency_key(records)}))
