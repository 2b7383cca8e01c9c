"""What every part of a consumer's run shares: its totals (:class:`ConsumerStats`) and
who consumes where (:class:`Context`: the consumer's name, its database, the event
types it handles, the queue of the message in hand).

Every module of the consumer logs to ``logging.getLogger("django_outbox.consumer")``
(the runbook names it); the filter that keeps drivers' texts and tracebacks free of
passwords is added to that logger here, once.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from ..conf import outbox_settings
from ..conf.redact import SecretFilter
from ..envelope import ReceivedEvent
from ..inbox.records import handles

logger = logging.getLogger("django_outbox.consumer")
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

#: What a consumer runs for each event.
Handler = Callable[[ReceivedEvent], object]


@dataclasses.dataclass
class ConsumerStats:
    """What a consumer did with the messages it received."""

    received: int = 0
    handled: int = 0  # the handler ran and its transaction committed
    duplicates: int = 0  # already in the inbox: acked, handler not run
    ignored: int = 0  # an event type the handler does not handle: acked, handler not run
    failed: int = 0  # the handler raised: requeued after a backoff delay
    held: int = 0  # ordered, an earlier event of its key not handled yet: requeued later
    parked: int = 0  # failed max_deliveries times: kept in InboxFailure, rejected
    rejected: int = 0  # not decodable as an outbox event: rejected
    elapsed: float = 0.0  # seconds the consumer ran
    busy: float = 0.0  # seconds from the first message received to the last one settled

    def summary(self) -> str:
        rate = self.received / self.busy if self.busy else 0.0
        return (
            f"received {self.received}: handled {self.handled}, duplicates {self.duplicates}, "
            f"ignored {self.ignored}, failed {self.failed}, parked {self.parked}, "
            f"rejected {self.rejected}{f', held back {self.held}' if self.held else ''} "
            f"in {self.elapsed:.1f}s ({rate:.0f} messages/s while busy)"
        )


@dataclasses.dataclass
class Context:
    """Who consumes where, for one run: what each part of it records and logs with."""

    consumer: str
    using: str
    #: The event types the handler handles; None: all.
    event_types: frozenset[str] | None
    #: The consumer's totals (kept by the consumer across its runs).
    stats: ConsumerStats
    #: The queue of the message in hand.
    queue: str

    def log_fields(self, event: ReceivedEvent) -> dict[str, str]:
        return {"queue": self.queue, "consumer": self.consumer, "event_id": str(event.event_id)}

    def handles(self, event: ReceivedEvent) -> bool:
        """Whether the handler handles ``event``'s type (logged at DEBUG when not)."""
        return self.event_types is None or handles(
            self.consumer, self.event_types, event.event_type, event.event_id
        )
