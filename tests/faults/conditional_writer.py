"""A Waltz-style writer as its own process, for tests/faults/test_conditional_race.py.

    python -m tests.faults.conditional_writer BOOTSTRAP STREAM WRITER APPENDS LOCKS SEED

Makes APPENDS conditional appends of 1-3 records, each naming 1-2 of LOCKS lock ids (ints)
with the writer's high-water mark: after a success the number of its own last record, after a
conflict the number the broker named (as if it had read up to there). Prints one JSON line
per append: {"w", "i", "locks", "hwm", and "ok": number | "conflict": [lock, number] |
"uncertain": message}. A record's value is b"WRITER-I-K".
"""

from __future__ import annotations

import json
import random
import sys

from kera.services.conditional import ConditionalAppender
from kera.errors import KeraError, LockConflict

APPEND_TIMEOUT_S = 60.0   # a broker failover in the middle is retried through


def main(bootstrap: str, stream: str, writer: int, appends: int, locks: int, seed: int) -> None:
    rng = random.Random(seed)
    hwm = -1
    with ConditionalAppender(bootstrap, timeout_s=APPEND_TIMEOUT_S, request_timeout_s=3.0) as log:
        for i in range(appends):
            mine = rng.sample(range(locks), rng.randrange(1, 3))
            n = rng.randrange(1, 4)
            out = {"w": writer, "i": i, "locks": mine, "hwm": hwm, "n": n}
            try:
                md = log.append(stream, [b"%d-%d-%d" % (writer, i, k) for k in range(n)],
                                locks=mine, high_water_mark=hwm)
                out["ok"] = md.number
                hwm = max(hwm, md.number + n - 1)
            except LockConflict as err:
                out["conflict"] = [err.lock, err.number]
                hwm = max(hwm, err.number)
            except KeraError as err:
                out["uncertain"] = str(err)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]))
