"""One message, from its decoding to its ack: the path every delivery takes.

* a message that is not an outbox event (:mod:`.decode`) is **rejected** without
  requeue, so the broker's dead-letter policy applies;
* with signatures verified (``verify_signatures``, ``OUTBOX["VERIFY_SIGNATURES"]``),
  a message that is not signed by one of ``OUTBOX["SIGNING_KEYS"]``
  (:mod:`django_outbox.signing`) is **parked** unrun, before anything else is
  believed of it;
* an event of an ordered route goes to :mod:`.ordered`;
* an event whose type is not one of ``event_types`` (when given) is **ignored**:
  acked at once, no handler call, no inbox row;
* any other is **handled** in one transaction with the inbox mark, then **acked**; a
  duplicate is acked at once; a failure is counted (:mod:`.deliveries`).
"""

from __future__ import annotations

import functools
from typing import Any

from ..envelope import ReceivedEvent
from ..exceptions import InvalidMessage
from ..inbox.records import forget_redelivery, process_once
from ..signing import Keyring
from .context import Context, Handler
from .decode import decode, signature_problem
from .deliveries import Deliveries
from .ordered import Ordered
from .outages import DatabaseOutage
from .parking import Parking


class Handling:
    """Handles the messages of one run, one at a time."""

    def __init__(
        self,
        context: Context,
        handler: Handler,
        keys: Keyring | None,
        *,
        deliveries: Deliveries,
        ordered: Ordered,
        parking: Parking,
        outage: DatabaseOutage,
    ) -> None:
        self._context, self._handler, self._keys = context, handler, keys
        self._deliveries, self._ordered = deliveries, ordered
        self._parking, self._outage = parking, outage

    def reject(self, message: Any, exc: Exception) -> None:
        """A message kombu could not even build, or a compressed one: rejected."""
        self._context.stats.received += 1
        self._parking.reject(message, exc)

    def unreadable(self, exc: ValueError) -> None:
        """A virtual transport's item kombu could not even parse as JSON: no message to
        settle (it left the list when read), so it is counted and logged as rejected."""
        self._context.stats.received += 1
        self._parking.dropped(exc)

    def handle(self, message: Any) -> None:
        context = self._context
        context.stats.received += 1
        try:
            event = decode(message)
        except InvalidMessage as exc:
            self._parking.reject(message, exc)
            return
        if self._keys is not None:
            problem = signature_problem(self._keys, message, event)
            if problem is not None:
                self._parking.refuse(message, event, lambda: problem, "inbox.unsigned")
                return
        if event.sequence is not None:
            self._ordered.handle(message, event)
            return
        if not context.handles(event):
            message.ack()
            context.stats.ignored += 1
            return
        self._handle_unordered(message, event)

    def _handle_unordered(self, message: Any, event: ReceivedEvent) -> None:
        counted = bool(message.delivery_info.get("redelivered"))
        if counted and not self._deliveries.count_redelivery(message, event):
            return
        once = functools.partial(self._once, event, counted)
        new = self._deliveries.attempt(message, event, counted, once)
        if new is None:
            return
        message.ack()
        self._outage.settled(message)  # never delivered again
        if new:
            self._context.stats.handled += 1
        else:
            self._context.stats.duplicates += 1

    def _once(self, event: ReceivedEvent, counted: bool) -> bool:
        """Run the handler unless the inbox has the event; whether it ran."""
        consumer, using = self._context.consumer, self._context.using
        with process_once(consumer, event.event_id, using) as new:
            if new:
                self._handler(event)
            if counted:
                forget_redelivery(consumer, event.event_id, using)
        return new
