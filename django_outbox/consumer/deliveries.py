"""Counting a message's deliveries, so a message that keeps failing is parked instead
of looping forever:

* a handler error is a failed delivery, counted in
  :class:`~django_outbox.models.InboxFailure`; the message is kept unacked for a
  backoff delay (doubling, capped, with jitter) while the consumer goes on with other
  messages, then requeued, until ``max_deliveries`` is reached: then it is parked;
* a delivery the broker marks *redelivered* is counted before its handler runs, so a
  message whose handler kills the consumer (SIGKILL, out of memory) is counted too,
  and parked without running once ``max_deliveries`` is reached;
* on a quorum queue the broker's ``x-delivery-count`` of a redelivery is taken into
  the count too (nowhere else: there the header is the publisher's), less the
  consumer's own requeues while the database was down, and not at all for an event
  of an ordered route, whose held-back requeues it counts as well.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from django.db import DatabaseError

from .. import tracing
from ..conf import outbox_settings
from ..conf.redact import describe
from ..envelope import ReceivedEvent
from ..inbox.records import UNACKED_ERROR, record_failure, record_redelivery
from ..state.retry import RetryPolicy
from .context import Context
from .decode import message_key, text
from .held import Held
from .outages import DatabaseOutage
from .parking import Parking

logger = logging.getLogger("django_outbox.consumer")

#: The most of each backoff delay taken off at random (half: with the consumer's
#: defaults five deliveries span 7.5-15 s).
RETRY_JITTER = 0.5
R = TypeVar("R")


def retry_policy(base: float, longest: float, max_deliveries: int | None) -> RetryPolicy:
    """The delays between a failing handler's deliveries (``max_deliveries`` of them)."""
    return RetryPolicy(
        base_delay=base, max_delay=longest, jitter=RETRY_JITTER, max_attempts=max_deliveries or 0
    )


class Deliveries:
    """The deliveries of one run's messages: each handler's attempt, its failures and
    redeliveries counted, a message parked once ``max_deliveries`` is reached."""

    def __init__(
        self,
        context: Context,
        *,
        max_deliveries: int | None,
        retry: RetryPolicy,
        broker_counts: bool,
        span_attributes: Mapping[str, Any],
        held: Held,
        outage: DatabaseOutage,
        parking: Parking,
    ) -> None:
        self._context, self._held, self._outage, self._parking = context, held, outage, parking
        self.max_deliveries, self.retry = max_deliveries, retry
        #: Whether the broker counts deliveries in ``x-delivery-count`` (a quorum queue).
        self._broker_counts = broker_counts
        #: The attributes of every ``process`` span but the queue and the message id.
        self._span_attributes = span_attributes

    def attempt(
        self, message: Any, event: ReceivedEvent, counted: bool, work: Callable[[], R]
    ) -> R | None:
        """``work()``'s result; None when it failed: then the message was held for a
        retry, parked, or (the database down) requeued."""
        try:
            with tracing.processing(self._context.queue, event, self._span_attributes):
                result = work()
        except DatabaseError as exc:
            if self._outage.unusable():
                self._outage.down(message, event, exc)
            else:
                self.failed(message, event, exc, counted)
            return None
        except Exception as exc:
            self.failed(message, event, exc, counted)
            return None
        self._outage.recovered()
        return result

    def count_redelivery(self, message: Any, event: ReceivedEvent) -> bool:
        """Count a redelivered message before its handler runs (its last delivery may
        have killed a consumer). False when it was parked instead, or put back
        because the database is down: then the handler must not run."""
        context = self._context
        try:
            deliveries, parked = record_redelivery(
                context.consumer,
                event,
                queue=context.queue,
                body=text(message),
                broker_deliveries=self.broker_count(message, event),
                park_after=self.max_deliveries,
                using=context.using,
            )
        except DatabaseError as exc:
            self._outage.down(message, event, exc)
            return False
        if parked:
            self._parking.park(message, event, deliveries, f"not run: {UNACKED_ERROR}")
        return not parked

    def failed(self, message: Any, event: ReceivedEvent, exc: Exception, counted: bool) -> None:
        """The handler raised: count the delivery, then hold the message for its backoff
        delay, or park it once ``max_deliveries`` is reached."""
        context = self._context
        error = outbox_settings.redact(describe(exc))  # shown by the admin
        try:
            deliveries, parked = record_failure(
                context.consumer,
                event,
                error=error,
                queue=context.queue,
                body=text(message),
                broker_deliveries=self.broker_count(message, event),
                park_after=self.max_deliveries,
                counted=counted,
                using=context.using,
            )
        except DatabaseError as db_exc:
            self._outage.down(message, event, db_exc)
            return
        if parked:
            self._parking.park(message, event, deliveries, error)
            return
        self._retry_later(message, event, exc, deliveries)

    def _retry_later(
        self, message: Any, event: ReceivedEvent, exc: Exception, deliveries: int
    ) -> None:
        context = self._context
        context.stats.failed += 1
        delay = self.retry.delay(deliveries)
        logger.warning(
            "%s: handler failed on event %s (delivery %d%s); requeued in %.1fs",
            context.consumer,
            event.event_id,
            deliveries,
            f" of {self.max_deliveries}" if self.max_deliveries else "",
            delay,
            exc_info=exc,
            extra={
                "action": "inbox.handler_failed",
                "deliveries": deliveries,
                "delay": delay,
                **context.log_fields(event),
            },
        )
        self._held.hold(message, delay)

    def broker_count(self, message: Any, event: ReceivedEvent) -> int:
        """The broker's count of deliveries so far (a quorum queue's ``x-delivery-count``),
        less the requeues this consumer made while the database was down, which are no
        failed deliveries. 0 for an event of an ordered route: its held-back requeues
        count there too, so it is parked by the inbox's own count alone, which counts
        every redelivery in its key's turn before the handler runs.

        Read only where the broker writes it: on a quorum queue (the route's
        ``queue_type``; the consumer declares its queue with it, so the broker refuses
        a queue of another type), and on a redelivery, since a quorum queue leaves a
        publisher's own header in place on the first delivery. Anywhere else the
        header is the publisher's, and believing it would let anyone who can publish
        park an event after one failure."""
        if (
            event.sequence is not None
            or not self._broker_counts
            or not message.delivery_info.get("redelivered")
        ):
            return 0
        uncounted = self._outage.uncounted.get(message_key(message), 0)
        return max(broker_deliveries(message.headers) - uncounted, 0)


def broker_deliveries(headers: dict[str, Any] | None) -> int:
    """Deliveries so far by the broker's own count (RabbitMQ quorum queues' header
    ``x-delivery-count`` counts earlier deliveries), or 0 where it keeps none."""
    count = (headers or {}).get("x-delivery-count")
    return count + 1 if isinstance(count, int) and not isinstance(count, bool) else 0
