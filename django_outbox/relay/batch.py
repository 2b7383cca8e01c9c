"""One batch's work: claim due rows under a lease token, publish them (by
:class:`~django_outbox.relay.publish.Publisher`), and finalize them, every write
filtered by the token, so a relay whose lease was taken over changes nothing; then
report it (:class:`~django_outbox.relay.report.Reporter`).

:class:`Batches` is made afresh for each run of a relay (and each ``run_once()``): it
keeps the run's claim schedule and the ids its claims read, nothing else. Its methods
are what the pipeline (:class:`~django_outbox.pipeline.Pipeline`) is given: ``claim``
on the claim thread, ``finalize`` on the finalize thread, ``publish`` on the relay's.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence

from ..conf import outbox_settings
from ..envelope import ClaimedBatch, ClaimedMessage
from ..state import store
from ..state.retry import RetryPolicy
from ..state.store import Window
from ..transports.base import Failure, Outcome
from .outages import Outages
from .publish import Publisher
from .report import BatchStats, Failed, Finalized, Reporter

#: How often a relay reads again the ids its claims read (a partitioned outbox's
#: window, :func:`django_outbox.state.store.claim_window`): a row requeued in a range
#: below it waits at most this long.
CLAIM_WINDOW_SECONDS = 10.0


@dataclasses.dataclass(frozen=True)
class Claim:
    """Rows claimed under one lease token; publishing must start before ``deadline``
    (monotonic clock: half the lease after the claim)."""

    messages: ClaimedBatch  # with left_behind: its bounds left due rows out
    token: uuid.UUID
    deadline: float
    started: float  # monotonic clock: when the claim began
    ordered: bool  # it holds ordered rows (only a whole claim can)


@dataclasses.dataclass(frozen=True)
class Batch:
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

    @property
    def transport_failed(self) -> bool:
        """A publish was tried and failed transiently, or its broker did not take it (an
        outage failure): the broker may be down."""
        return any(
            outcome is not None
            and message.destination in self.tried
            and (outcome.outage or (outcome.counts and not outcome.permanent))
            for message, outcome in zip(self.messages, self.outcomes, strict=True)
        )

    @property
    def frees_rows(self) -> bool:
        """Whether finalizing it may make rows due: the next rows of its ordered keys, or
        a failed row due again at once (held back, or not attempted)."""
        return self.ordered or not all(outcome is None for outcome in self.outcomes)


@dataclasses.dataclass
class Batches:
    """The batches of one run of the relay of database ``using``: claims them (up to
    ``batch_size`` rows, leased for ``lease_seconds`` to ``worker``), publishes them
    through ``publisher``, finalizes them (a failed row is retried after ``policy``) and
    reports them.

    A claim is whole (ordered rows too) when asked, when the settings order a route
    (``orders``), when the last whole claim is ``POLL_INTERVAL`` old, or less than that
    after a claim found ordered rows; otherwise it takes unordered rows only, with a
    statement cheaper to plan (a key's next rows are hidden while its batch is in flight).
    """

    using: str
    batch_size: int
    worker: str
    policy: RetryPolicy
    lease_seconds: float
    publisher: Publisher
    orders: bool
    #: When the claim is next whole, and until when claims are whole after one found
    #: ordered rows (monotonic clock).
    _whole_claim_at: float = dataclasses.field(default=0.0, init=False, repr=False)
    _ordered_until: float = dataclasses.field(default=0.0, init=False, repr=False)
    #: The ids the claims read (a partitioned outbox's: store.claim_window), and when
    #: it is read again (monotonic clock).
    _window: Window | None = dataclasses.field(default=None, init=False, repr=False)
    _window_until: float = dataclasses.field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self._reporter = Reporter(self.using, self.worker, self.policy)

    def claim(self, whole: bool = False) -> Claim | None:
        """Claim a batch (``whole``: ordered rows too, whatever the schedule); None when
        nothing is due."""
        token, started = uuid.uuid4(), time.monotonic()
        whole = whole or self.orders or not self._ordered_until < started < self._whole_claim_at
        if started >= self._window_until:
            self._window = store.claim_window(self.using)
            self._window_until = started + CLAIM_WINDOW_SECONDS
        messages = store.claim(
            self.using,
            limit=self.batch_size,
            lease_seconds=self.lease_seconds,
            worker=self.worker,
            token=token,
            ordered=whole,
            window=self._window,
        )
        ordered = whole and any(message.sequence is not None for message in messages)
        if whole:
            self._whole_claim_at = started + outbox_settings.POLL_INTERVAL
            if ordered:
                self._ordered_until = self._whole_claim_at
        if not messages:
            return None
        deadline = time.monotonic() + self.lease_seconds / 2
        self.publisher.prepare(messages)  # their wire form, while the batch before is sent
        return Claim(messages, token, deadline, started, ordered)

    def publish(self, claim: Claim, outages: Outages) -> Batch:
        """Publish ``claim`` but for what ``outages`` blocks (which learns how it went)."""
        outcomes, tried = self.publisher.publish(
            claim.messages,
            deadline=claim.deadline,
            lease_seconds=self.lease_seconds,
            outages=outages,
        )
        return Batch(claim.messages, outcomes, claim.token, tried, claim.started, claim.ordered)

    def finalize(self, batch: Batch) -> Finalized:
        """Record the outcomes: a batch's database writes only (maybe on the finalize thread)."""
        messages, token = batch.messages, batch.token
        held = _held_back(messages, batch.outcomes)
        published = [
            m
            for m, out in zip(messages, batch.outcomes, strict=True)
            if out is None and m.id not in held
        ]
        written = self._failed(batch, held)
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
        if self.publisher.has_transactional:
            self._settle(published, lost_ids)
        return Finalized(
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

    def _settle(self, published: list[ClaimedMessage], lost_ids: set[int]) -> None:
        """Tell the transactional routes which rows are marked PUBLISHED (they leave the
        Kafka record), and which another relay took over (they stay in it for a lease,
        while that relay decides)."""
        marked = [str(m.event_id) for m in published if m.id not in lost_ids]
        self.publisher.settle(marked)
        taken = [str(m.event_id) for m in published if m.id in lost_ids]
        self.publisher.settle(taken, linger=self.lease_seconds)

    def report(self, done: Finalized) -> BatchStats:
        """Log and signal what a finalized batch did; returns its stats."""
        return self._reporter.report(done)

    def _failed(self, batch: Batch, held: set[int]) -> list[Failed]:
        """The rows of ``batch`` not published nor ``held``, grouped by failure, fate and
        attempts: rows that failed alike are written with one UPDATE."""
        failures: dict[tuple[Failure, bool, int], list[ClaimedMessage]] = {}
        for message, outcome in zip(batch.messages, batch.outcomes, strict=True):
            if outcome is not None and message.id not in held:
                attempts = message.attempts + (1 if outcome.counts else 0)
                abandon = outcome.permanent or (outcome.counts and self.policy.exhausted(attempts))
                failures.setdefault((outcome, abandon, attempts), []).append(message)
        return [
            Failed(failure, abandon, self._retry_delay(failure, abandon, attempts), group)
            for (failure, abandon, attempts), group in failures.items()
        ]

    def _retry_delay(self, failure: Failure, abandon: bool, attempts: int) -> float:
        """Seconds until a failed row is due again."""
        if abandon:
            return 0.0
        return self.policy.delay(attempts) if failure.counts else failure.retry_delay


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
