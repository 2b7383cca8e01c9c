"""The only place that knows which database is underneath.

Callers ask capability questions (``supports_skip_locked``) or call
operations that pick the vendor's way (the claim, the staging INSERT, LISTEN).
Vendor SQL lives in ``queries.sql`` (named queries, see :mod:`.queries`), run
by the submodules named after Django's ``connection.vendor``. Only
:mod:`django_outbox.state.store` calls :func:`claim`, :func:`mark_published` and
:func:`delete_published`. :mod:`.expressions` holds the database-clock expressions the
models, the store and retention share.

The package may import the models, the settings, the envelope and the leaves; nothing
that stages, relays, consumes or operates.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import DatabaseError, IntegrityError, connections, models, transaction
from django.db.models.constants import OnConflict
from django.db.models.functions import Cast, Now
from django.db.models.sql import InsertQuery
from django.utils import timezone

from ..conf import outbox_settings
from ..envelope import CLAIMED_FIELDS, ClaimedBatch, ClaimedMessage
from ..exceptions import OutboxConfigurationError
from . import partitions, postgresql
from .expressions import now_plus

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

    from ..models import OutboxMessage


class AnyOf(models.Lookup):
    """``AnyOf(F("id"), ids)`` in ``filter()``: the rows whose field is one of ``ids``.
    On PostgreSQL ``id = ANY(%s)`` with the ids as one array parameter: a finalize of
    500 rows parsed and planned as a short statement took 7.4 ms where ``IN`` with a
    parameter per id took 10.9 (and 4.0 ms of the relay's CPU instead of 1.3, before
    Django's own work per parameter). Elsewhere Django's ``IN``."""

    prepare_rhs = False

    def as_sql(self, compiler: Any, connection: BaseDatabaseWrapper) -> tuple[str, Any]:
        return compiler.compile(models.lookups.In(self.lhs, list(self.rhs)))

    def as_postgresql(self, compiler: Any, connection: BaseDatabaseWrapper) -> tuple[str, Any]:
        lhs, params = self.process_lhs(compiler, connection)
        return f"{lhs} = ANY(%s)", (*params, list(self.rhs))


#: Up to this many rows ``count_rows()`` counts exactly; past it, it asks for an estimate.
EXACT_COUNT_LIMIT = 10_000


def supports_skip_locked(connection: BaseDatabaseWrapper) -> bool:
    """Whether several relays can share this database (``SELECT ... FOR UPDATE SKIP LOCKED``)."""
    return bool(connection.features.has_select_for_update_skip_locked)


def in_memory(connection: BaseDatabaseWrapper) -> bool:
    """Whether the database lives in this process's memory (SQLite's ``:memory:``, what
    Django's test runner makes of an SQLite database): no other process can open it."""
    return bool(getattr(connection, "is_in_memory_db", lambda: False)())


def supports_notify(connection: BaseDatabaseWrapper) -> bool:
    """Whether staging wakes relays on commit (PostgreSQL ``NOTIFY``)."""
    return connection.vendor == "postgresql"


def supports_row_estimates(connection: BaseDatabaseWrapper) -> bool:
    """Whether the planner can say how many rows a query returns without running it."""
    return connection.vendor == "postgresql"


def infers_partial_indexes(connection: BaseDatabaseWrapper) -> bool:
    """Whether the planner reads a partial index for a query whose conditions imply the
    index's (``status = 'pending'`` implies ``status IN ('pending', ...)``). SQLite's
    takes one only for a query that repeats the index's condition word for word."""
    return connection.vendor == "postgresql"


@dataclasses.dataclass(frozen=True)
class RowCount:
    value: int
    exact: bool  # False: the planner's estimate, at least EXACT_COUNT_LIMIT + 1


def count_rows(queryset: models.QuerySet[Any], *, exact_up_to: int = EXACT_COUNT_LIMIT) -> RowCount:
    """How many rows ``queryset`` matches, reading at most ``exact_up_to + 1`` of them.

    ``COUNT(*)`` reads every matching row, which on a million-row outbox is the
    slowest query an admin page makes. Here the count stops after
    ``exact_up_to + 1`` rows (``SELECT COUNT(*) FROM (... LIMIT n)``); below
    that it is exact. Above it, PostgreSQL's planner estimate is returned
    (never less than the rows already seen). A database with no estimate
    (SQLite) gets the full count: it is not the home of million-row outboxes.
    """
    seen = queryset.order_by()[: exact_up_to + 1].count()
    if seen <= exact_up_to:
        return RowCount(seen, exact=True)
    if supports_row_estimates(connections[queryset.db]):
        return estimated(queryset, seen)
    return RowCount(queryset.count(), exact=True)


def estimated(queryset: models.QuerySet[Any], seen: int) -> RowCount:
    """PostgreSQL's estimate of the rows of ``queryset``, of which ``seen`` were counted
    before a limit stopped the count (never less than those)."""
    return RowCount(max(postgresql.estimated_rows(queryset), seen), exact=False)


def read_backlog(
    using: str, parts: tuple[postgresql.BacklogPart, ...], *, limit: int, blocked: bool
) -> list[Any] | None:
    """The backlog's figures in one statement (:func:`postgresql.backlog`: each part
    counted up to ``limit + 1``, the oldest due row of each due index, the blocked keys);
    None on a database without it, where the caller counts through the ORM."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return None
    return postgresql.backlog(connection, parts, limit=limit, blocked=blocked)


def oldest_snapshot(using: str) -> postgresql.Snapshot | None:
    """The session of database ``using`` holding its oldest snapshot
    (:func:`postgresql.oldest_snapshot`); None without one, or on a database whose
    vacuum no open snapshot holds back (SQLite)."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return None
    return postgresql.oldest_snapshot(connection)


def require_tables(using: str, *tables: type[models.Model]) -> None:
    """Refuse, naming the first missing table, a database where the tables of ``tables``
    do not exist (``migrate`` not run). A database that cannot be asked now passes: the
    caller's own handling of an outage says so."""
    connection = connections[using]
    try:
        with connection.cursor() as cursor:
            present = set(connection.introspection.table_names(cursor))
    except DatabaseError:
        return
    for model in tables:
        if model._meta.db_table not in present:
            option = "" if using == "default" else f" --database {using}"
            raise OutboxConfigurationError(
                f"database {using!r} has no table {model._meta.db_table}: django_outbox's "
                f"migrations are not applied there; run python manage.py migrate{option}"
            )


def claim(
    using: str,
    *,
    limit: int,
    lease_seconds: float,
    worker: str,
    token: uuid.UUID,
    max_bytes: int | None = None,
    ordered: bool = True,
    window: postgresql.Window | None = None,
) -> ClaimedBatch:
    """Claim up to ``limit`` due rows, oldest first, for ``lease_seconds``; with
    ``ordered`` False, rows of ordered routes are left alone; with a ``window``
    (:func:`claim_window`), rows of those ids only.

    The batch also stops before its payloads add up to more than ``max_bytes``
    of JSON text (default ``OUTBOX["MAX_BATCH_BYTES"]``), but always takes its
    first row, so a row larger than the bound goes out alone. Rows locked by
    another relay's claim in progress are skipped, not waited for. Claimed rows
    are PROCESSING with ``lease_token=token`` and ``locked_until`` = database
    now + lease. Returned in id order, with whether due rows were left out by the
    bounds (``left_behind``).
    """
    connection = connections[using]
    if max_bytes is None:
        max_bytes = outbox_settings.MAX_BATCH_BYTES
    if connection.vendor == "postgresql":
        return postgresql.claim(
            connection,
            limit,
            max_bytes,
            lease_seconds,
            worker,
            token,
            ordered=ordered,
            window=window,
        )
    return _claim_portable(using, limit, max_bytes, lease_seconds, worker, token, ordered=ordered)


def claim_window(using: str) -> postgresql.Window | None:
    """The ids a relay's claims may read on a partitioned outbox (PostgreSQL plans the
    partitions that hold them only: :func:`.partitions.claim_window`); None, all of
    them, on any other table."""
    return partitions.claim_window(connections[using])


def next_due_in(using: str) -> float | None:
    """Seconds until the first unfinished row that is not due yet (scheduled, or
    waiting out a retry) comes due, by the database clock; None when there is none.
    On PostgreSQL one statement of two index probes (:func:`.postgresql.next_due_in`;
    a claim that found rows returns the same figure), elsewhere the ORM."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        return postgresql.next_due_in(connection)
    return _next_due_portable(using)


def _next_due_portable(using: str) -> float | None:
    """:func:`next_due_in` through the ORM, by the clock of ``Now()`` (which stages the
    rows: SQLite's ``CURRENT_TIMESTAMP`` has whole seconds) and this host's (SQLite's
    database is on it)."""
    from ..models import UNFINISHED, OutboxMessage

    later = OutboxMessage.objects.using(using).filter(UNFINISHED, available_at__gt=Now())
    first = later.aggregate(first=models.Min("available_at"))["first"]
    return None if first is None else (first - timezone.now()).total_seconds()


def mark_published(using: str, ids: Sequence[int], token: uuid.UUID) -> int:
    """PROCESSING -> PUBLISHED for the rows of ``ids`` still leased under ``token``
    (``published_at`` the database's now, lease and last error cleared); returns how
    many. Rows another relay took over are left alone. On PostgreSQL one statement
    of constant text (:func:`.postgresql.mark_published`), elsewhere the ORM."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        return postgresql.mark_published(connection, ids, token)
    from ..models import OutboxMessage, OutboxStatus

    rows = OutboxMessage.objects.using(using).filter(AnyOf(models.F("id"), ids)).leased(token)
    return rows.update(
        status=OutboxStatus.PUBLISHED, published_at=Now(), locked_until=None, last_error=""
    )


def delete_published(using: str, ids: Sequence[int], token: uuid.UUID) -> set[int]:
    """PROCESSING -> deleted for the rows of ``ids`` still leased under ``token`` (the
    published rows when ``PUBLISHED_RETENTION`` is 0); returns the ids deleted. Rows
    another relay took over are left alone. On PostgreSQL one statement of constant
    text (:func:`.postgresql.delete_published`), elsewhere the ORM: the leased rows
    locked, then deleted, in one transaction."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        return postgresql.delete_published(connection, ids, token)
    from ..models import OutboxMessage

    rows = OutboxMessage.objects.using(using)
    with transaction.atomic(using=using):
        leased = rows.filter(AnyOf(models.F("id"), ids)).leased(token).select_for_update()
        held = set(leased.values_list("id", flat=True))
        rows.filter(id__in=held).delete()
    return held


def insert(
    using: str,
    rows: list[OutboxMessage],
    ordered: frozenset[str] = frozenset(),
    *,
    replace: bool = False,
) -> list[OutboxMessage]:
    """Write new outbox rows in one statement; returns them saved (primary key and
    database defaults filled in), in order, each with its ``staging_outcome``.

    Rows to the destinations ``ordered`` (ordered routes) are numbered 1, 2, 3, ...
    per (destination, ordering key) from its ``OutboxSequence`` row, which stays
    locked until the caller's transaction ends: see docs/ordering.md. On PostgreSQL
    this is the same one statement; elsewhere one UPDATE (or INSERT) per key first.

    Rows with a dedup key (no two of them alike, none ordered) are written apart,
    insert-first (:func:`_insert_deduplicated`): where an unfinished row of their
    (destination, dedup key) exists, that row is returned instead, its payload,
    headers and time replaced with ``replace`` unless a relay holds it."""
    plain = [row for row in rows if row.dedup_key is None]
    for row in plain:
        row.staging_outcome = "staged"
    connection = connections[using]
    if plain and connection.vendor == "postgresql":
        postgresql.insert(connection, plain, ordered)
    elif plain:
        _number(using, [row for row in plain if row.destination in ordered])
        type(plain[0]).objects.using(using).bulk_create(plain)
    deduplicated = iter(_insert_deduplicated(using, [r for r in rows if r.dedup_key], replace))
    return [row if row.dedup_key is None else next(deduplicated) for row in rows]


def _insert_deduplicated(
    using: str, rows: list[OutboxMessage], replace: bool
) -> list[OutboxMessage]:
    """Rows with a dedup key, saved: on PostgreSQL one ``INSERT ... ON CONFLICT`` on the
    unique partial index ``outbox_dedup_unfinished_idx`` (which waits for a concurrent
    transaction staging the same key, and locks the row it conflicts with); on a
    partitioned outbox, which has no such index, each key locked first
    (:func:`_insert_locked`); elsewhere each row in a savepoint, its ``IntegrityError``
    the conflict. The rows that were not inserted are read back: the unfinished row
    that stays in their place."""
    if not rows:
        return []
    connection = connections[using]
    postgres = connection.vendor == "postgresql"
    if postgres and postgresql.partitioned_for_staging(connection):
        inserted, replaced = _insert_locked(using, rows, replace)
    elif postgres:
        inserted, replaced = postgresql.insert_deduplicated(connection, rows, replace)
    else:
        inserted, replaced = _insert_each(using, rows, replace)
    from ..models import UNFINISHED, OutboxStatus

    others = [row for row in rows if row.event_id not in inserted]
    scopes = models.Q()
    for row in others:
        scopes |= models.Q(destination=row.destination, dedup_key=row.dedup_key)
    found = (
        {
            (row.destination, row.dedup_key): row
            for row in type(rows[0]).objects.using(using).filter(UNFINISHED).filter(scopes)
        }
        if others
        else {}
    )
    saved = []
    for row in rows:
        if row.event_id in inserted:
            row.staging_outcome = "staged"
            saved.append(row)
            continue
        existing = found[(row.destination, row.dedup_key)]
        existing.staging_outcome = (
            "replaced"
            if (row.destination, row.dedup_key) in replaced
            else "in_flight"
            if replace and existing.status == OutboxStatus.PROCESSING
            else "deduplicated"
        )
        saved.append(existing)
    return saved


def _insert_locked(
    using: str, rows: list[OutboxMessage], replace: bool
) -> tuple[set[uuid.UUID], set[tuple[str, str]]]:
    """:func:`_insert_each` on a partitioned outbox: each (destination, dedup key)
    locked until the transaction ends (:func:`.postgresql.lock_dedup_keys`, sorted),
    then the keys that have an unfinished row are the conflicts."""
    from ..models import UNFINISHED

    scopes = sorted({(row.destination, row.dedup_key or "") for row in rows})
    postgresql.lock_dedup_keys(connections[using], scopes)
    keys = models.Q()
    for destination, dedup_key in scopes:
        keys |= models.Q(destination=destination, dedup_key=dedup_key)
    # Locked, as ON CONFLICT locks the row it meets: no relay finishes it before the
    # caller reads it back.
    unfinished = type(rows[0]).objects.using(using).filter(UNFINISHED).filter(keys)
    unfinished = unfinished.select_for_update()
    taken = frozenset(
        (d, key or "") for d, key in unfinished.values_list("destination", "dedup_key")
    )
    return _insert_each(using, rows, replace, taken)


def lock_dedup_keys(using: str, scopes: Iterable[tuple[str, str]]) -> None:
    """On a partitioned outbox, lock these (destination, dedup key)s until the transaction
    ends, as staging does (:func:`_insert_locked`); elsewhere nothing: the unique index
    ``outbox_dedup_unfinished_idx`` arbitrates."""
    connection = connections[using]
    if connection.vendor == "postgresql" and postgresql.partitioned_for_staging(connection):
        postgresql.lock_dedup_keys(connection, sorted(set(scopes)))


def _insert_each(
    using: str,
    rows: list[OutboxMessage],
    replace: bool,
    taken: frozenset[tuple[str, str]] = frozenset(),
) -> tuple[set[uuid.UUID], set[tuple[str, str]]]:
    """The portable :func:`_insert_deduplicated`: each row in a savepoint; on a conflict
    (its ``IntegrityError``, or its key among those ``taken``), the unfinished row of its
    dedup key replaced (with ``replace``, unless PROCESSING). Returns the event ids
    inserted and the (destination, dedup key) replaced."""
    from ..models import UNFINISHED, OutboxStatus

    inserted, replaced = set(), set()
    for row in rows:
        if _inserted(using, row, taken):
            inserted.add(row.event_id)
            continue
        if not replace:
            continue
        scope = {"destination": row.destination, "dedup_key": row.dedup_key}
        changed = (
            type(row)
            .objects.using(using)
            .filter(UNFINISHED, **scope)
            .exclude(status=OutboxStatus.PROCESSING)
            .update(payload=row.payload, headers=row.headers, available_at=_time_of(row))
        )
        if changed:
            replaced.add((row.destination, row.dedup_key or ""))
    return inserted, replaced


def _inserted(using: str, row: OutboxMessage, taken: frozenset[tuple[str, str]]) -> bool:
    """Insert ``row`` in a savepoint unless its key is ``taken``; False on a conflict."""
    if (row.destination, row.dedup_key or "") in taken:
        return False
    return _saved_unless_conflict(using, row)


def _saved_unless_conflict(using: str, row: models.Model) -> bool:
    """Insert ``row`` in a savepoint; False, and nothing written, when a unique index refuses it."""
    try:
        with transaction.atomic(using=using):
            row.save(using=using, force_insert=True)
    except IntegrityError:
        return False
    return True


def _time_of(row: OutboxMessage) -> Any:
    """The ``available_at`` a staged row asks for: its own, or the database's now."""
    return (
        Now()
        if isinstance(row.available_at, models.expressions.DatabaseDefault)
        else row.available_at
    )


def _number(using: str, rows: list[OutboxMessage]) -> None:
    """Set the ``sequence`` of ``rows`` (all ordered) from their keys' counters, the
    keys in sorted order; each UPDATE locks its counter row (where the database locks
    rows) until the transaction ends."""
    from ..models import OutboxSequence

    by_scope: dict[tuple[str, str], list[OutboxMessage]] = {}
    for row in rows:
        by_scope.setdefault((row.destination, row.ordering_key), []).append(row)
    counters = OutboxSequence.objects.using(using)
    for (destination, key), scoped in sorted(by_scope.items()):
        counter = counters.filter(destination=destination, ordering_key=key)
        advance = {"last_sequence": models.F("last_sequence") + len(scoped)}
        if not counter.update(**advance):
            insert_if_absent(
                using, OutboxSequence, destination=destination, ordering_key=key, last_sequence=0
            )
            counter.update(**advance)
        last = counter.values_list("last_sequence", flat=True).get()
        for place, row in enumerate(scoped, start=last - len(scoped) + 1):
            row.sequence = place


def _claim_portable(
    using: str,
    limit: int,
    max_bytes: int,
    lease_seconds: float,
    worker: str,
    token: uuid.UUID,
    *,
    ordered: bool = True,
) -> ClaimedBatch:
    """Any database Django supports: a few statements in one transaction (the
    unordered rows, the heads of ordered keys, one per head for its run, the lease,
    the read). Without SKIP LOCKED (SQLite) it is safe for one relay per database
    only."""
    from ..models import OutboxMessage, OutboxStatus

    rows = OutboxMessage.objects.using(using)
    with transaction.atomic(using=using):
        due = rows.due().order_by("available_at", "id")
        if supports_skip_locked(connections[using]):
            due = due.select_for_update(skip_locked=True)
        else:
            write_first(using)
        candidates = sorted(_candidates(due, limit, ordered=ordered))
        ids = _within_bytes(((pk, size) for *_, pk, size in candidates[:limit]), max_bytes)
        if not ids:
            return ClaimedBatch(left_behind=False)
        lease = {"locked_until": now_plus(lease_seconds), "locked_by": worker}
        rows.filter(id__in=ids).update(status=OutboxStatus.PROCESSING, lease_token=token, **lease)
        claimed = (
            rows.filter(id__in=ids)
            .order_by("id")
            .annotate(
                skipped=models.ExpressionWrapper(
                    models.Q(skipped_at__isnull=False), output_field=models.BooleanField()
                )
            )
            .values_list(*CLAIMED_FIELDS)
        )
        # The JSONField decoded the payload; the wire wants it as text again.
        build = ClaimedMessage.reader(CLAIMED_FIELDS, payload=_json_text)
        return ClaimedBatch(
            map(build, claimed),
            left_behind=len(candidates) > len(ids),
            next_due_in=_next_due_portable(using),
        )


#: A claim's candidate: (place in its key's run, the head's ``available_at``, the
#: head's id, id, payload bytes); sorted, any prefix keeps a prefix of each key.
_Candidate = tuple[int, dt.datetime, int, int, int]


def _candidates(due: models.QuerySet[Any], limit: int, *, ordered: bool = True) -> list[_Candidate]:
    """The portable claim's rows to choose from, as the named query ``claim`` picks
    them: up to ``limit`` unordered rows and, with ``ordered``, up to ``limit`` heads of
    ordered keys and after each head the due rows of its key that follow it
    contiguously (a share of the rest of the batch each)."""
    size = _JsonBytes("payload")
    found: list[_Candidate] = [
        (0, at, pk, pk, n)
        for pk, at, n in due.filter(sequence__isnull=True).values_list("id", "available_at", size)[
            :limit
        ]
    ]
    if not ordered:
        return found
    heads = list(
        due.filter(_is_head()).values_list(
            "id", "available_at", size, "destination", "ordering_key", "sequence"
        )[:limit]
    )
    found += [(0, at, pk, pk, n) for pk, at, n, *_ in heads]
    share = math.ceil(max(limit - len(heads), 0) / max(len(heads), 1))
    for pk, at, _, destination, key, sequence in heads if share else ():
        later = due.filter(destination=destination, ordering_key=key, sequence__gt=sequence)
        run = later.order_by("sequence").values_list("id", "sequence", size)[:share]
        for place, (row_id, row_sequence, n) in enumerate(run, start=1):
            if row_sequence != sequence + place:
                break  # a gap: a row not due (or locked) ends the run
            found.append((place, at, pk, row_id, n))
    return found


def _is_head() -> models.Q:
    """An ordered row with no unfinished row of its key before it (named query
    ``ordered_gate`` of the PostgreSQL claim)."""
    from ..models import KEY_UNFINISHED, OutboxMessage

    earlier = OutboxMessage.objects.filter(
        KEY_UNFINISHED,
        destination=models.OuterRef("destination"),
        ordering_key=models.OuterRef("ordering_key"),
        sequence__lt=models.OuterRef("sequence"),
    )
    return models.Q(models.Q(sequence__isnull=False), ~models.Exists(earlier))


def write_first(using: str) -> None:
    """On a database without SKIP LOCKED (SQLite), start the transaction in hand with a
    write (an UPDATE of no row), so it waits for the write lock (SQLite's busy
    timeout) before it reads. A transaction that reads first cannot wait: SQLite
    fails its first write at once with "database is locked" when another connection
    (the retention thread, a request staging events, the relay) wrote in between."""
    from ..models import OutboxMessage

    if not supports_skip_locked(connections[using]):
        rows = OutboxMessage.objects.using(using).filter(id=-1)
        rows.update(locked_by=models.F("locked_by"))


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class _JsonBytes(models.Func):
    """The size in bytes of a JSON column's text (``OCTET_LENGTH``; SQLite counts a BLOB)."""

    function = "OCTET_LENGTH"
    output_field = models.BigIntegerField()

    def __init__(self, column: str) -> None:
        super().__init__(Cast(column, models.TextField()))

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return self.as_sql(
            compiler, connection, template="LENGTH(CAST(%(expressions)s AS BLOB))", **extra
        )


def _within_bytes(sizes: Iterable[tuple[int, int]], max_bytes: int) -> list[int]:
    """The ids of the leading ``(id, size)`` pairs whose sizes add up to at most
    ``max_bytes``; the first id always."""
    ids: list[int] = []
    total = 0
    for pk, size in sizes:
        total += size
        if ids and total > max_bytes:
            break
        ids.append(pk)
    return ids


def insert_if_absent(using: str, model: type[models.Model], **values: Any) -> bool:
    """INSERT one row of ``model`` unless it would break a unique constraint.

    Returns whether the row was inserted. Insert-first, never check-then-insert:
    where the database can ignore conflicts (PostgreSQL and SQLite ``ON CONFLICT
    DO NOTHING``, MySQL ``INSERT IGNORE``) it is one statement; elsewhere a
    savepoint catches the ``IntegrityError``. On PostgreSQL a concurrent
    uncommitted insert of the same key makes this wait for that transaction:
    if it commits this returns False, if it rolls back this inserts.
    """
    connection = connections[using]
    row = model(**values)
    if connection.features.supports_ignore_conflicts:
        meta = model._meta
        fields = [f for f in meta.local_concrete_fields if f is not meta.auto_field]
        query = InsertQuery(model, on_conflict=OnConflict.IGNORE)
        query.insert_values(fields, [row])
        with connection.cursor() as cursor:
            for sql, params in query.get_compiler(using=using).as_sql():
                cursor.execute(sql, params)
            return bool(cursor.rowcount == 1)
    return _saved_unless_conflict(using, row)


def database_now(using: str) -> dt.datetime:
    """The database clock as Django compares it with stored datetimes: aware with
    ``USE_TZ``, naive in ``TIME_ZONE`` without. Standard SQL's ``CURRENT_TIMESTAMP``,
    which PostgreSQL answers with an aware datetime (the transaction's start) and
    SQLite with UTC text to the second."""
    with connections[using].cursor() as cursor:
        cursor.execute("SELECT CURRENT_TIMESTAMP")
        (value,) = cursor.fetchone()
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    aware = value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
    return aware if settings.USE_TZ else timezone.make_naive(aware)


def listen(using: str) -> postgresql.Listener | None:
    """A listener that wakes when rows are staged on ``using``; None where the
    database cannot notify (the relay polls instead)."""
    connection = connections[using]
    if not supports_notify(connection):
        return None
    connection.ensure_connection()
    with connection.wrap_database_errors:  # psycopg errors become Django's DatabaseError
        return postgresql.Listener(connection)
