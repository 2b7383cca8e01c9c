"""Riding out a broker or database that went away: one :class:`OutageTracker` per
resource logs once when an outage starts and once when it ends, and spaces out
reconnection attempts. Used by the relay (a tracker per broker and one for the
database) and by the consumer."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from ..conf import outbox_settings
from ..conf.redact import SecretFilter
from ..exceptions import BrokerRefusesWrites

logger = logging.getLogger("django_outbox.outage")
# The drivers' error texts are logged: no password may come with them.
logger.addFilter(SecretFilter(outbox_settings.redact))

#: Longest sleep between attempts to reach a broker or database that is down.
MAX_OUTAGE_BACKOFF = 30.0
#: Each backoff is shortened by up to this fraction at random, so that relays and
#: consumers that lost the same server do not all come back at once.
OUTAGE_JITTER = 0.2


class OutageTracker:
    """One resource's outages (a broker, or a database alias).

    :meth:`failed` logs the start of an outage once (``outbox.<resource>_down``),
    :meth:`recovered` its end once (``outbox.<resource>_up``, with how long it
    lasted), and :meth:`backoff` gives the seconds to wait before the next attempt:
    1, 2, 4 ... 30, each shortened at random by up to ``OUTAGE_JITTER``.
    :meth:`downtime` adds up the seconds without the resource over several
    outages, until :meth:`forget_downtime`.
    """

    def __init__(
        self,
        resource: str,
        what: str,
        *,
        extra: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[float, float], float] = random.uniform,
    ) -> None:
        self.resource = resource  # "broker", "database": the log actions' names
        self.what = what  # how the log lines name it: "broker", "database 'default'"
        self.extra = extra or {}
        self.down = False
        self._clock = clock
        self._jitter = jitter
        self._since = 0.0  # when the current outage began
        self._failures = 0  # backoffs taken in the current outage
        self._logged = False  # its start was logged
        self._ended = 0.0  # seconds of the outages that ended since forget_downtime()
        #: What the outage logged is: "unreachable", or the condition of a broker that
        #: refuses writes ("out of memory", "read-only", "unable to persist").
        self.condition = "unreachable"

    def suspect(self, since: float | None = None) -> None:
        """The resource may be down (e.g. a publish failed): an outage begins at
        ``since`` (default: now), not logged until :meth:`failed` confirms it."""
        if not self.down:
            self.down, self._failures, self._logged = True, 0, False
            self._since = self._clock() if since is None else since
            self.condition = "unreachable"  # until failed() says otherwise

    def failed(self, exc: BaseException, *, since: float | None = None) -> None:
        """Reaching the resource failed with ``exc``; logs the outage's start once: the
        resource is "unreachable", or the condition of a broker that refuses every write
        (:class:`BrokerRefusesWrites`, or an error caused by one)."""
        self.suspect(since)
        if not self._logged:
            self._logged = True
            refusing = exc if isinstance(exc, BrokerRefusesWrites) else exc.__cause__
            self.condition = (
                refusing.condition if isinstance(refusing, BrokerRefusesWrites) else "unreachable"
            )
            logger.warning(
                "%s %s (%s); retrying with backoff",
                self.what,
                self.condition,
                exc,
                extra={
                    "action": f"outbox.{self.resource}_down",
                    "condition": self.condition,
                    **self.extra,
                },
            )

    def recovered(self) -> None:
        """The resource answered; logs the end of an outage that was logged."""
        if not self.down:
            return
        lasted = self._clock() - self._since
        self._ended += lasted
        if self._logged:
            logger.warning(
                "%s reachable again after %.1fs",
                self.what,
                lasted,
                extra={"action": f"outbox.{self.resource}_up", **self.extra},
            )
        self.down, self._failures, self._logged = False, 0, False

    def backoff(self) -> float:
        """Seconds to wait before the next attempt: 1, 2, 4 ... ``MAX_OUTAGE_BACKOFF``."""
        self._failures += 1
        longest = min(MAX_OUTAGE_BACKOFF, 2 ** (self._failures - 1))
        return longest * self._jitter(1 - OUTAGE_JITTER, 1.0)

    def downtime(self) -> float:
        """Seconds without the resource since :meth:`forget_downtime`, the current
        outage included."""
        return self._ended + (self._clock() - self._since if self.down else 0.0)

    def lasted(self) -> float | None:
        """Seconds the outage under way has lasted; None when the resource is up."""
        return self._clock() - self._since if self.down else None

    def forget_downtime(self) -> None:
        """Count :meth:`downtime` afresh from here (the outage under way, if any,
        counts from its start still)."""
        self._ended = 0.0


def broker_outage(alias: str | None = None, **options: Any) -> OutageTracker:
    """The tracker of a broker's outages; one of ``OUTBOX["BROKERS"]`` other than
    "default" is named by its ``alias`` in the log lines."""
    if alias is None or alias == "default":
        return OutageTracker("broker", "broker", **options)
    return OutageTracker("broker", f"broker {alias!r}", extra={"broker": alias}, **options)


def database_outage(using: str, **options: Any) -> OutageTracker:
    """The tracker of database ``using``'s outages."""
    return OutageTracker("database", f"database {using!r}", extra={"using": using}, **options)


def queue_outage(destination: str, **options: Any) -> OutageTracker:
    """The tracker of a destination whose queue stopped confirming while its broker
    answered (``outbox.queue_down`` / ``outbox.queue_up``)."""
    return OutageTracker(
        "queue",
        f"queue of destination {destination!r}",
        extra={"destination": destination},
        **options,
    )
