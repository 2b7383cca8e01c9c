"""What ``outbox_status`` reports (counts per state, backlog age, failing attempts, busy
keys, blocked keys, the most frequent recent errors, parked inbox messages), the blocked
keys and the cheaper summary the
admin shows above its list, and the rows waiting for a retry that
``run_outbox_relay --once/--drain`` report."""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterable
from typing import Any

from django.db import connections
from django.db.models import Case, Count, F, Max, Min, OuterRef, Subquery, Value, When
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from ..db import (
    EXACT_COUNT_LIMIT,
    RowCount,
    count_rows,
    estimated,
    infers_partial_indexes,
    read_backlog,
)
from ..models import (
    DUE_INDEX_STATES,
    KEY_UNFINISHED,
    InboxFailure,
    OutboxMessage,
    OutboxQuerySet,
    OutboxStatus,
)
from .store import heads

TOP_KEYS = 10
#: The errors of how many of the latest FAILED rows (and as many ABANDONED rows) are read.
RECENT_ROWS = 1000
TOP_ERRORS = 5
TOP_CONSUMERS = 10
#: How many blocked keys ``outbox_status`` and the admin list, longest blocked first.
TOP_BLOCKED = 20


@dataclasses.dataclass(frozen=True)
class ErrorCount:
    """How many of the recent rows in ``status`` have ``error`` as their ``last_error``."""

    status: str
    error: str
    rows: int


@dataclasses.dataclass(frozen=True)
class ParkedCount:
    """A consumer's parked inbox messages: how many, and the newest one's error."""

    consumer: str
    rows: int
    newest_at: dt.datetime
    newest_error: str


@dataclasses.dataclass(frozen=True)
class RetryWait:
    """FAILED rows waiting out their backoff, and how long until the first is due."""

    rows: RowCount
    next_due_in: dt.timedelta | None


@dataclasses.dataclass(frozen=True)
class BlockedKey:
    """An ordered key whose head is ABANDONED: nothing of the key is published until an
    operator requeues or skips the head (``outbox_skip``, the admin)."""

    destination: str
    ordering_key: str
    head_id: int
    event_id: uuid.UUID
    sequence: int
    error: str  # the head's last_error
    blocked_for: dt.timedelta | None  # since the head was abandoned (None: no abandoned_at)
    waiting: int  # the key's unpublished events behind the head


@dataclasses.dataclass(frozen=True)
class BlockedKeys:
    """How many keys are blocked, and the ``top`` blocked longest."""

    count: RowCount
    keys: list[BlockedKey]


@dataclasses.dataclass(frozen=True)
class StatusReport:
    counts: dict[str, int]  # every state, zero included
    oldest_due_age: dt.timedelta | None  # how long the oldest due row has waited
    failing_attempts: dict[int, int]  # attempts -> FAILED rows
    top_keys: list[tuple[str, int]]  # ordering keys with most rows waiting (pending + failed)
    recent_errors: list[ErrorCount]  # the most frequent errors of recent failed/abandoned rows
    parked: list[ParkedCount]  # parked inbox messages per consumer, most first
    blocked: BlockedKeys  # ordered keys whose head is ABANDONED, longest blocked first
    #: PENDING rows not due yet (scheduled events), not in ``counts["pending"]``.
    scheduled: int = 0


@dataclasses.dataclass(frozen=True)
class Summary:
    #: Each state asked for, zero included; large ones estimates. PENDING counts the
    #: rows due (the backlog): the scheduled ones are apart, in ``scheduled``.
    counts: dict[str, RowCount]
    oldest_due_age: dt.timedelta | None  # how long the oldest due row has waited
    blocked: RowCount | None = None  # the blocked keys, when asked for
    #: PENDING rows not due yet (scheduled events), when PENDING is asked for.
    scheduled: RowCount | None = None


#: Not a state: the PENDING rows whose ``available_at`` is to come (scheduled events),
#: counted apart from the backlog's PENDING rows (those due).
SCHEDULED = "scheduled"


def oldest_due_age(rows: OutboxQuerySet) -> dt.timedelta | None:
    """How long the oldest due row has waited (:func:`oldest_due` without its error)."""
    oldest = oldest_due(rows)
    return None if oldest is None else oldest[0]


def oldest_due(rows: OutboxQuerySet) -> tuple[dt.timedelta, str] | None:
    """How long the oldest due row has waited and its last error ("" when never
    tried), both read from that one row (a relay claiming it between two reads cannot
    part them), or None when nothing is due: one probe of each due index."""
    firsts = [
        part.order_by("available_at").values_list("available_at", "last_error").first()
        for part in _by_due_index(rows.due())
    ]
    found = [first for first in firsts if first is not None]
    if not found:
        return None
    at, error = min(found, key=lambda first: first[0])
    return max(timezone.now() - at, dt.timedelta(0)), error


def _waited(oldest: Iterable[dt.datetime | None]) -> dt.timedelta | None:
    """How long the oldest of ``oldest`` (None: nothing there) has waited."""
    found = [at for at in oldest if at is not None]
    return max(timezone.now() - min(found), dt.timedelta(0)) if found else None


def _by_due_index(rows: OutboxQuerySet) -> list[OutboxQuerySet]:
    """``rows`` (PENDING, PROCESSING or FAILED ones) in the parts PostgreSQL reads each
    through one due index: those without a sequence (``outbox_due_idx``) and those with
    one (``outbox_ordered_due_idx``); no one index holds both. ``rows`` whole on a
    database that cannot infer a partial index (SQLite: it would scan twice)."""
    if not infers_partial_indexes(connections[rows.db]):
        return [rows]
    return [rows.filter(sequence__isnull=True), rows.filter(sequence__isnull=False)]


def _count_by_due_index(rows: OutboxQuerySet) -> RowCount:
    """``count_rows`` of ``rows`` part by part (:func:`_by_due_index`), exact up to
    ``EXACT_COUNT_LIMIT`` rows in all: each part counts up to what the others left."""
    total, exact = 0, True
    for part in _by_due_index(rows):
        count = count_rows(part, exact_up_to=max(EXACT_COUNT_LIMIT - total, 0))
        total, exact = total + count.value, exact and count.exact
    return RowCount(total, exact)


def summary(
    using: str = "default", states: Iterable[str] = tuple(OutboxStatus), *, blocked: bool = False
) -> Summary:
    """Counts of ``states`` (every state unless told), the backlog age and with
    ``blocked`` the blocked keys, cheap on any table size: each count is read from
    indexes (:func:`count_state`). On PostgreSQL one statement reads them all
    (:func:`_read_summary`). With PENDING, its count is the rows due (the backlog),
    and ``scheduled`` the rows not due yet: two ranges of the due indexes."""
    states = tuple(str(status) for status in states)
    counted = (*states, SCHEDULED) if OutboxStatus.PENDING in states else states
    read = _read_summary(using, counted, blocked)
    if read is None:
        rows = OutboxMessage.objects.using(using)
        read = Summary(
            counts={status: _count_backlog(rows, status) for status in counted},
            oldest_due_age=oldest_due_age(rows),
            blocked=blocked_count(using) if blocked else None,
        )
    scheduled = read.counts.pop(SCHEDULED, None)
    return dataclasses.replace(read, scheduled=scheduled)


def _backlog_rows(rows: OutboxQuerySet, status: str) -> OutboxQuerySet:
    """The rows of ``status`` as the backlog counts them: PENDING ones due (the due
    indexes' range up to now), the scheduled ones (``SCHEDULED``: the range after it)."""
    if status == SCHEDULED:
        return rows.in_states(OutboxStatus.PENDING).filter(available_at__gt=Now())
    matching = rows.in_states(status)
    return matching.filter(available_at__lte=Now()) if status == OutboxStatus.PENDING else matching


def _count_backlog(rows: OutboxQuerySet, status: str) -> RowCount:
    """:func:`count_state` of :func:`_backlog_rows`."""
    if status in (*DUE_INDEX_STATES, SCHEDULED):
        return _count_by_due_index(_backlog_rows(rows, status))
    return count_rows(_backlog_rows(rows, status))


def _read_summary(using: str, states: tuple[str, ...], blocked: bool) -> Summary | None:
    """:func:`summary` from one statement (``db.read_backlog``: the same index reads as
    :func:`count_state`, :func:`oldest_due_age` and :func:`blocked_count`, without
    building nine ORM queries: most of a scrape's CPU). Each part is counted up to
    ``EXACT_COUNT_LIMIT`` + 1: a state whose parts add up to at most the limit is
    exact; past it, each part past the limit is the planner's estimate. None where the
    database has no such statement."""
    parts = tuple(
        (status, ordered)
        for status in dict.fromkeys(states)
        for ordered in ((False, True) if status in (*DUE_INDEX_STATES, SCHEDULED) else (None,))
    )
    figures = read_backlog(using, parts, limit=EXACT_COUNT_LIMIT, blocked=blocked)
    if figures is None:
        return None
    rows = OutboxMessage.objects.using(using)
    counts = {status: RowCount(0, exact=True) for status in states}
    for (status, ordered), seen in zip(parts, figures, strict=False):
        part = _backlog_rows(rows, status)
        if ordered is not None:
            part = part.filter(sequence__isnull=not ordered)
        counts[status] = _add(counts[status], _bounded(part, seen))
    return Summary(
        counts={
            status: count if count.value <= EXACT_COUNT_LIMIT else RowCount(count.value, False)
            for status, count in counts.items()
        },
        oldest_due_age=_waited(figures[len(parts) : len(parts) + 2]),
        blocked=_bounded(heads(rows.abandoned()), figures[-1]) if blocked else None,
    )


def _bounded(rows: OutboxQuerySet, seen: int) -> RowCount:
    """``seen`` of ``rows``, counted up to ``EXACT_COUNT_LIMIT`` + 1: exact up to the
    limit, past it the planner's estimate."""
    return RowCount(seen, exact=True) if seen <= EXACT_COUNT_LIMIT else estimated(rows, seen)


def _add(one: RowCount, other: RowCount) -> RowCount:
    return RowCount(one.value + other.value, one.exact and other.exact)


def count_state(rows: OutboxQuerySet, status: str) -> RowCount:
    """How many of ``rows`` are in ``status``, on PostgreSQL through an index, never by
    a scan of the table: a state's partial index, or for PENDING and PROCESSING the due
    indexes (:func:`_by_due_index`; their entries' rows are read for the status, but
    published rows are in neither, where a count by status alone scans them all).
    Exact up to ``EXACT_COUNT_LIMIT`` rows, past which the planner's estimate stands in
    (see ``count_rows``)."""
    matching = rows.in_states(status)
    if status in DUE_INDEX_STATES:
        return _count_by_due_index(matching)
    return count_rows(matching)


def report(using: str = "default", *, top: int = TOP_KEYS) -> StatusReport:
    rows = OutboxMessage.objects.using(using)
    counts = {status.value: 0 for status in OutboxStatus}
    state = Case(  # the scheduled events apart from the PENDING rows due
        When(status=OutboxStatus.PENDING, available_at__gt=Now(), then=Value(SCHEDULED)),
        default=F("status"),
    )
    by_state = rows.order_by().annotate(state=state).values("state").annotate(n=Count("id"))
    counts.update(by_state.values_list("state", "n"))
    scheduled = counts.pop(SCHEDULED, 0)
    return StatusReport(
        scheduled=scheduled,
        counts=counts,
        oldest_due_age=oldest_due_age(rows),
        failing_attempts=dict(
            rows.failed()
            .order_by("attempts")
            .values_list("attempts")
            .annotate(n=Count("id"))
            .values_list("attempts", "n")
        ),
        top_keys=list(
            rows.filter(status__in=(OutboxStatus.PENDING, OutboxStatus.FAILED))
            .exclude(ordering_key="")
            .order_by()
            .values_list("ordering_key")
            .annotate(n=Count("id"))
            .order_by("-n", "ordering_key")
            .values_list("ordering_key", "n")[:top]
        ),
        recent_errors=recent_errors(rows),
        parked=parked_by_consumer(using),
        blocked=blocked_keys(using),
    )


def blocked_keys(using: str = "default", *, top: int = TOP_BLOCKED) -> BlockedKeys:
    """The ordered keys whose head is ABANDONED (blocked: see ``store.heads``), the
    ``top`` blocked longest first, each with the head's error, how long it has been
    blocked and how many events wait behind it; and how many keys are blocked.

    ABANDONED rows are read through ``outbox_abandoned_idx``, each probed for an
    earlier unfinished row of its key, and the events behind a listed head counted,
    through ``outbox_key_unfinished_idx``."""
    rows = OutboxMessage.objects.using(using)
    behind = (
        rows.filter(
            destination=OuterRef("destination"),
            ordering_key=OuterRef("ordering_key"),
            sequence__gt=OuterRef("sequence"),
        )
        .filter(KEY_UNFINISHED)
        .order_by()
        .values("destination")
        .annotate(n=Count("id"))
        .values("n")
    )
    blocked = heads(rows.abandoned())
    listed = (
        blocked.annotate(waiting=Coalesce(Subquery(behind), 0))
        .order_by("abandoned_at", "id")
        .values(*_BLOCKED_COLUMNS)[:top]
    )
    now = timezone.now()
    return BlockedKeys(count=count_rows(blocked), keys=[_blocked_key(row, now) for row in listed])


def blocked_count(using: str = "default") -> RowCount:
    """How many ordered keys are blocked (their head ABANDONED), without listing them."""
    return count_rows(heads(OutboxMessage.objects.using(using).abandoned()))


_BLOCKED_COLUMNS = (
    "destination",
    "ordering_key",
    "id",
    "event_id",
    "sequence",
    "last_error",
    "abandoned_at",
    "waiting",
)


def _blocked_key(row: dict[str, Any], now: dt.datetime) -> BlockedKey:
    since = row["abandoned_at"]
    return BlockedKey(
        destination=row["destination"],
        ordering_key=row["ordering_key"],
        head_id=row["id"],
        event_id=row["event_id"],
        sequence=row["sequence"],
        error=row["last_error"],
        blocked_for=None if since is None else max(now - since, dt.timedelta(0)),
        waiting=row["waiting"],
    )


def recent_errors(rows: OutboxQuerySet, *, top: int = TOP_ERRORS) -> list[ErrorCount]:
    """The ``top`` most frequent ``last_error`` texts of the latest ``RECENT_ROWS`` FAILED
    rows and the latest ``RECENT_ROWS`` ABANDONED rows, most rows first.

    A bounded window, each read through a partial index that holds only rows of its
    state, so it costs the same on a table of millions of published or pending rows:
    ABANDONED rows newest first through ``outbox_abandoned_idx``; FAILED rows latest
    retry first (the latest failures) through ``outbox_failed_idx``.
    """
    latest = (
        (OutboxStatus.FAILED, rows.failed().order_by("-available_at")),
        (OutboxStatus.ABANDONED, rows.abandoned().order_by("-abandoned_at")),
    )
    counts = collections.Counter(
        (status.value, error)
        for status, ordered in latest
        for error in ordered.values_list("last_error", flat=True)[:RECENT_ROWS]
    )
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [ErrorCount(status, error, n) for (status, error), n in ranked[:top]]


def parked_by_consumer(using: str = "default", *, top: int = TOP_CONSUMERS) -> list[ParkedCount]:
    """Parked inbox messages per consumer (the ``top`` consumers with most), with the
    newest one's error. Parked rows are read through ``inbox_failure_parked_idx``; they
    are dead letters, few unless a handler is broken."""
    parked = InboxFailure.objects.using(using).parked()
    groups = (
        parked.order_by()
        .values_list("consumer")
        .annotate(n=Count("id"), newest=Max("parked_at"))
        .order_by("-n", "consumer")
        .values_list("consumer", "n", "newest")[:top]
    )
    return [
        ParkedCount(
            consumer,
            n,
            newest,
            parked.filter(consumer=consumer)
            .order_by("-parked_at", "-id")
            .values_list("last_error", flat=True)[0],
        )
        for consumer, n, newest in groups
    ]


def retry_wait(using: str = "default") -> RetryWait:
    """FAILED rows whose retry is not due yet, and how long until the first one is: a
    range of ``outbox_failed_idx`` (``available_at`` after now)."""
    waiting = OutboxMessage.objects.using(using).failed().filter(available_at__gt=Now())
    first = waiting.aggregate(first=Min("available_at"))["first"]
    return RetryWait(
        rows=count_rows(waiting),
        next_due_in=None if first is None else max(first - timezone.now(), dt.timedelta(0)),
    )


def due_count(using: str = "default") -> int:
    """How many rows are due now, exactly (a drain's progress total), each part read
    through its due index (:func:`_by_due_index`) rather than by a scan of the table."""
    return sum(part.count() for part in _by_due_index(OutboxMessage.objects.using(using).due()))


def due_rows(using: str = "default") -> RowCount:
    """Rows due now, which a relay would claim (through the due indexes): what a
    drain that stopped early (the broker unreachable, a signal) left untried."""
    return _count_by_due_index(OutboxMessage.objects.using(using).due())
