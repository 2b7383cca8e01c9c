"""The relay: claim due rows, publish them, record the outcome.

One :class:`Relay` serves one database alias. :meth:`Relay.run_once` handles
one batch; :meth:`Relay.run` loops until its stop event is set, waking on
PostgreSQL NOTIFY (or every ``POLL_INTERVAL``), riding out broker and database
outages with backoff, and running retention cleanup now and then. No argparse,
no printing, no exits: ``run_outbox_relay`` is a thin command over this class.

Each batch is three short steps: claim (one statement on PostgreSQL), publish
outside any transaction, and finalize, where every write is filtered by the
batch's lease token, so a relay whose lease was taken over changes nothing.
In :meth:`Relay.run` the database steps of neighbouring batches run on a second
thread (:class:`_Pipeline`) while the relay's thread publishes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.db import DatabaseError, close_old_connections, connections, transaction

from . import db, retention, transports
from .conf import celery_problem, outbox_settings
from .envelope import ClaimedMessage
from .exceptions import BrokerUnreachable, OutboxConfigurationError
from .failures import FailureCounts, Reason
from .models import OutboxMessage, OutboxQuerySet
from .outage import Outage
from .redact import SecretFilter, mask_url
from .retry import RetryPolicy
from .routes import DEFAULT_BROKER, Route
from .signals import event_abandoned, event_failed, event_published
from .transports.base import Failure, Outcome, Transport

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks
T = TypeVar("T")

#: How long one slice of an idle wait lasts, so a stop request is seen promptly.
WAIT_SLICE = 0.5
#: Error texts a batch logs one record each for, per destination and fate (those with
#: most rows); the rows of its other error texts share one more record.
MAX_LOGGED_REASONS = 3
#: The counts of :class:`BatchStats`, which add up over a run.
_COUNTED = ("claimed", "published", "failed", "abandoned", "lost")


@dataclasses.dataclass
class BatchStats:
    """What one batch did."""

    claimed: int = 0
    published: int = 0
    failed: int = 0
    abandoned: int = 0
    lost: int = 0  # rows whose lease another relay had taken over: left untouched
    transport_failed: bool = False  # a transient publish error: the broker may be down
    #: Why the failed and abandoned rows were not published, with a count each.
    reasons: FailureCounts = dataclasses.field(default_factory=FailureCounts)

    def add(self, other: BatchStats) -> None:
        for field in _COUNTED:
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
class _Claim:
    """Rows claimed under one lease token; publishing must start before ``deadline``
    (monotonic clock: half the lease after the claim)."""

    messages: list[ClaimedMessage]
    token: uuid.UUID
    deadline: float


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A claimed batch, published: each message's outcome, and the claim's lease token."""

    messages: Sequence[ClaimedMessage]
    outcomes: Sequence[Outcome]
    token: uuid.UUID

    @property
    def transport_failed(self) -> bool:
        """A publish was tried and failed transiently: the broker may be down."""
        return any(
            outcome is not None and outcome.counts and not outcome.permanent
            for outcome in self.outcomes
        )


@dataclasses.dataclass(frozen=True)
class _Failed:
    """Rows of a batch that failed alike (same failure, fate and attempts), written
    with one UPDATE."""

    failure: Failure
    abandon: bool
    delay: float  # seconds until the rows are due again (0 when abandoned)
    messages: list[ClaimedMessage]


@dataclasses.dataclass(frozen=True)
class _Finalized:
    """What finalizing a batch wrote; the rows of ``failures`` exclude the ``lost`` ones."""

    claimed: int
    published: list[ClaimedMessage]
    failures: list[_Failed]
    lost: list[ClaimedMessage]
    transport_failed: bool


@dataclasses.dataclass
class _Run:
    """What one :meth:`Relay.run` carries from one batch to the next."""

    stop: threading.Event
    drain: bool
    on_batch: Callable[[BatchStats], None] | None
    pipeline: _Pipeline
    totals: RunStats = dataclasses.field(default_factory=RunStats)
    outage: Outage = dataclasses.field(default_factory=Outage)
    listener: db.postgresql.Listener | None = None
    #: A claim made while the previous batch was being published; it is always
    #: published, even after a stop request, so that no row waits for its lease.
    ahead: Callable[[], _Claim | None] | None = None
    next_cleanup: float = 0.0  # monotonic time of the next retention cleanup

    def tally(self, finalized: list[BatchStats]) -> None:
        for stats in finalized:
            self.totals.add(stats)
            if self.on_batch is not None:
                self.on_batch(stats)


class Relay:
    def __init__(
        self,
        using: str = "default",
        *,
        batch_size: int | None = None,
        worker: str | None = None,
        transports: dict[str, Transport] | None = None,
    ) -> None:
        self.using = using
        self.batch_size = batch_size or outbox_settings.BATCH_SIZE
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        self.policy = RetryPolicy.from_settings()
        self.lease_seconds = outbox_settings.LEASE_SECONDS
        #: A transport per broker alias of ``OUTBOX["BROKERS"]`` and one for the Celery
        #: routes ("celery"), built on first use (given ones are used as they are).
        self._transports: dict[str, Transport] = dict(transports or {})
        #: The brokers to build transports for, checked here: a malformed URL, a
        #: missing driver package, a route naming no broker, Celery routes without
        #: celery are said now (OutboxConfigurationError), not per batch.
        self._brokers = {
            alias: outbox_settings.require_broker(alias)
            for alias in sorted(outbox_settings.broker_aliases() | set(outbox_settings.brokers))
            if alias not in self._transports
        }
        self._celery_routes = sorted(
            name for name, route in outbox_settings.ROUTES.items() if route.is_celery
        )
        if self._celery_routes and "celery" not in self._transports:
            problem = celery_problem(self._celery_routes)
            if problem is not None:
                raise OutboxConfigurationError(f"{problem.id}: {problem.msg}")

    def close(self) -> None:
        """Close the broker connections (``run()`` does it when it returns)."""
        for transport in self._transports.values():
            transport.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- one batch ------------------------------------------------------------------

    def run_once(self) -> BatchStats:
        """Claim, publish and finalize one batch; returns what happened."""
        claim = self._claim()
        if claim is None:
            return BatchStats()
        return self._report(self._finalize(self._publish_claim(claim)))

    def _claim(self) -> _Claim | None:
        """Claim a batch; None when nothing is due."""
        token = uuid.uuid4()
        messages = db.claim(
            self.using,
            limit=self.batch_size,
            lease_seconds=self.lease_seconds,
            worker=self.worker,
            token=token,
        )
        if not messages:
            return None
        return _Claim(messages, token, time.monotonic() + self.lease_seconds / 2)

    def _publish_claim(self, claim: _Claim) -> _Batch:
        outcomes = self._publish(claim.messages, deadline=claim.deadline)
        return _Batch(claim.messages, outcomes, claim.token)

    def transport(self, route: Route) -> Transport:
        """The transport of ``route``: its broker alias's (by the URL's scheme, see
        :mod:`django_outbox.transports`), or Celery's. Raises
        :class:`OutboxConfigurationError` naming the setting when there is none."""
        kind = "celery" if route.is_celery else route.broker
        if kind not in self._transports:
            if route.is_celery:
                self._transports[kind] = transports.celery_transport(self._celery_routes)
            else:
                broker = self._brokers.get(kind) or outbox_settings.require_broker(kind)
                self._transports[kind] = transports.for_broker(broker)
        return self._transports[kind]

    def _publish(self, messages: Sequence[ClaimedMessage], *, deadline: float) -> list[Outcome]:
        """Publish by destination. Destinations whose turn comes after half the lease
        are not attempted (they fail, to be retried), so that no other relay can
        take over rows this one is still publishing."""
        outcomes: dict[int, Outcome] = {}
        by_destination = itertools.groupby(
            sorted(messages, key=lambda m: (m.destination, m.id)), key=lambda m: m.destination
        )
        for destination, group in by_destination:
            batch = list(group)
            route = outbox_settings.route_for(destination)
            if time.monotonic() > deadline:
                late = Failure.not_attempted(
                    "not attempted: the batch used half its lease "
                    f"(LEASE_SECONDS={self.lease_seconds:g}) before this destination's turn",
                    retry_delay=0.0,
                )
                results: list[Outcome] = [late] * len(batch)
            elif route is None:
                unknown = Failure(
                    f"destination {destination!r} has no route: it is not in OUTBOX['ROUTES'] "
                    "and OUTBOX['DEFAULT_ROUTE'] is False",
                    permanent=True,
                )
                results = [unknown] * len(batch)
            else:
                try:
                    results = self.transport(route).publish(route, batch)
                except OutboxConfigurationError:
                    raise  # no broker for the route: the relay cannot run as configured
                except Exception as exc:  # a bug or an error no transport classified
                    logger.exception(
                        "publishing to %r failed unexpectedly",
                        destination,
                        extra={"action": "outbox.publish_error", "destination": destination},
                    )
                    results = [Failure.from_exception(exc)] * len(batch)
            outcomes.update(zip((m.id for m in batch), results, strict=True))
        return [outcomes[m.id] for m in messages]

    def _finalize(self, batch: _Batch) -> _Finalized:
        """Record the outcomes: the database writes of a batch, and nothing else (it
        may run on the pipeline's database thread)."""
        messages, token = batch.messages, batch.token
        published = [m for m, out in zip(messages, batch.outcomes, strict=True) if out is None]
        # Rows that failed alike (same failure, same attempts) are written with one UPDATE.
        failures: dict[tuple[Failure, bool, int], list[ClaimedMessage]] = {}
        for message, outcome in zip(messages, batch.outcomes, strict=True):
            if outcome is not None:
                attempts = message.attempts + (1 if outcome.counts else 0)
                abandon = outcome.permanent or (outcome.counts and self.policy.exhausted(attempts))
                failures.setdefault((outcome, abandon, attempts), []).append(message)
        rows = OutboxMessage.objects.using(self.using)
        lost: list[ClaimedMessage] = []
        # One statement is atomic on its own; more share a transaction.
        several = bool(published) + len(failures) > 1
        written: list[_Failed] = []
        with transaction.atomic(using=self.using) if several else contextlib.nullcontext():
            if published:
                held = rows.filter(id__in=[m.id for m in published]).leased(token)
                if held.mark_published() != len(published):
                    # Published rows keep the token: those without it were taken over.
                    lost += _not_held(published, held)
            for (failure, abandon, attempts), group in failures.items():
                delay = self._retry_delay(failure, abandon, attempts)
                held = rows.filter(id__in=[m.id for m in group]).leased(token)
                marked = held.mark_failed(
                    failure.error, delay, abandon=abandon, counts=failure.counts
                )
                if marked != len(group):
                    lost += _not_held(group, held)
                written.append(_Failed(failure, abandon, delay, group))
        lost_ids = {m.id for m in lost}
        return _Finalized(
            claimed=len(messages),
            published=[m for m in published if m.id not in lost_ids],
            failures=[
                dataclasses.replace(
                    done, messages=[m for m in done.messages if m.id not in lost_ids]
                )
                for done in written
            ],
            lost=lost,
            transport_failed=batch.transport_failed,
        )

    def _retry_delay(self, failure: Failure, abandon: bool, attempts: int) -> float:
        """Seconds until a failed row is due again."""
        if abandon:
            return 0.0
        return self.policy.delay(attempts) if failure.counts else failure.retry_delay

    def _report(self, done: _Finalized) -> BatchStats:
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
            transport_failed=done.transport_failed,
            reasons=self._log_failures(done.failures),
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
                **{field: getattr(stats, field) for field in _COUNTED},
            },
        )
        return stats

    def _log_failures(self, failures: list[_Failed]) -> FailureCounts:
        """A few records per destination and fate of a batch, never one per row: a
        WARNING for rows that wait for a retry, an ERROR for abandoned ones, one per
        error text for the ``MAX_LOGGED_REASONS`` texts with most rows, and one for all
        the others (error texts that differ per row, such as a routing key each).
        Returns the rows counted by reason."""
        groups: dict[Reason, list[_Failed]] = {}
        for failed in failures:
            error = outbox_settings.redact(failed.failure.error)
            for destination, rows in _by_destination(failed.messages).items():
                reason = Reason(destination, error, failed.abandon)
                groups.setdefault(reason, []).append(dataclasses.replace(failed, messages=rows))
        counts = FailureCounts()
        by_target: dict[tuple[str, bool], list[tuple[Reason, list[_Failed]]]] = {}
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

    def _log_reason(self, reason: Reason, parts: list[_Failed], others: int = 0) -> None:
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
        if reason.abandoned:
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

    # -- the loop -------------------------------------------------------------------

    def run(
        self,
        stop: threading.Event,
        *,
        drain: bool = False,
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> RunStats:
        """Relay until ``stop`` is set (or, with ``drain``, until nothing is due, or
        the broker cannot be reached: a drain gives up rather than wait for it).

        Returns the totals. A batch in progress when ``stop`` is set is finished
        first, so its rows are not left PROCESSING.
        """
        state = _Run(stop, drain, on_batch, _Pipeline(self))
        state.next_cleanup = time.monotonic() + random.uniform(0, outbox_settings.CLEANUP_INTERVAL)
        try:
            while not stop.is_set() or state.ahead is not None:
                outage = state.outage
                if state.ahead is None and outage.broker_down and not self._broker_back(state):
                    if drain:
                        break
                    stop.wait(outage.backoff())
                    continue
                try:
                    batch = self._turn(state)
                except DatabaseError as exc:
                    self._database_failed(state, exc)
                    continue
                self._cleanup_when_due(state)
                if batch is not None:
                    if batch.transport_failed:
                        outage.broker_suspect()
                    continue
                if drain:
                    break
                close_old_connections()  # honours CONN_MAX_AGE between idle spells
                state.pipeline.close_old_connections()
                state.listener = self._idle(stop, state.listener)
        finally:
            try:
                state.tally(state.pipeline.close())
            finally:
                _closed(state.listener)
                self.close()
        return state.totals

    def _turn(self, state: _Run) -> _Batch | None:
        """One batch: take the claim made ahead (or claim now), claim the next one ahead
        when this one was full, publish, and hand the batch to the pipeline; report the
        batches the pipeline finished. Returns the batch, or None when nothing was due."""
        if state.ahead is not None:
            claim, state.ahead = state.ahead(), None
        else:
            if state.listener is None and not state.drain:
                state.listener = db.listen(self.using)
            claim = self._claim()
        batch = None
        if claim is not None:
            more_due = len(claim.messages) == self.batch_size
            if more_due and not (state.stop.is_set() or state.outage.broker_down):
                state.ahead = state.pipeline.claim_ahead()
            batch = self._publish_claim(claim)
            state.pipeline.finalize(batch)
        state.tally(state.pipeline.collect(everything=batch is None))
        state.outage.database_recovered(self.using)
        return batch

    def _database_failed(self, state: _Run, exc: DatabaseError) -> None:
        """Log the outage, give up the claim made ahead (its rows wait for their lease),
        settle the pipeline, close every connection of this relay (both threads' and the
        listener's: the outage broke those not in use too), and back off."""
        state.outage.database_failed(self.using, exc)
        state.ahead = None
        state.tally(state.pipeline.settle())
        connections[self.using].close()
        state.pipeline.close_connection()
        state.listener = _closed(state.listener)
        state.stop.wait(state.outage.backoff())

    def _cleanup_when_due(self, state: _Run) -> None:
        """Retention between batches, busy or idle: a relay that never runs dry still
        keeps the table trim (not while draining)."""
        if not state.drain and time.monotonic() >= state.next_cleanup:
            state.next_cleanup = time.monotonic() + outbox_settings.CLEANUP_INTERVAL
            self._cleanup()

    def _cleanup(self) -> None:
        try:
            retention.cleanup(self.using)
        except DatabaseError:
            logger.warning(
                "retention cleanup failed",
                exc_info=True,
                extra={"action": "outbox.cleanup_failed", "using": self.using},
            )

    def _broker_back(self, state: _Run) -> bool:
        """Whether the broker can be reached again. When it cannot, a relay logs the
        outage (once) and waits it out; a drain records why it gives up."""
        for kind, transport in self._transports.items():
            try:
                transport.check()
            except Exception as exc:  # any connect error: still down
                if state.drain:
                    state.totals.gave_up = self._unreachable(kind, exc)
                else:
                    state.outage.broker_failed(exc)
                return False
        state.outage.broker_recovered()
        return True

    def _unreachable(self, kind: str, exc: Exception) -> str:
        """Why the broker of transport ``kind`` (a broker alias, or "celery") cannot be
        reached, with its URL masked; a broker of ``OUTBOX["BROKERS"]`` by its alias."""
        known = self._brokers.get(kind)
        if kind == "celery":
            broker = "Celery's broker"
        elif known is None:
            broker = "the broker" if kind == DEFAULT_BROKER else f"the broker {kind!r}"
        elif known.named:
            broker = f"the broker {kind!r} ({mask_url(known.url)})"
        else:
            broker = f"the broker {mask_url(known.url)}"
        if isinstance(exc, BrokerUnreachable) and isinstance(exc.__cause__, Exception):
            exc = exc.__cause__  # the transport's check named the broker: said above
        return f"{broker} is unreachable ({Failure.from_exception(exc).error})"

    def _idle(
        self, stop: threading.Event, listener: db.postgresql.Listener | None
    ) -> db.postgresql.Listener | None:
        """Sleep until staged rows commit (NOTIFY), POLL_INTERVAL passes, or stop."""
        deadline = time.monotonic() + outbox_settings.POLL_INTERVAL
        while not stop.is_set() and (remaining := deadline - time.monotonic()) > 0:
            if listener is None:
                stop.wait(min(remaining, WAIT_SLICE))
                continue
            try:
                if listener.wait(min(remaining, WAIT_SLICE)):
                    break
            except Exception as exc:  # the LISTEN connection broke: poll until the next batch
                logger.warning(
                    "LISTEN connection lost (%s); polling every %ss",
                    exc,
                    outbox_settings.POLL_INTERVAL,
                    extra={"action": "outbox.listen_lost", "using": self.using},
                )
                listener = _closed(listener)
        return listener


class _Pipeline:
    """Database work done on a thread of its own, with its own connection, while the
    relay's thread publishes: the claim of the next batch (when the last one was
    full) and the finalize of the batch just published. At most one batch waits to
    be finalized while the next one is published.

    Where the database takes one writer at a time (no SKIP LOCKED: SQLite), nothing
    is claimed ahead and each batch is finalized inline, before the next claim.
    """

    def __init__(self, relay: Relay) -> None:
        self._relay = relay
        self._pending: collections.deque[Callable[[], _Finalized]] = collections.deque()
        self._executor: ThreadPoolExecutor | None = None
        if db.supports_skip_locked(connections[relay.using]):
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="outbox-db")

    def claim_ahead(self) -> Callable[[], _Claim | None] | None:
        """Start claiming the next batch; returns how to wait for it (None: not here)."""
        if self._executor is None:
            return None
        return self._executor.submit(self._in_thread, self._relay._claim).result

    def finalize(self, batch: _Batch) -> None:
        if self._executor is None:
            self._pending.append(functools.partial(self._relay._finalize, batch))
        else:
            self._pending.append(
                self._executor.submit(self._in_thread, self._relay._finalize, batch).result
            )

    def collect(self, *, everything: bool) -> list[BatchStats]:
        """Wait for the batches started before the newest one (``everything``: for all
        of them) to be finalized; log and signal them, return their stats. A database
        error is raised; the batch it hit is given up (its leases will expire)."""
        keep = 0 if everything or self._executor is None else 1
        finalized = []
        while len(self._pending) > keep:
            finalized.append(self._relay._report(self._pending.popleft()()))
        return finalized

    def settle(self) -> list[BatchStats]:
        """Wait for every batch; those whose finalize failed are given up (their rows
        are claimed again when their lease expires), the others reported."""
        finalized = []
        while self._pending:
            try:
                finalized += self.collect(everything=True)
            except DatabaseError:
                logger.debug("finalizing a batch failed", exc_info=True)
        return finalized

    def close_old_connections(self) -> None:
        if self._executor is not None:
            self._executor.submit(close_old_connections).result()

    def close_connection(self) -> None:
        """Close the database thread's connection (after an outage: the next use
        opens a fresh one instead of failing on a connection the server dropped)."""
        if self._executor is not None:
            using = self._relay.using
            self._executor.submit(lambda: connections[using].close()).result()

    def close(self) -> list[BatchStats]:
        finalized = self.settle()
        if self._executor is not None:
            self._executor.submit(connections.close_all).result()
            self._executor.shutdown()
        return finalized

    def _in_thread(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return work(*args)
        except DatabaseError:
            connections[self._relay.using].close()  # this thread's; reopened on next use
            raise


def _rows(parts: list[_Failed]) -> int:
    return sum(len(part.messages) for part in parts)


def _by_destination(messages: list[ClaimedMessage]) -> dict[str, list[ClaimedMessage]]:
    by_destination: dict[str, list[ClaimedMessage]] = {}
    for message in messages:
        by_destination.setdefault(message.destination, []).append(message)
    return by_destination


def _not_held(messages: list[ClaimedMessage], held: OutboxQuerySet) -> list[ClaimedMessage]:
    """The ``messages`` that ``held`` (their rows still under this batch's lease)
    no longer contains: another relay took them over."""
    kept = set(held.values_list("id", flat=True))
    return [m for m in messages if m.id not in kept]


def _closed(listener: db.postgresql.Listener | None) -> db.postgresql.Listener | None:
    """Close ``listener`` if there is one; returns None to store in its place."""
    if listener is not None:
        try:
            listener.close()
        except Exception:  # already broken
            logger.debug("closing a broken LISTEN connection failed", exc_info=True)
    return None
