"""Riding out an outage of the consumer's database: the message in hand goes back to
its queue without counting a failed delivery, and the consumer waits (the database's
:class:`~django_outbox.workers.outage.OutageTracker` backoff) before taking the next,
so an outage parks nothing.

On a quorum queue the broker counts those requeues in ``x-delivery-count`` too; the
consumer remembers its own (:attr:`DatabaseOutage.uncounted`) and leaves them out of
the count (see :meth:`~.deliveries.Deliveries.broker_count`).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

from django.db import connections

from ..envelope import ReceivedEvent
from ..workers.outage import database_outage
from .decode import message_key

#: The most messages whose requeues during a database outage are remembered.
MAX_UNCOUNTED = 100_000


class DatabaseOutage:
    """The outages of database ``using`` during one run, and the requeues they made."""

    def __init__(self, using: str, stop: threading.Event) -> None:
        self._using, self._stop = using, stop
        self._tracker = database_outage(using)
        #: message key -> requeues this run made while the database was down.
        self.uncounted: collections.Counter[Any] = collections.Counter()

    def unusable(self) -> bool:
        """Whether the database connection is gone (not merely the statement failing)."""
        connection = connections[self._using]
        return connection.connection is None or not connection.is_usable()

    def down(self, message: Any, event: ReceivedEvent, exc: Exception) -> None:
        """The database is gone: the message goes back uncounted, and the consumer
        waits before taking the next one. (An ordered event's broker count is never
        read: see :meth:`~.deliveries.Deliveries.broker_count`.)"""
        message.requeue()
        if event.sequence is None:
            if len(self.uncounted) >= MAX_UNCOUNTED:
                self.uncounted.clear()  # an outage this long: the broker's count may park early
            self.uncounted[message_key(message)] += 1
        self._tracker.failed(exc)
        connections[self._using].close()
        self._stop.wait(self._tracker.backoff())

    def recovered(self) -> None:
        """A handler's transaction went through: an outage, if any, ended."""
        self._tracker.recovered()

    def settled(self, message: Any) -> None:
        """``message`` was acked or rejected: never delivered again, its requeues forgotten."""
        self.uncounted.pop(message_key(message), None)
