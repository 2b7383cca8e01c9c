"""When a failed row is tried again."""

from __future__ import annotations

import dataclasses
import random

from ..conf import outbox_settings


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, capped, and a limit on attempts.

    After the ``n``-th failed attempt (``n`` = attempts made so far, 1-based)
    the row is due again in::

        delay = min(max_delay, base_delay * 2 ** (n - 1)) * (1 - jitter * random())

    so the first retry waits about ``base_delay``, and ``jitter`` (0-1) spreads
    rows that failed together so that they do not retry in step. The row is
    abandoned once ``n`` reaches ``max_attempts``.
    """

    base_delay: float
    max_delay: float
    jitter: float
    max_attempts: int

    @classmethod
    def from_settings(cls) -> RetryPolicy:
        return cls(
            base_delay=outbox_settings.RETRY_BASE_DELAY,
            max_delay=outbox_settings.RETRY_MAX_DELAY,
            jitter=outbox_settings.RETRY_JITTER,
            max_attempts=outbox_settings.MAX_ATTEMPTS,
        )

    def exhausted(self, attempts: int) -> bool:
        """Whether a row that has now failed ``attempts`` times is abandoned."""
        return attempts >= self.max_attempts

    def delay(self, attempts: int) -> float:
        """Seconds until the next try of a row that has now failed ``attempts`` times."""
        exponent = min(max(attempts - 1, 0), 64)  # 2**64 * base is past any cap
        ceiling = min(self.max_delay, self.base_delay * 2**exponent)
        return ceiling * (1 - self.jitter * random.random())
