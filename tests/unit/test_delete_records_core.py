"""DeleteRecords on the broker's core (kera.broker.kafka.records, Retention.delete_below):
whole groups below the offset go, the partition's open group is closed to go too, a slot's
last group waits for its floor and goes at the next retention pass, and the partition's start (Kafka's log start offset) is the
real one after, also once every group is gone. Sans-IO: a Broker driven directly."""

from types import SimpleNamespace

from kera.broker.kafka import records
from tests.unit.test_retention_core import acknowledge_floors, broker, desc, fill


def _start_after(b, offset):
    ctx = SimpleNamespace(core=b)
    stream = b.streams[1]
    return records._delete(ctx, stream, 0, offset)


def test_whole_groups_below_the_offset_go_and_the_start_is_the_next_groups_first():
    b = broker(desc())                          # 4 KiB one-segment groups: 16 records each
    fill(b, 16)                                 # records 0..63
    assert b.reads.number_span(1, 0) == (0, 64)
    low, code = _start_after(b, 40)             # groups 0..15 and 16..31 are wholly below 40
    assert (low, code) == (32, 0)
    assert b.reads.number_span(1, 0) == (32, 64) and b.reads.first_group(1, 0) == 2
    assert _start_after(b, 10) == (32, 0), "an offset below the start changes nothing"


def test_to_the_end_the_open_group_closes_and_goes_once_its_floor_is_kept():
    b = broker(desc(G=8, seg=64 * 1024))        # one big group: all records in the open one
    fill(b, 3)                                  # records 0..11
    assert _start_after(b, -1) == (0, 0), "the slot's last group waits for its floor"
    b.enforce_retention(0)
    assert b.reads.number_span(1, 0) == (0, 12), "still waiting: the floor is not acknowledged"
    acknowledge_floors(b)
    b.enforce_retention(0)                      # the next retention pass deletes it
    assert b.reads.number_span(1, 0) == (12, 12), "an emptied partition starts at its next number"
    assert b.retention.delete_marks == {}
    assert _start_after(b, -1) == (12, 0)
    fill(b, 1, start=3)
    assert b.reads.number_span(1, 0) == (12, 16)


def test_past_the_high_watermark_is_out_of_range():
    b = broker(desc())
    fill(b, 2)
    low, code = _start_after(b, 9)
    assert (low, code) == (0, 1)                # OFFSET_OUT_OF_RANGE
