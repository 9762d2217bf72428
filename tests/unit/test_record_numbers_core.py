"""Dense record numbers (kera.broker.streamlet): every record of a slot gets the next number at
append, across the slot's groups, stamped into its chunk; a rebuild from recovered chunks and a
reload from the broker's own disk continue exactly after the last kept record."""

import random

import pytest

from kera.codec import chunk
from kera.broker.rebuild import StreamletRebuild, install
from kera.broker.streamlet import Streamlet
from tests.unit.test_recovery_rebuild import SID, core

SEG = 4096        # small segments and groups, so a slot's records span many groups
G = 2


def appended(seed: int, chunks: int = 120, Q: int = 2):
    """A streamlet after `chunks` appends of 1..40 records by producers 0..3 (slots p % Q)."""
    rng = random.Random(seed)
    sl = Streamlet(SID, 0, active_groups=Q, group_segments=G, segment_size_bytes=SEG)
    seqs = [0] * 4
    for _ in range(chunks):
        p = rng.randrange(4)
        n = rng.randrange(1, 40)
        c = chunk.encode(p, seqs[p], SID, 0, [b"v%d" % i for i in range(n)])
        seqs[p] += 1
        sl.append(c, len(c), n, p)
    return sl


def stored(sl: Streamlet) -> list[bytes]:
    """Every stored chunk (stamped), in group then offset order."""
    out = []
    for g in sl.groups:
        for seg in g.segments:
            out += [bytes(seg.view(i)) for i in range(len(seg))]
    return out


def numbers_by_slot(chunks, Q=2) -> dict[int, list[tuple[int, int]]]:
    """Per slot, (number, count) of each chunk in append order."""
    out: dict[int, list] = {}
    for h in sorted(map(chunk.verify, chunks), key=lambda h: (h.group, h.base_offset)):
        out.setdefault(h.producer_id % Q, []).append((h.number, h.record_count))
    return out


def assert_dense_from_zero(runs):
    expect = 0
    for number, count in runs:
        assert number == expect
        expect += count


@pytest.mark.parametrize("seed", range(5))
def test_each_slot_numbers_its_records_densely_from_zero_across_its_groups(seed):
    sl = appended(seed)
    by_slot = numbers_by_slot(stored(sl))
    assert set(by_slot) == {0, 1} and len(sl.groups) > 4     # several groups per slot
    for slot, runs in by_slot.items():
        assert_dense_from_zero(runs)
        assert sl.next_number(slot) == sum(n for _, n in runs)
    for g in sl.groups:    # a group's numbers are its base plus the record offset
        first = chunk.read_header(g.segments[0].view(0))
        assert first.number == g.number_base and first.base_offset == 0


def rebuilt(chunks, Q=2):
    rb = StreamletRebuild(SID, 0, Q, G, SEG)
    for c in chunks:
        rb.add(memoryview(c), chunk.read_header(c), True)
    b = core(Q=Q, G=G, seg=SEG)
    install(b, rb)
    return b, b.streams[SID].streamlets[0]


@pytest.mark.parametrize("seed", range(3))
def test_a_rebuild_in_any_order_keeps_the_numbers_and_continues_after_them(seed):
    sl = appended(seed)
    chunks = stored(sl)
    random.Random(seed).shuffle(chunks)
    b, got = rebuilt(chunks)
    assert numbers_by_slot(stored(got)) == numbers_by_slot(stored(sl))
    for slot in (0, 1):
        assert got.next_number(slot) == sl.next_number(slot)
    # The next append (to a new group, recovered ones are closed) continues the slot.
    pid = 2       # slot 0
    last = max(h.sequence for h in map(chunk.read_header, chunks) if h.producer_id == pid)
    b.produce("t", [chunk.encode(pid, last + 1, SID, 0, [b"a", b"b", b"c"])], 1.0)
    head = chunk.read_header(got.groups[-1].segments[0].view(0))
    assert head.number == sl.next_number(0) and got.next_number(0) == sl.next_number(0) + 3


def test_a_rebuild_that_cuts_a_slot_at_a_hole_numbers_on_from_the_kept_prefix():
    sl = appended(7)
    chunks = stored(sl)
    slot0 = [c for c in chunks if chunk.read_header(c).producer_id % 2 == 0]
    hole = slot0[len(slot0) // 2]          # never reached a backup
    kept_before = [h for h in map(chunk.read_header, slot0[:len(slot0) // 2])]
    b, got = rebuilt([c for c in chunks if c is not hole])
    runs = numbers_by_slot(stored(got))
    assert_dense_from_zero(runs[0])
    assert got.next_number(0) == sum(h.record_count for h in kept_before)
    assert got.next_number(1) == sl.next_number(1)      # the other slot is whole


def test_written_before_numbers_a_slot_starts_numbering_at_zero():
    """Chunks with no room for a number (versions 1 and 2) rebuild without one."""
    sl = appended(3, chunks=10, Q=1)
    legacy = []
    for c in stored(sl):
        out = bytearray(c[:chunk.HEADER_SIZE_V1]) + c[chunk.HEADER_SIZE:]
        out[2] = chunk.VERSION
        out[4:8] = chunk.header_crc(out).to_bytes(4, "little")
        legacy.append(bytes(out))
    _, got = rebuilt(legacy, Q=1)
    assert all(g.number_base is None for g in got.groups)
    assert got.next_number(0) == 0


def test_the_cursor_at_a_number_is_in_the_group_holding_it_or_at_the_end():
    sl = appended(11, Q=1)
    for g in sl.groups:
        for number in (g.number_base, g.number_base + g.head - 1):
            assert sl.cursor_at_number(number) == (g.id, {g.id: number - g.number_base})
    last = sl.groups[-1]
    end = last.number_base + last.head
    assert sl.cursor_at_number(end) == sl.cursor_at_number(end + 10**6) == (last.id, {last.id: last.head})
    empty = Streamlet(SID, 0, active_groups=1, group_segments=G, segment_size_bytes=SEG)
    assert empty.cursor_at_number(5) == (0, {})
