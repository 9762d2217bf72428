"""Consumer groups in the simulation (tests/sim/groups.py), many seeds, and proof it has teeth.

    pytest tests/sim/test_groups_sim.py -q
    KERA_SIM_GROUP_SEED=12 pytest tests/sim/test_groups_sim.py -q   # the seed a failure names
"""

from __future__ import annotations

import logging
import os

import pytest

from kera.consumer import membership
from kera.coordinator import groups as coordinator_groups

from tests.sim.groups import GroupRun
from tests.sim.shell import SimFailure

# About 20 ms of CPU per seed on this machine.
DEFAULT_SEEDS = 300
ONE_SEED = os.environ.get("KERA_SIM_GROUP_SEED")
SEEDS = [int(ONE_SEED)] if ONE_SEED else list(range(int(os.environ.get("KERA_SIM_GROUP_SEEDS",
                                                                          DEFAULT_SEEDS))))
TEETH_SEEDS = range(200)


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)   # members log every fence and retry
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("seed", SEEDS)
def test_group_seed(seed):
    try:
        report = GroupRun(seed).run()
    except SimFailure as exc:
        pytest.fail(str(exc), pytrace=False)
    assert report["handovers"] > 0


def failures() -> list[str]:
    out = []
    for seed in TEETH_SEEDS:
        try:
            GroupRun(seed).run()
        except SimFailure as exc:
            out.append(str(exc))
    return out


def test_catches_members_that_hold_on_past_their_session(monkeypatch):
    monkeypatch.setattr(membership, "SELF_FENCE_FRACTION", 1.5)
    found = failures()
    assert any("still holds it" in f for f in found), found[:3]


def test_catches_grants_right_after_a_coordinator_restart(monkeypatch):
    real = coordinator_groups.Groups.load

    def forgetful(self, state, now, session_max_ms=None):
        real(self, state, now, session_max_ms)
        self.grants_after_s = float("-inf")

    monkeypatch.setattr(coordinator_groups.Groups, "load", forgetful)
    found = failures()
    assert any("still holds it" in f for f in found), found[:3]
