"""The messages a consumer lets go without running its handler, rejected without
requeue (so the broker's dead-letter policy applies):

* **parked** after ``max_deliveries`` failed deliveries (:meth:`Parking.park`), or
  unrun (:meth:`Parking.refuse`: a sequence conflict, a missing or wrong signature),
  body and headers kept in an :class:`~django_outbox.models.InboxFailure` row for
  ``outbox_replay_parked``;
* **rejected** when it is not an outbox event at all (:meth:`Parking.reject`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError

from ..conf.redact import describe
from ..envelope import ReceivedEvent
from ..inbox.records import park_refused
from .context import Context
from .decode import text
from .outages import DatabaseOutage

logger = logging.getLogger("django_outbox.consumer")


class Parking:
    """Parks and rejects the messages of one run. ``early`` is the ordered events'
    count of times held back (see :mod:`.ordered`), forgotten for an event refused."""

    def __init__(self, context: Context, outage: DatabaseOutage, early: dict[Any, int]) -> None:
        self._context, self._outage, self._early = context, outage, early

    def park(self, message: Any, event: ReceivedEvent, deliveries: int, error: str) -> None:
        """Reject ``message``, which the inbox parked after ``deliveries`` (its row is
        written): ``error`` is the last delivery's."""
        context = self._context
        context.stats.parked += 1
        logger.error(
            "%s: event %s failed %d deliveries and is parked (%s); see InboxFailure in the admin",
            context.consumer,
            event.event_id,
            deliveries,
            error,
            extra={"action": "inbox.parked", "deliveries": deliveries, **context.log_fields(event)},
        )
        message.reject(requeue=False)
        self._outage.settled(message)

    def refuse(
        self, message: Any, event: ReceivedEvent, reason: Callable[[], str], action: str
    ) -> None:
        """Park ``message`` without running the handler, for the one-line ``reason()``
        (a sequence conflict, a missing or wrong signature), and reject it."""
        context = self._context
        try:
            error = reason()
            park_refused(
                context.consumer,
                event,
                error=error,
                queue=context.queue,
                body=text(message),
                using=context.using,
            )
        except DatabaseError as exc:
            self._outage.down(message, event, exc)
            return
        context.stats.parked += 1
        self._early.pop(event.event_id, None)
        logger.error(
            "%s: event %s from %s is parked unrun: %s; see InboxFailure in the admin",
            context.consumer,
            event.event_id,
            context.queue,
            error,
            extra={"action": action, **context.log_fields(event)},
        )
        message.reject(requeue=False)
        self._outage.settled(message)

    def reject(self, message: Any, exc: Exception) -> None:
        """Reject ``message``, which is not an outbox event (``exc`` says why)."""
        context = self._context
        context.stats.rejected += 1
        logger.error(
            "rejected a message from %s that is not an outbox event (%s: %s); "
            "the broker's dead-letter policy applies",
            context.queue,
            type(exc).__name__,
            exc,
            extra={
                "action": "inbox.rejected",
                "queue": context.queue,
                "message_id": message.properties.get("message_id"),
                "content_type": message.content_type,
            },
        )
        message.reject(requeue=False)

    def dropped(self, exc: ValueError) -> None:
        """An item of a virtual transport's queue that is not JSON at all, which kombu
        took off the list before failing to parse it: counted and logged as rejected."""
        context = self._context
        context.stats.rejected += 1
        logger.error(
            "rejected a message from %s that is not even JSON (%s); it is not kept: the "
            "transport had taken it off the queue",
            context.queue,
            describe(exc),
            extra={"action": "inbox.rejected", "queue": context.queue},
        )
