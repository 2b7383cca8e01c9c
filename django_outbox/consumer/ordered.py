"""Events of an ordered route (they carry a ``sequence``), each run only in its key's
turn (:func:`~django_outbox.inbox.records.process_in_order`):

* one already handled (its event id in the inbox) is acked;
* one whose predecessor is not handled yet is **held back**: requeued once that one is
  handled here, or after a backoff; not a failed delivery;
* a skip marker moves its key on without the handler;
* another event claiming a handled sequence (or a handled one claiming another) is
  **parked** as a conflict (see docs/ordered-consumption.md).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from django.db import DatabaseError

from ..envelope import ReceivedEvent
from ..exceptions import InvalidMessage
from ..inbox.records import (
    Scope,
    Turn,
    conflict_reason,
    forget_redelivery,
    peek_turn,
    process_in_order,
    sequence_scope,
)
from .context import Context, Handler
from .deliveries import Deliveries
from .held import Held
from .parking import Parking

logger = logging.getLogger("django_outbox.consumer")

#: The shortest wait before an event held back for its key's earlier event is requeued.
EARLY_MIN_DELAY = 0.1
#: An event held back this many times (and each further multiple) is logged at WARNING.
EARLY_WARN_EVERY = 10


class Ordered:
    """The ordered events of one run. ``early`` counts, per event id, the times an
    event was held back for its key (shared with :class:`~.parking.Parking`, which
    forgets an event it refuses)."""

    def __init__(
        self,
        context: Context,
        handler: Handler,
        *,
        early: dict[Any, int],
        held: Held,
        deliveries: Deliveries,
        parking: Parking,
    ) -> None:
        self._context, self._handler, self._early = context, handler, early
        self._held, self._deliveries, self._parking = held, deliveries, parking

    def handle(self, message: Any, event: ReceivedEvent) -> None:
        """An event with a sequence: run in its key's turn, acked if handled already,
        held back while an earlier event of its key is not handled yet."""
        redelivered = bool(message.delivery_info.get("redelivered"))
        try:
            scope = sequence_scope(self._context.consumer, event)
            # A redelivery is counted before its handler runs, unless it is early or a
            # duplicate (no failure of its own): a look without the lock tells. A first
            # delivery goes straight to the locked check.
            turn = Turn.DUE
            if redelivered:
                turn = peek_turn(self._context.consumer, event, self._context.using)
        except InvalidMessage as exc:
            self._parking.reject(message, exc)
            return
        except DatabaseError as exc:
            self._deliveries.database_failed(message, event, exc, counted=False)
            return
        counted = redelivered and turn is Turn.DUE
        if counted and not self._deliveries.count_redelivery(message, event):
            return
        if turn is Turn.DUE:
            settled = self._deliveries.attempt(
                message, event, counted, functools.partial(self._in_turn, event, counted)
            )
            if settled is None:
                return
            turn = settled
        self._settle(message, event, scope, turn)

    def _in_turn(self, event: ReceivedEvent, counted: bool) -> Turn:
        """Under the key's lock: run the handler if the event is (still) due."""
        consumer, using = self._context.consumer, self._context.using
        with process_in_order(consumer, event, using) as turn:
            if turn is Turn.DUE:
                self._run_due(event)
                if counted:
                    forget_redelivery(consumer, event.event_id, using)
        return turn

    def _run_due(self, event: ReceivedEvent) -> None:
        """The handler, unless the event is a skip marker or of a type it does not
        handle: then the key just moves past its sequence."""
        if event.skipped:
            logger.warning(
                "%s: event %s (sequence %d of key %r) was skipped by an operator; "
                "the key moves past it without the handler",
                self._context.consumer,
                event.event_id,
                event.sequence,
                event.ordering_key,
                extra={
                    "action": "inbox.skip_marker",
                    "sequence": event.sequence,
                    **self._context.log_fields(event),
                },
            )
        elif self._context.handles(event):
            self._handler(event)

    def _settle(self, message: Any, event: ReceivedEvent, scope: Scope, turn: Turn) -> None:
        context = self._context
        if turn is Turn.EARLY:
            self._hold_back(message, event, scope)
            return
        if turn is Turn.CONFLICT:
            reason = functools.partial(conflict_reason, context.consumer, event, context.using)
            self._parking.refuse(message, event, reason, "inbox.conflict")
            return
        message.ack()
        self._early.pop(event.event_id, None)
        if turn is Turn.DUPLICATE:
            context.stats.duplicates += 1
            return
        if event.skipped or (context.event_types and event.event_type not in context.event_types):
            context.stats.ignored += 1
        else:
            context.stats.handled += 1
        self._held.release(scope)  # its successors, held back, may be due now

    def _hold_back(self, message: Any, event: ReceivedEvent, scope: Scope) -> None:
        """Keep an event whose predecessor is not handled yet unacked for a while, then
        requeue it: at once when this consumer handles its predecessor, else after a
        backoff that doubles each time it comes back early. Not a failed delivery."""
        self._context.stats.held += 1
        times = self._early[event.event_id] = self._early.get(event.event_id, 0) + 1
        delay = max(self._deliveries.retry.delay(times), EARLY_MIN_DELAY)
        # Every tenth time at WARNING: a key that waits this long needs a look.
        logger.log(
            logging.WARNING if times % EARLY_WARN_EVERY == 0 else logging.DEBUG,
            "%s: event %s (sequence %d of key %r) held back for %.1fs (time %d): an earlier "
            "event of its key is not handled yet (failing, parked, or not delivered here)",
            self._context.consumer,
            event.event_id,
            event.sequence,
            event.ordering_key,
            delay,
            times,
            extra={
                "action": "inbox.held_back",
                "sequence": event.sequence,
                "delay": delay,
                "times": times,
                **self._context.log_fields(event),
            },
        )
        self._held.hold(message, delay, scope)
