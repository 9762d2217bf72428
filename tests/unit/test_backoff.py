"""kera.net.backoff, the one retry wait: doubling from the first wait up to the cap, and each
retry loop that uses it waits exactly what its own formula waited before it was merged."""

import pytest

from kera.consumer import fetching
from kera.net.backoff import Backoff
from kera.producer import pipeline
from kera.producer import transaction as txns
from kera.services.deliver import core as deliver
from kera.spark import metadata as spark_metadata


def test_waits_double_from_the_first_up_to_the_cap():
    b = Backoff(first_ms=5, max_ms=1000)
    assert [b.delay_ms(n) for n in range(1, 11)] == [5, 10, 20, 40, 80, 160, 320, 640, 1000, 1000]
    assert b.delay_ms(0) == b.delay_ms(-3) == 5          # no attempt yet counts as the first
    assert b.delay_ms(10 ** 9) == 1000                   # any attempt number: capped, no overflow
    assert b.delay_s(3) == 0.02


@pytest.mark.parametrize("first_ms, max_ms", [(0, 10), (-1, 10), (20, 10)])
def test_a_policy_that_never_waits_or_shrinks_is_refused(first_ms, max_ms):
    with pytest.raises(ValueError):
        Backoff(first_ms, max_ms)


def test_the_retry_loops_wait_what_their_own_formulas_did():
    for n in range(0, 40):
        # The producer's chunk retries and the consumer's read retries: 5 ms << n, capped at 1 s.
        old = min(1000, 5 << min(n, 10)) / 1000
        assert pipeline.RETRY_BACKOFF.delay_s(n + 1) == old
        assert fetching.RETRY_BACKOFF.delay_s(n + 1) == old
        # The Spark connector's metadata calls: 50 ms doubling to 1 s.
        assert spark_metadata._pause(n) == min(1.0, 0.05 * 2 ** min(n, 10))
    for n in range(1, 40):
        assert txns.retry_backoff_s(n) == min(500, txns.RETRY_BACKOFF_MS_FIRST << min(n - 1, 16)) / 1000
        assert deliver.BACKOFF.delay_s(n) == min(5000, 100 * 2 ** min(n - 1, 16)) / 1000

