"""RetryPolicy's formula, as a unit: no database, no broker, no clock."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.test.utils import override_settings

from django_outbox.state.retry import RetryPolicy


def policy(*, base: float = 1, cap: float = 60, jitter: float = 0, attempts: int = 10):
    return RetryPolicy(base_delay=base, max_delay=cap, jitter=jitter, max_attempts=attempts)


def test_without_jitter_the_delay_doubles_per_attempt_up_to_the_cap():
    delays = [policy(base=1, cap=60).delay(n) for n in range(1, 10)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert [policy(base=0.25, cap=3600).delay(n) for n in (1, 2, 3)] == [0.25, 0.5, 1]


def test_before_any_failure_and_far_past_the_cap_the_delay_stays_in_bounds():
    assert policy(base=2).delay(0) == 2  # no attempt made yet: the base, not half of it
    assert policy(base=2, cap=3600).delay(10_000) == 3600  # no overflow past 2**64


@pytest.mark.parametrize("attempts", [1, 3, 12])
def test_jitter_takes_at_most_its_fraction_off_the_ceiling_and_spreads_the_delays(attempts):
    base, cap, jitter = 1.0, 1000.0, 0.2
    ceiling = min(cap, base * 2 ** (attempts - 1))
    delays = [policy(base=base, cap=cap, jitter=jitter).delay(attempts) for _ in range(2000)]
    low, high = ceiling * (1 - jitter), ceiling
    assert all(low <= delay <= high for delay in delays)
    # Spread over the band, not stuck at one value: the draws cover most of it, and
    # they fall on both sides of its middle (2000 uniform draws; missing a side or
    # three quarters of the band is below 1e-100 likely).
    assert max(delays) - min(delays) > 0.75 * (high - low)
    middle = (low + high) / 2
    assert any(d < middle for d in delays) and any(d > middle for d in delays)
    assert len(set(delays)) > 1900


def test_full_jitter_may_take_the_whole_delay_but_never_more():
    delays = [policy(base=4, jitter=1).delay(1) for _ in range(500)]
    assert all(0 <= delay <= 4 for delay in delays)
    assert min(delays) < 1  # the band reaches down towards 0


def test_exhausted_once_attempts_reach_max_attempts():
    five = policy(attempts=5)
    assert [five.exhausted(n) for n in range(0, 8)] == [False] * 5 + [True] * 3
    assert policy(attempts=1).exhausted(1)


def test_from_settings_reads_the_outbox_knobs():
    knobs = {"RETRY_BASE_DELAY": 0.5, "RETRY_MAX_DELAY": 30, "RETRY_JITTER": 0.1, "MAX_ATTEMPTS": 4}
    with override_settings(OUTBOX={**settings.OUTBOX, **knobs}):
        assert RetryPolicy.from_settings() == policy(base=0.5, cap=30, jitter=0.1, attempts=4)


def test_with_the_defaults_a_row_failing_every_time_is_abandoned_7_to_9_minutes_later():
    """The runbook's figure: MAX_ATTEMPTS 10, RETRY_BASE_DELAY 1 s, RETRY_JITTER 0.2."""
    defaults = RetryPolicy.from_settings()
    assert defaults == policy(base=1, cap=3600, jitter=0.2, attempts=10)
    waits = [defaults.delay(n) for n in range(1, 10)]  # after failures 1-9; the 10th abandons
    assert [defaults.exhausted(n) for n in range(1, 11)] == [False] * 9 + [True]
    assert 0.8 * 511 <= sum(waits) <= 511  # 1 + 2 + ... + 256 s, less up to 20 %
    assert 6.5 * 60 < sum(waits) < 9 * 60
