"""consumer.batch.Batch's numpy columns of a fetched chunk, whole and from a skipped record on
(a consumer that resumes inside a chunk), and the chunk's timestamps made on first use."""

import numpy as np
import pytest

from kera.codec import chunk
from kera.consumer.batch import Batch

VALUES = [b"a", b"", b"bcd", b"ef", b"ghij"]
TIMESTAMPS = [10, 11, 12, 13, 14]


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("skip", range(len(VALUES)))
def test_columns_from_the_first_undelivered_record(skip, compression):
    c = chunk.Chunk(chunk.encode(1, 0, 1, 0, VALUES, timestamps=TIMESTAMPS,
                                 compression=compression))
    b = Batch("s", 0, 0, 100 + skip, c, skip)
    offsets = b.value_offsets.astype(np.int64).tolist()
    blob = bytes(b.values_blob)
    assert offsets[0] == 0 and len(offsets) == len(VALUES) - skip + 1
    assert [blob[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)] == VALUES[skip:]
    assert blob == b"".join(VALUES[skip:])
    assert b.timestamps.tolist() == TIMESTAMPS[skip:]


def test_timestamps_are_a_view_of_the_chunk_made_once():
    buf = bytearray(chunk.encode(1, 0, 1, 0, VALUES, timestamps=TIMESTAMPS))
    c = chunk.Chunk(memoryview(buf))
    ts = c.timestamps
    assert ts is c.timestamps and ts.tolist() == TIMESTAMPS
    buf[c.header.header_size] = 99   # the first timestamp's low byte, in the chunk itself
    assert ts[0] == 99
