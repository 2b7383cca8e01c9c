"""The relay: claim due rows, publish them, record the outcome.

One :class:`Relay` serves one database alias. :meth:`Relay.run_once` handles
one batch; :meth:`Relay.run` loops until its stop event is set, waking on
PostgreSQL NOTIFY (or every ``POLL_INTERVAL``: :class:`~django_outbox.wakeup.WakeUp`),
riding out broker and database outages with backoff (an
:class:`~django_outbox.outage.OutageTracker` each), while a
:class:`~django_outbox.retention.RetentionThread` cleans up on a thread of its own.
No argparse, no printing, no exits: ``run_outbox_relay`` is a thin command over
this class.

Each batch is three short steps: claim (one statement on PostgreSQL), publish
outside any transaction, and finalize, where every write is filtered by the
batch's lease token, so a relay whose lease was taken over changes nothing.
In :meth:`Relay.run` the database steps of neighbouring batches run on a claim thread
and a finalize thread (:class:`~django_outbox.pipeline.Pipeline`) while the relay's
thread publishes; a batch that caught up with what was due, after which the relay
waits for a NOTIFY, is finalized on the relay's thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import itertools
import logging
import math
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from django.db import DatabaseError, close_old_connections, connections
from django.utils import timezone

from . import db, retention, samples, store, tracing
from .conf import outbox_settings
from .envelope import ClaimedBatch, ClaimedMessage
from .exceptions import BrokerUnreachable, OutboxConfigurationError
from .failures import FailureCounts, Reason
from .heartbeat import Heartbeat, HeartbeatThread, process_name
from .models import OutboxMessage, WorkerKind
from .outage import OutageTracker, broker_outage, database_outage, queue_outage
from .pipeline import Pipeline
from .redact import SecretFilter, mask_url
from .retry import RetryPolicy
from .routes import DEFAULT_BROKER, Route
from .signals import event_abandoned, event_failed, event_published
from .transports import celery_transport, for_broker, require_celery
from .transports.base import Failure, Outcome, Transport
from .wakeup import WakeUp

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

#: The destinations this process has published by the default route: each is logged once.
_DEFAULT_ROUTED: set[str] = set()


def _note_default_route(route: Route) -> None:
    """Log, once per process, the first publish of a destination ``ROUTES`` does not
    name. The default route declares a queue of that name, so a typo (``"order"`` for
    ``"orders"``) would otherwise fill a queue nobody reads without a word."""
    name = route.destination
    if name in _DEFAULT_ROUTED or route.is_celery or name in outbox_settings.ROUTES:
        return
    _DEFAULT_ROUTED.add(name)
    logger.warning(
        "destination %r is not in OUTBOX['ROUTES']: the default route publishes it to queue "
        "%r (exchange %r); if that is a typo, no consumer reads it. Name your destinations in "
        "ROUTES and set OUTBOX['DEFAULT_ROUTE'] = False to refuse unknown ones at stage time",
        name,
        route.queue,
        route.exchange,
        extra={"action": "outbox.default_route", "destination": name},
    )


#: Error texts a batch logs one record each for, per destination and fate (those with
#: most rows); the rows of its other error texts share one more record.
MAX_LOGGED_REASONS = 3
#: The counts of :class:`BatchStats`, which add up over a run.
_COUNTED = ("claimed", "published", "failed", "abandoned", "lost", "held")


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

    messages: ClaimedBatch  # with left_behind: its bounds left due rows out
    token: uuid.UUID
    deadline: float
    started: float  # monotonic clock: when the claim began
    ordered: bool  # it holds ordered rows (only a whole claim can)


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A claimed batch, published: each message's outcome, the claim's lease token, and
    the destinations handed to a transport (the others' rows were not attempted: their
    outcomes say nothing about a broker)."""

    messages: Sequence[ClaimedMessage]
    outcomes: Sequence[Outcome]
    token: uuid.UUID
    tried: frozenset[str]
    #: When the claim began (monotonic clock; now, when not given).
    started: float = dataclasses.field(default_factory=time.monotonic)
    #: Whether it holds ordered rows: their keys' next rows are claimable only once
    #: it is finalized.
    ordered: bool = False

    def _tried_and(self, failed: Callable[[Failure], bool]) -> list[ClaimedMessage]:
        """The messages of the tried destinations whose outcome is a ``failed`` failure."""
        return [
            message
            for message, outcome in zip(self.messages, self.outcomes, strict=True)
            if outcome is not None and message.destination in self.tried and failed(outcome)
        ]

    @property
    def transient_failures(self) -> list[ClaimedMessage]:
        """The messages whose publish was tried and failed transiently, or whose broker
        did not take them (an outage failure): their broker may be down."""
        return self._tried_and(lambda out: out.outage or (out.counts and not out.permanent))

    @property
    def stalled(self) -> dict[str, set[str]]:
        """The destinations whose broker took their messages without confirming them
        (or was not reached), by transport key: the broker, or their queue, stalled."""
        found: dict[str, set[str]] = {}
        for message in self._tried_and(lambda out: out.outage):
            route = outbox_settings.route_for(message.destination)
            if route is not None:
                found.setdefault(_kind(route), set()).add(message.destination)
        return found

    @property
    def confirmed(self) -> set[str]:
        """The destinations of which the broker took a message."""
        pairs = zip(self.messages, self.outcomes, strict=True)
        return {message.destination for message, outcome in pairs if outcome is None}

    @property
    def transport_failed(self) -> bool:
        """A publish was tried and failed transiently: the broker may be down."""
        return bool(self.transient_failures)


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
    held: int = 0  # rows put back behind a failed row of their ordered key
    seconds: float = 0.0  # from the start of the claim to the end of the finalize


@dataclasses.dataclass
class _Run:
    """What one :meth:`Relay.run` carries from one batch to the next: its components
    and its totals."""

    stop: threading.Event
    drain: bool
    on_batch: Callable[[BatchStats], None] | None
    wakeup: WakeUp
    database: OutageTracker
    #: One tracker per broker (a transport's key: a broker alias, or "celery"), and
    #: when each broker that is down is to be tried again (monotonic clock).
    brokers: dict[str, OutageTracker] = dataclasses.field(default_factory=dict)
    retry_at: dict[str, float] = dataclasses.field(default_factory=dict)
    #: By transport key, the destinations that stalled since its broker was last
    #: checked: if the broker answers its check, it is their queue that stalled.
    stalled: dict[str, set[str]] = dataclasses.field(default_factory=dict)
    #: Destinations whose queue stalled while its broker answered (a quorum queue
    #: without a majority): a tracker each, and when each is to be tried again.
    queues: dict[str, OutageTracker] = dataclasses.field(default_factory=dict)
    queue_retry_at: dict[str, float] = dataclasses.field(default_factory=dict)
    pipeline: Pipeline[_Claim, _Batch, _Finalized] = dataclasses.field(init=False)
    retention_thread: retention.RetentionThread | None = None
    #: A running relay's heartbeat (a drain has none), and its last batch with rows.
    heartbeat: HeartbeatThread | None = None
    last_batch_at: dt.datetime | None = None
    totals: RunStats = dataclasses.field(default_factory=RunStats)
    #: A claim made while the previous batch was being published; it is always
    #: published, even after a stop request, so that no row waits for its lease.
    ahead: Callable[[], _Claim | None] | None = None
    done: bool = False  # a drain that ran dry or gave up on the broker
    #: The last batch caught up with what was due (``_caught_up``: its claim saw every
    #: due row and left none out, it freed none, and the listener hears NOTIFYs): the
    #: relay rests until a NOTIFY (or the poll interval) instead of claiming again at
    #: once (two claims that would mostly come back empty).
    caught_up: bool = False
    #: A batch that may free rows (ordered rows, a failure) was handed to the finalize
    #: since the pipeline was last empty: a claim made meanwhile may have missed them.
    freeing: bool = False
    #: When the first row not due at the last claim comes due (monotonic clock; inf:
    #: none), as that claim said; None after a claim that found nothing: the rest asks.
    due_at: float | None = None

    def going(self) -> bool:
        """Until stopped (after the claim made ahead is published) or, draining, done."""
        return not self.done and (not self.stop.is_set() or self.ahead is not None)

    def broker(self, kind: str) -> OutageTracker:
        """The outage tracker of the broker of transport ``kind``."""
        if kind not in self.brokers:
            self.brokers[kind] = broker_outage(None if kind == "celery" else kind)
        return self.brokers[kind]

    def brokers_down(self) -> list[str]:
        return [kind for kind, tracker in self.brokers.items() if tracker.down]

    def queue_stalled(self, destination: str) -> None:
        """The broker of ``destination`` answers, but its queue took messages without
        confirming them: log it once, back off from that destination alone."""
        if destination not in self.queues:
            self.queues[destination] = queue_outage(destination)
        tracker = self.queues[destination]
        tracker.failed(
            ConnectionError("its messages were not confirmed while its broker answered a probe")
        )
        self.queue_retry_at[destination] = time.monotonic() + tracker.backoff()

    def queues_confirmed(self, destinations: set[str]) -> None:
        """Stalled destinations of which the broker took a message again: recovered."""
        for destination in destinations & set(self.queues):
            self.queues.pop(destination).recovered()
            self.queue_retry_at.pop(destination, None)

    def queues_waiting(self, now: float) -> dict[str, float]:
        """Stalled destinations, with the seconds left until they are tried again (0 or
        less: due, to be tried after the batch's other destinations)."""
        return {name: at - now for name, at in self.queue_retry_at.items()}

    def wait_for_broker(self) -> None:
        """Back off until the next broker that is down is due to be tried again; a
        drain gives up instead."""
        if self.drain:
            self.done = True
        else:
            soonest = min(self.retry_at.values(), default=time.monotonic())
            self.stop.wait(max(0.0, soonest - time.monotonic()))

    def snapshot(self) -> tuple[dict[str, int], dt.datetime | None]:
        """The totals and the last batch with rows, for the heartbeat."""
        return {field: getattr(self.totals, field) for field in _COUNTED}, self.last_batch_at

    def settled(self) -> bool:
        """Whether a claim made now sees every row the batches handed to the finalize
        free: none of them can free any, or the pipeline finished them all."""
        if not self.pipeline.pending:
            self.freeing = False
        return not self.freeing

    def rest(self) -> None:
        """Nothing is due: honour ``CONN_MAX_AGE`` on every database thread, then wait for a
        wake-up, the poll interval or stop; a drain is done instead."""
        if self.drain:
            self.done = True
            return
        close_old_connections()
        self.pipeline.close_old_connections()
        self.wakeup.wait(self.until_due())

    def until_due(self) -> float:
        """How long a wait for a NOTIFY lasts at most: until the first row that was not
        due comes due (a scheduled event, a retry: no NOTIFY announces it), within the
        poll interval. After a claim that found nothing, asked now (``db.next_due_in``); a
        database error leaves the poll interval (the next claim rides out the outage)."""
        due_at = self.due_at
        if due_at is None:
            try:
                seconds = db.next_due_in(self.wakeup.using)
            except DatabaseError:
                return self.wakeup.poll_interval
            due_at = math.inf if seconds is None else time.monotonic() + seconds
        return min(max(due_at - time.monotonic(), 0.0), self.wakeup.poll_interval)

    def tally(self, stats: BatchStats) -> None:
        self.totals.add(stats)
        if stats.claimed:
            self.last_batch_at = timezone.now()
        if self.on_batch is not None:
            self.on_batch(stats)


class Relay:
    """Claims due outbox rows of the database ``using``, publishes them through its
    transports, and records each row's outcome; ``manage.py run_outbox_relay`` runs one.

    ``batch_size`` and ``worker`` (the name written into claimed rows) default to
    ``OUTBOX["BATCH_SIZE"]`` and ``host:pid``; ``transports`` replaces the ones built from
    the settings (tests, :mod:`django_outbox.testing`). Use it as a context manager, or
    call :meth:`close`, to drop its broker connections.
    """

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
        self.worker = worker or process_name()
        self.policy = RetryPolicy.from_settings()
        self.lease_seconds = outbox_settings.LEASE_SECONDS
        #: A transport per broker alias of ``OUTBOX["BROKERS"]`` and one for the Celery
        #: routes ("celery"), built on first use (given ones are used as they are).
        self._transports: dict[str, Transport] = dict(transports or {})
        _refuse_unknown_keys(self._transports)
        #: The transports whose broker is down in a run, with the seconds until it is
        #: tried again: their rows are not attempted meanwhile (no attempt spent).
        self._paused: dict[str, float] = {}
        #: Of those, the ones whose broker is out of memory.
        self._full: set[str] = set()
        #: Likewise the destinations whose queue stalled while their broker answered
        #: (those with no time left are tried, after the batch's other destinations).
        self._waiting: dict[str, float] = {}
        #: The brokers to build transports for, checked here: a malformed URL, a
        #: missing driver package, a route naming no broker, Celery routes without
        #: celery are said now (OutboxConfigurationError), not per batch.
        self._brokers = {
            alias: outbox_settings.require_broker(alias)
            for alias in sorted(outbox_settings.broker_aliases() | set(outbox_settings.brokers))
            if alias not in self._transports
        }
        #: The broker attributes of the ``send`` spans, per transport key.
        self._broker_spans: dict[str, dict[str, Any]] = {}
        self._celery_routes = sorted(
            name for name, route in outbox_settings.ROUTES.items() if route.is_celery
        )
        if "celery" not in self._transports:
            require_celery(self._celery_routes)
        #: Whether these settings order a route. If not, the relay claims with the
        #: statement for unordered rows, cheaper to plan, and whole (ordered rows too: left
        #: by a route that was ordered) at least every ``POLL_INTERVAL``, and for a
        #: ``POLL_INTERVAL`` after any claim found ordered rows (a key's next rows are
        #: hidden while its batch is in flight). Monotonic clock.
        self._orders = outbox_settings.DEFAULT_ORDERED or any(
            route.ordered for route in outbox_settings.ROUTES.values()
        )
        self._whole_claim_at = self._ordered_until = 0.0

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
        """Claim, publish and finalize one batch; returns what happened. A broker that
        stalled in an earlier call is tried again (only :meth:`run` backs off from it)."""
        self._paused, self._waiting = {}, {}
        claim = self._claim(whole=True)
        if claim is None:
            return BatchStats()
        return self._report(self._finalize(self._publish_claim(claim)))

    def _claim(self, whole: bool = False) -> _Claim | None:
        """Claim a batch; None when nothing is due. The claim is ``whole`` (ordered
        rows too) when asked, when the settings order a route, when the last whole claim
        is ``POLL_INTERVAL`` old, or less than that after a claim found ordered rows."""
        token, started = uuid.uuid4(), time.monotonic()
        whole = whole or self._orders or not self._ordered_until < started < self._whole_claim_at
        messages = store.claim(
            self.using,
            limit=self.batch_size,
            lease_seconds=self.lease_seconds,
            worker=self.worker,
            token=token,
            ordered=whole,
        )
        ordered = whole and any(message.sequence is not None for message in messages)
        if whole:
            self._whole_claim_at = started + outbox_settings.POLL_INTERVAL
            if ordered:
                self._ordered_until = self._whole_claim_at
        if not messages:
            return None
        deadline = time.monotonic() + self.lease_seconds / 2
        return _Claim(messages, token, deadline, started, ordered)

    def _publish_claim(self, claim: _Claim) -> _Batch:
        outcomes, tried = self._publish(claim.messages, deadline=claim.deadline)
        return _Batch(claim.messages, outcomes, claim.token, tried, claim.started, claim.ordered)

    def transport(self, route: Route) -> Transport:
        """The transport of ``route``: its broker alias's (by the URL's scheme, see
        :mod:`django_outbox.transports`), or Celery's. Raises
        :class:`OutboxConfigurationError` naming the setting when there is none."""
        kind = _kind(route)
        if kind not in self._transports:
            if route.is_celery:
                self._transports[kind] = celery_transport(self._celery_routes)
            else:
                broker = self._brokers.get(kind) or outbox_settings.require_broker(kind)
                self._transports[kind] = for_broker(broker)
        return self._transports[kind]

    def _publish(
        self, messages: Sequence[ClaimedMessage], *, deadline: float
    ) -> tuple[list[Outcome], frozenset[str]]:
        """Publish by destination; returns the outcomes and the destinations tried.
        Destinations whose turn comes after half the lease are not attempted (they
        fail, to be retried), so that no other relay can take over rows this one is
        still publishing; nor are those whose broker or queue is known to be down."""
        outcomes: dict[int, Outcome] = {}
        tried: set[str] = set()
        # A destination back from a stall goes last: its confirm timeout, if it stalls
        # again, then delays no other destination of the batch. (The plain order when
        # none stalled: this sort runs for every message of every batch.)
        stalls = self._waiting
        order = (lambda m: (m.destination in stalls, _publish_order(m))) if stalls else None
        by_destination = itertools.groupby(
            sorted(messages, key=order or _publish_order), key=lambda m: m.destination
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
            elif route is not None and _kind(route) in self._paused:
                results = [self._not_attempted(_kind(route))] * len(batch)
            elif self._waiting.get(destination, 0.0) > 0:
                waiting = Failure.broker_down(
                    f"not attempted: the queue of {destination!r} is not confirming",
                    retry_delay=max(self._waiting[destination], 1.0),
                )
                results = [waiting] * len(batch)
            elif route is None:
                unknown = Failure(
                    f"destination {destination!r} has no route: it is not in OUTBOX['ROUTES'] "
                    "and OUTBOX['DEFAULT_ROUTE'] is False",
                    permanent=True,
                    kind="no_route",
                )
                results = [unknown] * len(batch)
            else:
                results = self._publish_route(route, batch)
                tried.add(destination)
            outcomes.update(zip((m.id for m in batch), results, strict=True))
        return [outcomes[m.id] for m in messages], frozenset(tried)

    def _publish_route(self, route: Route, batch: list[ClaimedMessage]) -> list[Outcome]:
        """Publish ``batch`` through ``route``'s transport. When its broker did not take
        them (an outage), the batch's later destinations on that broker are not
        attempted: each would wait its confirm timeout in turn."""
        if not all(type(message.headers) is dict for message in batch):
            return _refusing_malformed(batch, functools.partial(self._publish_route, route))
        _note_default_route(route)
        # No broker for the route raises OutboxConfigurationError: the relay
        # cannot run as configured.
        transport = self.transport(route)
        with tracing.sending(route.destination, self._span_attributes(route), batch) as span:
            try:
                results = transport.publish(route, batch)
            except Exception as exc:  # a bug or an error no transport classified
                logger.exception(
                    "publishing to %r failed unexpectedly",
                    route.destination,
                    extra={"action": "outbox.publish_error", "destination": route.destination},
                )
                results = [Failure.from_exception(exc)] * len(batch)
                span.failed(type(exc).__name__, "the transport raised")
            else:
                _trace_failures(span, results)
        if any(result is not None and result.outage for result in results):
            self._paused.setdefault(_kind(route), 0.0)  # until _broker_ready checks it
        return results

    def _span_attributes(self, route: Route) -> dict[str, Any]:
        """The broker's attributes of the ``send`` spans of ``route`` (see
        :func:`django_outbox.tracing.broker_attributes`), worked out once per broker."""
        kind = _kind(route)
        if kind not in self._broker_spans:
            # A transport given to the relay may have no broker in the settings at all
            # (django_outbox.testing's memory transport): it is no reason to fail.
            broker = self._brokers.get(kind) or outbox_settings.brokers.get(kind)
            self._broker_spans[kind] = (
                {"messaging.system": "celery"}
                if route.is_celery
                else tracing.broker_attributes(broker.url)
                if broker is not None
                else {"messaging.system": "memory"}
            )
        return self._broker_spans[kind]

    def _not_attempted(self, kind: str) -> Failure:
        """The outcome of a row whose broker is down (or out of memory): due again when
        it is tried next."""
        full = kind in self._full
        return Failure.broker_down(
            f"not attempted: {self._describe(kind)} is {'out of memory' if full else 'down'}",
            retry_delay=max(self._paused[kind], 1.0),
            kind="out_of_memory" if full else "",
        )

    def _finalize(self, batch: _Batch) -> _Finalized:
        """Record the outcomes: a batch's database writes only (maybe on the finalize thread)."""
        messages, token = batch.messages, batch.token
        held = _held_back(messages, batch.outcomes)
        published = [
            m
            for m, out in zip(messages, batch.outcomes, strict=True)
            if out is None and m.id not in held
        ]
        # Rows that failed alike (same failure, same attempts) are written with one UPDATE.
        failures: dict[tuple[Failure, bool, int], list[ClaimedMessage]] = {}
        for message, outcome in zip(messages, batch.outcomes, strict=True):
            if outcome is not None and message.id not in held:
                attempts = message.attempts + (1 if outcome.counts else 0)
                abandon = outcome.permanent or (outcome.counts and self.policy.exhausted(attempts))
                failures.setdefault((outcome, abandon, attempts), []).append(message)
        written = [
            _Failed(failure, abandon, self._retry_delay(failure, abandon, attempts), group)
            for (failure, abandon, attempts), group in failures.items()
        ]
        lost_ids = store.record(
            self.using,
            token,
            published=[m.id for m in published],
            failed=[
                store.FailedRows(
                    [m.id for m in done.messages],
                    done.failure.error,
                    abandon=done.abandon,
                    delay=done.delay,
                    counts=done.failure.counts,
                )
                for done in written
            ],
            held=sorted(held),
        )
        return _Finalized(
            claimed=len(messages),
            published=[m for m in published if m.id not in lost_ids],
            failures=[
                dataclasses.replace(
                    done, messages=[m for m in done.messages if m.id not in lost_ids]
                )
                for done in written
            ],
            lost=[m for m in messages if m.id in lost_ids],
            transport_failed=batch.transport_failed,
            held=len(held - set(lost_ids)),
            seconds=time.monotonic() - batch.started,
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

        Each turn publishes a batch; with nothing due, the relay waits for the first
        of a wake-up, the poll interval, or ``stop``. Returns the totals. A batch in
        progress when ``stop`` is set is finished first, so its rows are not left
        PROCESSING.
        """
        with _quick_switches(), self._running(stop, drain, on_batch) as state:
            if not drain:  # relays started together (a deploy) do not claim and poll in step
                stop.wait(random.uniform(0, outbox_settings.START_JITTER))
            while state.going():  # until stopped (the claim made ahead published) or drained
                if not self._broker_ready(state):
                    state.wait_for_broker()  # a drain gives up instead
                elif not self._turn(state):  # nothing was due
                    state.rest()  # a drain is done instead
        return state.totals

    @contextlib.contextmanager
    def _running(
        self, stop: threading.Event, drain: bool, on_batch: Callable[[BatchStats], None] | None
    ) -> Iterator[_Run]:
        """The components of a run: the wake-up, one outage tracker per resource, the
        pipeline and (unless draining) the retention thread; stopped at the end."""
        wakeup = WakeUp(
            stop,
            functools.partial(db.listen, self.using),
            outbox_settings.POLL_INTERVAL,
            using=self.using,
        )
        state = _Run(stop, drain, on_batch, wakeup, database=database_outage(self.using))
        state.pipeline = Pipeline(
            self.using,
            claim=self._claim,
            finalize=self._finalize,
            report=lambda done: state.tally(self._report(done)),
            threaded=db.supports_skip_locked(connections[self.using]),
        )
        if not drain:  # a drain leaves the table as it is, but for the rows it relays
            interval = outbox_settings.CLEANUP_INTERVAL
            state.retention_thread = retention.RetentionThread(
                self.using, interval=interval, first_in=random.uniform(0, interval)
            )
            state.retention_thread.start()
            state.heartbeat = HeartbeatThread(
                Heartbeat(WorkerKind.RELAY, self.worker, self.using),
                state.snapshot,
                after_beat=functools.partial(_sample, self.using),
            )
            state.heartbeat.start()
        try:
            yield state
        finally:
            self._stopped(state)

    def _stopped(self, state: _Run) -> None:
        """Settle the pipeline, stop retention, close the listener and the brokers."""
        try:
            state.pipeline.close()
        finally:
            if state.retention_thread is not None:
                state.retention_thread.stop()
            if state.heartbeat is not None:
                state.heartbeat.stop()
            state.wakeup.close()
            self._paused, self._waiting = {}, {}
            self.close()

    def _turn(self, state: _Run) -> bool:
        """Publish a batch, or ride out a database error; False when the relay is to
        rest: nothing was due, or the batch caught up with what was (``_Run.caught_up``)."""
        try:
            batch = self._next_batch(state)
        except DatabaseError as exc:
            self._database_failed(state, exc)
            return True
        if batch is not None:
            for kind in _kinds_of(batch.transient_failures):
                state.broker(kind).suspect()
            for kind, destinations in batch.stalled.items():  # down, not only suspected
                state.retry_at.setdefault(kind, time.monotonic())  # check it next
                state.stalled.setdefault(kind, set()).update(destinations)
            if state.queues:  # only while a queue stalled: a pass over every message
                state.queues_confirmed(batch.confirmed)
        return batch is not None and not state.caught_up

    def _next_batch(self, state: _Run) -> _Batch | None:
        """One batch: take the claim made ahead (or claim now), claim the next one ahead
        when this one was full, publish, and hand the batch to the pipeline, which
        reports the batches it finished. Returns the batch, or None when nothing was due."""
        if state.ahead is not None:
            claim, state.ahead = state.ahead(), None
            settled = False  # made beside the batch before it
        else:
            if not state.drain:
                state.wakeup.listen()
            settled = state.settled()
            claim = self._claim()
        if claim is None and (state.pipeline.pending or state.drain):
            # The heads of ordered keys may be in the batch still being finalized:
            # finish it and claim once more (whole, draining) before taking the table
            # for empty.
            state.pipeline.collect(everything=True)
            settled = state.settled()  # True, and the batches collected forgotten
            claim = self._claim(whole=state.drain)
        batch, state.caught_up, state.due_at = None, False, _due_at(claim)
        if claim is not None:
            more_due = len(claim.messages) == self.batch_size
            if more_due and not (state.stop.is_set() or state.brokers_down()):
                state.ahead = state.pipeline.claim_ahead()
            # The batch before the last one is reported now, while the next claim runs.
            state.pipeline.collect(everything=False)
            batch = self._publish_claim(claim)
            frees = _frees_rows(batch)
            state.freeing |= frees
            state.caught_up = settled and not (more_due or frees) and _caught_up(state, claim)
            state.pipeline.finalize(batch, gate=batch.ordered, here=state.caught_up)
        if state.caught_up and (
            state.wakeup.wait(min(CAUGHT_UP_WAIT, state.until_due())) or not state.wakeup.heard
        ):
            # A NOTIFY came (or the listener broke): claim at once, as after a batch that
            # did not catch up.
            state.caught_up = False
        if batch is None or state.caught_up or not state.pipeline.threaded:
            # Before the rest, and, without database threads, before the next claim (which
            # would miss the rows this batch frees: an ordered key's next ones).
            state.pipeline.collect(everything=True)
        state.database.recovered()
        return batch

    def _database_failed(self, state: _Run, exc: DatabaseError) -> None:
        """Log the outage, give up the claim made ahead (its rows wait for their lease),
        settle the pipeline, close every connection of this relay (every thread's and the
        listener's: the outage broke those not in use too), and back off."""
        state.database.failed(exc)
        state.ahead = None
        state.pipeline.settle()
        connections[self.using].close()
        state.pipeline.close_connection()
        state.wakeup.close()
        state.stop.wait(state.database.backoff())

    def _broker_ready(self, state: _Run) -> bool:
        """Whether to go on publishing: yes with a claim made ahead (it is published
        whatever the brokers' state), or while a broker is up. Brokers that are down
        and due are tried again; the rows of those still down are not attempted."""
        now = time.monotonic()
        if state.ahead is not None:
            # Its rows are not attempted on a broker known to be down (that stalled, or
            # failed its check), but are on one only suspected (a message refused).
            self._pause(state, [kind for kind in state.brokers_down() if kind in state.retry_at])
            return True
        for kind in state.brokers_down():
            if now >= state.retry_at.get(kind, 0.0):
                self._try_broker(state, kind)
        down = state.brokers_down()
        self._pause(state, down)
        if state.totals.gave_up:
            return False  # a drain gives up on a broker that is down
        kinds = {*self._transports, *self._brokers, *(["celery"] if self._celery_routes else [])}
        return not down or kinds > set(down)  # wait only when every broker is down

    def _pause(self, state: _Run, down: list[str]) -> None:
        """Set the rows of the brokers ``down`` aside until each is tried again (and say
        which of them are out of memory), and those of the queues that stalled."""
        now = time.monotonic()
        self._paused = {kind: state.retry_at[kind] - now for kind in down}
        self._full = {kind for kind in down if state.broker(kind).condition == "out of memory"}
        self._waiting = state.queues_waiting(now)

    def _try_broker(self, state: _Run, kind: str) -> None:
        """Check the broker of transport ``kind`` again. When it is still down, a relay
        logs the outage (once) and sets when to try next; a drain records why it gives up.
        When it answers (with confirms: it confirmed a probe), the destinations that
        stalled on it since the last check had a queue that stalled, not their broker:
        each is backed off on its own."""
        tracker = state.broker(kind)
        try:
            self._transports[kind].check()
        except Exception as exc:  # any connect error: still down
            state.stalled.pop(kind, None)  # the broker's outage explains their stall
            if state.drain:
                state.totals.gave_up = self._unreachable(kind, exc)
            else:
                tracker.failed(exc)
            state.retry_at[kind] = time.monotonic() + tracker.backoff()
            return
        tracker.recovered()
        state.retry_at.pop(kind, None)
        stalled = state.stalled.pop(kind, set())
        if self._transports[kind].supports_confirms:  # its check had a probe confirmed
            for destination in sorted(stalled):
                state.queue_stalled(destination)

    def _unreachable(self, kind: str, exc: Exception) -> str:
        """Why the broker of transport ``kind`` (a broker alias, or "celery") cannot be
        reached, with its URL masked; a broker of ``OUTBOX["BROKERS"]`` by its alias."""
        if isinstance(exc, BrokerUnreachable) and isinstance(exc.__cause__, Exception):
            exc = exc.__cause__  # the transport's check named the broker: said below
        return f"{self._describe(kind)} is unreachable ({Failure.from_exception(exc).error})"

    def _describe(self, kind: str) -> str:
        """The broker of transport ``kind``, as errors name it (its URL masked)."""
        known = self._brokers.get(kind)
        if kind == "celery":
            broker = "Celery's broker"
        elif known is None:
            broker = "the broker" if kind == DEFAULT_BROKER else f"the broker {kind!r}"
        elif known.named:
            broker = f"the broker {kind!r} ({mask_url(known.url)})"
        else:
            broker = f"the broker {mask_url(known.url)}"
        return broker


#: The interpreter's thread switch interval while :meth:`Relay.run` runs (seconds;
#: CPython's default is 5 ms). The relay's thread publishes in pure Python for
#: milliseconds on end, and a database thread whose statement came back waited up to the
#: interval for the GIL before it could read the rows and send the next claim. In eight
#: alternated Redis drains of 20,000 events each, 1 ms against 5: `redis_vs_pipeline`
#: 0.287 against 0.274 (six pairs in favour).
SWITCH_INTERVAL = 0.001


@contextlib.contextmanager
def _quick_switches() -> Iterator[None]:
    """Run with a switch interval of at most :data:`SWITCH_INTERVAL`; the one before is
    set back at the end."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


#: Seconds a relay whose batch caught up (finalized at once, on the relay's thread) waits
#: for a NOTIFY before it rests: a commit meanwhile is claimed at once, without the rest's
#: connection checks, and the batch is reported before the rest.
CAUGHT_UP_WAIT = 0.05


def _frees_rows(batch: _Batch) -> bool:
    """Whether finalizing ``batch`` may make rows due: the next rows of its ordered keys,
    or a failed row due again at once (held back, or not attempted)."""
    return batch.ordered or not all(outcome is None for outcome in batch.outcomes)


def _due_at(claim: _Claim | None) -> float | None:
    """When the first row not due at ``claim`` comes due (``_Run.due_at``)."""
    if claim is None:
        return None
    seconds = claim.messages.next_due_in
    return math.inf if seconds is None else claim.started + seconds


def _caught_up(state: _Run, claim: _Claim) -> bool:
    """Whether a batch that frees no rows, whose claim was neither full nor made beside a
    finalize that may free rows, left nothing due that a NOTIFY would not announce: its
    claim left no row out, and NOTIFYs reach the relay (its listener has heard one). A
    drain and a relay that only polls claim until a claim comes back empty."""
    if claim.messages.left_behind or state.drain:
        return False
    return state.wakeup.heard


def _sample(using: str) -> None:
    """Take this minute's sample of the outbox (the admin's chart) unless another relay
    took it. On the heartbeat's thread: nothing raised here may end it, and nothing here
    touches the relay's batches."""
    try:
        samples.record_sample(using)
    except DatabaseError as exc:  # an outage: the relay's loop reports it
        logger.debug("sample not taken: %s", exc, extra={"action": "outbox.sample_failed"})
    except Exception:
        logger.exception("sample not taken", extra={"action": "outbox.sample_failed"})


def _publish_order(message: ClaimedMessage) -> tuple[str, bool, str, int]:
    """The order a batch is published in: by destination, unordered rows by id, then
    each key's ordered rows in sequence order (the order they must reach the broker)."""
    if message.sequence is None:
        return (message.destination, False, "", message.id)
    return (message.destination, True, message.ordering_key, message.sequence)


def _held_back(messages: Sequence[ClaimedMessage], outcomes: Sequence[Outcome]) -> set[int]:
    """The ids of the ordered rows published or not that must go out again after
    their key's first failure in the batch: every row of the key after it in sequence
    order. The failed row is recorded as failed, the prefix before it as published."""
    failed_at: dict[tuple[str, str], int] = {}
    for message, outcome in zip(messages, outcomes, strict=True):
        if outcome is not None and message.sequence is not None:
            scope = (message.destination, message.ordering_key)
            failed_at[scope] = min(failed_at.get(scope, message.sequence), message.sequence)
    return {
        m.id
        for m in messages
        if m.sequence is not None
        and m.sequence > failed_at.get((m.destination, m.ordering_key), m.sequence)
    }


def _rows(parts: list[_Failed]) -> int:
    return sum(len(part.messages) for part in parts)


def _by_destination(messages: list[ClaimedMessage]) -> dict[str, list[ClaimedMessage]]:
    by_destination: dict[str, list[ClaimedMessage]] = {}
    for message in messages:
        by_destination.setdefault(message.destination, []).append(message)
    return by_destination


#: The failure of an event whose headers are no JSON object: a row written around
#: ``stage()`` (raw SQL, ``objects.create``), which no transport nor the tracing can read.
MALFORMED_HEADERS = Failure(
    "the event's headers are not a JSON object (the row was not written by stage())",
    permanent=True,
    kind="malformed_headers",
)


def _refusing_malformed(
    batch: list[ClaimedMessage], publish: Callable[[list[ClaimedMessage]], list[Outcome]]
) -> list[Outcome]:
    """Fail the messages of ``batch`` whose headers are not a dict for good (they would
    fail every attempt, or stop the relay in the tracing), and ``publish`` the others."""
    readable = [message for message in batch if type(message.headers) is dict]
    published = iter(publish(readable) if readable else [])
    return [
        next(published) if type(message.headers) is dict else MALFORMED_HEADERS for message in batch
    ]


def _trace_failures(span: tracing.SendSpan, results: Sequence[Outcome]) -> None:
    """Mark ``span`` failed when some of its messages were not published: ``error.type``
    is the first failure's :attr:`~Failure.error_type`, the value the metrics label it by."""
    failures = [result for result in results if result is not None]
    if failures:
        span.failed(failures[0].error_type, f"{len(failures)} of {len(results)} not published")


def _kind(route: Route) -> str:
    """The key of ``route``'s transport: its broker alias, or "celery"."""
    return "celery" if route.is_celery else route.broker


def _kinds_of(messages: list[ClaimedMessage]) -> set[str]:
    """The transports (broker aliases, "celery") that ``messages`` are routed through."""
    routes = map(outbox_settings.route_for, {m.destination for m in messages})
    return {_kind(route) for route in routes if route is not None}


def _refuse_unknown_keys(transports: dict[str, Transport]) -> None:
    """Refuse given transports under a key that is neither a broker alias (of
    ``OUTBOX["BROKERS"]`` or named by a route) nor ``"celery"``: the relay would
    never use them and would publish through a broker built from the settings."""
    known = {"celery", *outbox_settings.broker_aliases(), *outbox_settings.brokers}
    if unknown := sorted(set(transports) - known):
        raise OutboxConfigurationError(
            f"Relay(transports=...) has no broker {', '.join(map(repr, unknown))}: its keys "
            f"are broker aliases ({', '.join(sorted(known - {'celery'}))}) or 'celery'"
        )
