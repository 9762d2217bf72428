"""Virtual-segment ids: a broker incarnation's epoch in the high 32 bits, the segment's
sequence in that incarnation below, so the replicas of each incarnation are told apart on
every backup and a recovery reads exactly one incarnation's segments."""

EPOCH_SHIFT = 32
SEQUENCE_MASK = (1 << EPOCH_SHIFT) - 1


def vseg_id(epoch: int, sequence: int) -> int:
    return epoch << EPOCH_SHIFT | sequence


def epoch_of(vseg: int) -> int:
    return vseg >> EPOCH_SHIFT


def sequence_of(vseg: int) -> int:
    return vseg & SEQUENCE_MASK
