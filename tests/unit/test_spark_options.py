"""The connector's sink sizes: a write task's buffer holds at least one chunk, and a chunk has
room for the producer's header and records; refused while parsing, with the option names."""

import pytest

from kera.spark.options import CHUNK_SIZE_BYTES_MIN, Options


def test_chunk_larger_than_the_buffer_is_refused_naming_both_options():
    with pytest.raises(ValueError, match="'chunkSizeBytes'=65536 exceeds option 'bufferBytes'=4096"):
        Options.parse({"bootstrap": "h:1", "chunkSizeBytes": "65536", "bufferBytes": "4096"})
    opts = Options.parse({"bootstrap": "h:1", "chunkSizeBytes": "4096", "bufferBytes": "4096"})
    assert (opts.chunk_size_bytes, opts.buffer_bytes) == (4096, 4096)


def test_chunk_too_small_for_the_producer_is_refused():
    with pytest.raises(ValueError, match="chunkSizeBytes"):
        Options.parse({"bootstrap": "h:1", "chunkSizeBytes": str(CHUNK_SIZE_BYTES_MIN - 1)})
    assert Options.parse({"bootstrap": "h:1", "chunkSizeBytes": str(CHUNK_SIZE_BYTES_MIN)})
