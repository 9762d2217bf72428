"""kera.daemon.gc_policy: a daemon's start-up objects frozen out of later collections and a higher
young-generation threshold; run in a child interpreter, so this test process keeps its own."""

from __future__ import annotations

import json
import subprocess
import sys

from kera.daemon import gc_policy

PROBE = """
import gc, json
from kera.daemon import gc_policy
before = gc.get_threshold()
gc_policy.tune_daemon()
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def test_a_tuned_process_freezes_its_start_up_objects_and_collects_young_ones_less_often():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    got = json.loads(out)
    assert got["before"][0] == 700                     # CPython's default, which it replaces
    assert got["after"] == [gc_policy.YOUNG_COLLECTION_OBJECTS, *got["before"][1:]]
    assert got["frozen"] > 1000                       # the modules kera imported, at least
