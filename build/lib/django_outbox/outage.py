"""Riding out a broker or database that went away: log once when an outage starts
and once when it ends, and space out reconnection attempts. Shared by the relay
and the consumer."""

from __future__ import annotations

import logging
import random
import time

from .conf import outbox_settings
from .redact import SecretFilter

logger = logging.getLogger(__name__)
# The drivers' error texts are logged: no password may come with them.
logger.addFilter(SecretFilter(outbox_settings.redact))

#: Longest sleep between attempts to reach a broker or database that is down.
MAX_OUTAGE_BACKOFF = 30.0


class Outage:
    """Tracks broker and database outages: logs once when one starts and once when
    it ends, and spaces out reconnection attempts (1, 2, 4 ... 30 s)."""

    def __init__(self) -> None:
        self.broker_down = False
        self.database_down = False
        self.since = 0.0
        self.failures = 0

    def backoff(self) -> float:
        self.failures += 1
        return min(MAX_OUTAGE_BACKOFF, 2 ** (self.failures - 1)) * random.uniform(0.8, 1.0)

    def broker_suspect(self) -> None:
        if not self.broker_down:
            self.broker_down, self.since, self.failures = True, time.monotonic(), 0

    def broker_failed(self, exc: BaseException) -> None:
        if self.failures == 0:
            logger.warning(
                "broker unreachable (%s); retrying with backoff",
                exc,
                extra={"action": "outbox.broker_down"},
            )

    def broker_recovered(self) -> None:
        if self.failures:
            logger.warning(
                "broker reachable again after %.1fs",
                time.monotonic() - self.since,
                extra={"action": "outbox.broker_up"},
            )
        self.broker_down, self.failures = False, 0

    def database_failed(self, using: str, exc: BaseException) -> None:
        if not self.database_down:
            self.database_down, self.since, self.failures = True, time.monotonic(), 0
            logger.warning(
                "database %r unreachable (%s); retrying with backoff",
                using,
                exc,
                extra={"action": "outbox.database_down", "using": using},
            )

    def database_recovered(self, using: str) -> None:
        """Log the end of a database outage, if one is under way."""
        if not self.database_down:
            return
        logger.warning(
            "database %r reachable again after %.1fs",
            using,
            time.monotonic() - self.since,
            extra={"action": "outbox.database_up", "using": using},
        )
        self.database_down, self.failures = False, 0
