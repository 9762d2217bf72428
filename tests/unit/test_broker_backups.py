"""Backup choice: live, distinct, off the broker's node, least loaded, failed ones last."""

from kera.broker.backups import BackupPool


def entries(*specs):
    return [{"id": i, "address": f"127.0.0.1:{9000 + i}", "node": node, "alive": alive}
            for i, node, alive in specs]


def test_prefers_other_nodes_and_spreads_load():
    pool = BackupPool("a")
    pool.update(entries((1, "a", True), (2, "b", True), (3, "c", True)))
    picks = []
    for _ in range(4):
        b = pool.choose(set(), set(), 0.0)
        pool.assign(b.id)
        picks.append(b.id)
    # Never the broker's own node while another has a backup; the load spreads evenly.
    assert sorted(picks) == [2, 2, 3, 3]
    assert sorted(picks[:2]) == [2, 3]


def test_distinct_nodes_when_possible_and_exclusions():
    pool = BackupPool("x")
    pool.update(entries((1, "b", True), (2, "b", True), (3, "c", True)))
    first = pool.choose(set(), set(), 0.0)
    second = pool.choose({first.id}, {first.node}, 0.0)
    assert first.node != second.node
    assert pool.choose({1, 2, 3}, set(), 0.0) is None


def test_dead_and_suspect_backups():
    pool = BackupPool("x")
    assert pool.update(entries((1, "b", True), (2, "c", True))) == []
    pool.suspect(1, until=10.0)
    assert pool.choose(set(), set(), 5.0).id == 2
    assert pool.choose({2}, set(), 5.0).id == 1          # suspect, but the only one left
    assert pool.choose(set(), set(), 11.0) is not None
    lost = pool.update(entries((2, "c", True)))
    assert lost == [1] and not pool.alive(1) and pool.live_count() == 1
    assert pool.update(entries((2, "c", False))) == [2]


def test_malformed_entries_are_skipped():
    pool = BackupPool("x")
    pool.update([{"id": "1"}, 5, {"id": 2, "address": "nope"}, {"id": 3, "address": "h:1", "node": 4},
                 *entries((4, "n", True))])
    assert [b for b in pool.backups] == [4]
    pool.update("garbage")
    assert pool.live_count() == 0
