"""What a relay's batch did: its stats (:class:`BatchStats`, :class:`RunStats`), its log
records (a few per destination and fate, never one per row) and its signals.

Its records come from the logger ``django_outbox.relay``, the name the runbook documents.
It imports no other relay module: the batch's work (:mod:`django_outbox.relay.batch`)
hands it what a finalize wrote (:class:`Finalized`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from ..conf import outbox_settings
from ..conf.redact import SecretFilter
from ..envelope import ClaimedMessage
from ..models import OutboxMessage
from ..signals import event_abandoned, event_failed, event_published
from ..state.retry import RetryPolicy
from ..transports.base import Failure
from .failures import FailureCounts, Reason

logger = logging.getLogger("django_outbox.relay")  # the name the runbook documents
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

#: Error texts a batch logs one record each for, per destination and fate (those with
#: most rows); the rows of its other error texts share one more record.
MAX_LOGGED_REASONS = 3
#: The counts of :class:`BatchStats`, which add up over a run.
COUNTED = ("claimed", "published", "failed", "abandoned", "lost", "held")


@dataclasses.dataclass
class BatchStats:
    """What one batch did."""

    claimed: int = 0
    published: int = 0
    failed: int = 0
    abandoned: int = 0
    lost: int = 0  # rows whose lease another relay had taken over: left untouched
    #: Rows of an ordered key put back behind an earlier row of their key that failed
    #: in the same batch: pending again, no attempt counted (see docs/ordering.md).
    held: int = 0
    transport_failed: bool = False  # a transient publish error: the broker may be down
    #: Why the failed and abandoned rows were not published, with a count each.
    reasons: FailureCounts = dataclasses.field(default_factory=FailureCounts)
    #: Of one batch only, not added up (:mod:`django_outbox.metrics` reads them): the
    #: rows published, the rows not published as (failure, abandoned, rows), and the
    #: seconds from the start of the claim to the end of the finalize.
    published_rows: Sequence[ClaimedMessage] = dataclasses.field(
        default=(), repr=False, compare=False
    )
    failed_rows: Sequence[tuple[Failure, bool, Sequence[ClaimedMessage]]] = dataclasses.field(
        default=(), repr=False, compare=False
    )
    seconds: float = dataclasses.field(default=0.0, compare=False)

    def add(self, other: BatchStats) -> None:
        for field in COUNTED:
            setattr(self, field, getattr(self, field) + getattr(other, field))
        self.reasons.update(other.reasons)

    @property
    def unpublished(self) -> int:
        """Rows that failed or were abandoned: the batch (or run) did not go as it should."""
        return self.failed + self.abandoned


@dataclasses.dataclass
class RunStats(BatchStats):
    """What :meth:`Relay.run` did: the totals of its batches, and why a drain gave up."""

    #: Set when a drain ended because the broker could not be reached (the reason,
    #: without passwords); the rows it could not publish wait for their retry.
    gave_up: str = ""


@dataclasses.dataclass(frozen=True)
class Failed:
    """Rows of a batch that failed alike (same failure, fate and attempts), written
    with one UPDATE."""

    failure: Failure
    abandon: bool
    delay: float  # seconds until the rows are due again (0 when abandoned)
    messages: list[ClaimedMessage]


@dataclasses.dataclass(frozen=True)
class Finalized:
    """What finalizing a batch wrote; the rows of ``failures`` exclude the ``lost`` ones."""

    claimed: int
    published: list[ClaimedMessage]
    failures: list[Failed]
    lost: list[ClaimedMessage]
    transport_failed: bool
    held: int = 0  # rows put back behind a failed row of their ordered key
    seconds: float = 0.0  # from the start of the claim to the end of the finalize


class Reporter:
    """Logs and signals what the finalized batches of the database ``using`` did (as
    the relay ``worker``, whose rows fail after ``policy``'s attempts)."""

    def __init__(self, using: str, worker: str, policy: RetryPolicy) -> None:
        self.using = using
        self.worker = worker
        self.policy = policy

    def report(self, done: Finalized) -> BatchStats:
        """Log and signal what a finalized batch did; returns its stats."""
        # (message, error) pairs of the rows this relay still held, by outcome.
        by_fate: dict[bool, list[tuple[ClaimedMessage, str]]] = {True: [], False: []}
        for failed in done.failures:
            by_fate[failed.abandon] += [(m, failed.failure.error) for m in failed.messages]
        abandoned, failed_rows = by_fate[True], by_fate[False]
        stats = BatchStats(
            claimed=done.claimed,
            published=len(done.published),
            failed=len(failed_rows),
            abandoned=len(abandoned),
            lost=len(done.lost),
            held=done.held,
            transport_failed=done.transport_failed,
            reasons=self._log_failures(done.failures),
            published_rows=done.published,
            failed_rows=[(part.failure, part.abandon, part.messages) for part in done.failures],
            seconds=done.seconds,
        )
        if done.lost:
            logger.warning(
                "lease lost on %d row(s): another relay took them over; left them alone",
                len(done.lost),
                extra={
                    "action": "outbox.lease_lost",
                    "using": self.using,
                    "worker": self.worker,
                    "ids": [m.id for m in done.lost][:50],
                },
            )
        self._send(event_published, done.published, None)
        self._send(event_failed, [m for m, _ in failed_rows], [e for _, e in failed_rows])
        self._send(event_abandoned, [m for m, _ in abandoned], [e for _, e in abandoned])
        logger.debug(
            "batch of %d: %d published, %d failed, %d abandoned, %d lost",
            stats.claimed,
            stats.published,
            stats.failed,
            stats.abandoned,
            stats.lost,
            extra={
                "action": "outbox.batch",
                "using": self.using,
                **{field: getattr(stats, field) for field in COUNTED},
            },
        )
        return stats

    def _log_failures(self, failures: list[Failed]) -> FailureCounts:
        """A few records per destination and fate of a batch, never one per row: a
        WARNING for rows that wait for a retry, an ERROR for abandoned ones, one per
        error text for the ``MAX_LOGGED_REASONS`` texts with most rows, and one for all
        the others (error texts that differ per row, such as a routing key each).
        Returns the rows counted by reason."""
        groups: dict[Reason, list[Failed]] = {}
        for failed in failures:
            error = outbox_settings.redact(failed.failure.error)
            for destination, rows in _by_destination(failed.messages).items():
                reason = Reason(destination, error, failed.abandon)
                groups.setdefault(reason, []).append(dataclasses.replace(failed, messages=rows))
        counts = FailureCounts()
        by_target: dict[tuple[str, bool], list[tuple[Reason, list[Failed]]]] = {}
        for reason, parts in groups.items():
            counts.add(reason, _rows(parts))
            by_target.setdefault((reason.destination, reason.abandoned), []).append((reason, parts))
        for reasons in by_target.values():
            reasons.sort(key=lambda item: -_rows(item[1]))
            for reason, parts in reasons[:MAX_LOGGED_REASONS]:
                self._log_reason(reason, parts)
            if rest := reasons[MAX_LOGGED_REASONS:]:
                self._log_reason(rest[0][0], [p for _, parts in rest for p in parts], len(rest))
        return counts

    def _log_reason(self, reason: Reason, parts: list[Failed], others: int = 0) -> None:
        """The one record of the rows of a batch that failed for ``reason`` (with
        ``others``: for that many error texts, ``reason``'s being the first)."""
        ids = [m.id for part in parts for m in part.messages]
        error = f"{others} other errors, such as {reason.error}" if others else reason.error
        extra = {
            "using": self.using,
            "destination": reason.destination,
            "count": len(ids),
            "error": reason.error,
        }
        if all(part.failure.outage for part in parts):
            # The broker is down: the outage's own WARNING (outbox.broker_down) says so.
            logger.info(
                "%d row(s) to %r not taken by the broker, attempts unchanged: %s",
                len(ids),
                reason.destination,
                error,
                extra={"action": "outbox.publish_deferred", **extra},
            )
        elif reason.abandoned:
            logger.error(
                "abandoned %d row(s) to %r (%s): %s",
                len(ids),
                reason.destination,
                "a permanent error"
                if any(part.failure.permanent for part in parts)
                else f"attempts exhausted, MAX_ATTEMPTS={self.policy.max_attempts}",
                error,
                extra={"action": "outbox.abandoned", "ids": ids[:50], **extra},
            )
        else:
            retry_in = min(part.delay for part in parts)
            logger.warning(
                "publishing %d row(s) to %r failed: %s; the next retry is due in %.1fs",
                len(ids),
                reason.destination,
                error,
                retry_in,
                extra={"action": "outbox.publish_failed", "retry_in": retry_in, **extra},
            )

    def _send(self, signal, messages: list[ClaimedMessage], errors: list[str] | None) -> None:  # type: ignore[no-untyped-def]
        if not messages or not signal.has_listeners(OutboxMessage):
            return
        extra = {} if errors is None else {"errors": errors}
        for receiver, error in signal.send_robust(
            OutboxMessage, messages=messages, using=self.using, **extra
        ):
            if isinstance(error, Exception):
                logger.error(
                    "signal receiver %r failed",
                    receiver,
                    exc_info=error,
                    extra={"action": "outbox.signal_failed"},
                )


def _rows(parts: list[Failed]) -> int:
    return sum(len(part.messages) for part in parts)


def _by_destination(messages: list[ClaimedMessage]) -> dict[str, list[ClaimedMessage]]:
    by_destination: dict[str, list[ClaimedMessage]] = {}
    for message in messages:
        by_destination.setdefault(message.destination, []).append(message)
    return by_destination
