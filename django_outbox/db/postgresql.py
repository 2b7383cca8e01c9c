"""PostgreSQL only: the claim, the published mark, the staging INSERT, LISTEN and row
estimates (their SQL is in ``queries.sql``; the NOTIFY trigger is installed by the
migrations)."""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import functools
import json
import uuid
import zoneinfo
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db.models.expressions import DatabaseDefault
from django.utils import timezone

from ..envelope import ClaimedBatch, ClaimedMessage
from ..exceptions import OutboxConfigurationError
from . import queries

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from ..models import OutboxMessage

#: The ids a claim reads on a partitioned outbox: (lower, or None for none; upper).
Window = tuple[int | None, int]

#: The LISTEN/NOTIFY channel a relay waits on; the payload is the table name.
NOTIFY_CHANNEL = "django_outbox"


#: The ids of a claim window's lower bound when it has none (the first range starts at
#: MINVALUE): the smallest bigint.
_NO_LOWER = -(2**63)


def _window_sql(window: Window | None, column: str = "id") -> str:
    """The named fragment ``claim_window`` for ``column``, or "" without a window."""
    if window is None:
        return ""
    lower, upper = window
    bounds = {"lower": str(int(_NO_LOWER if lower is None else lower)), "upper": str(int(upper))}
    return " " + queries.sql("claim_window", fragments={"column": column, **bounds})


def _due_sql(clock: str, window: str = "") -> str:
    """The named fragment ``claim_due``: a row is due at ``clock`` (SQL), its id in
    ``window`` (a ``claim_window`` fragment, or "")."""
    from ..models import CLAIMABLE, OutboxStatus

    literals = {
        "claimable": [status.value for status in CLAIMABLE],
        "processing": OutboxStatus.PROCESSING.value,
    }
    fragments = {"clock": clock, "window": window}
    return queries.sql("claim_due", literals=literals, fragments=fragments)


def _next_due_sql(clock: str, ordered: bool = True, window: str = "") -> str:
    """The named fragment ``next_due``: seconds from ``clock`` (SQL) to the first row
    not due yet, in both due indexes, or without ``ordered`` the unordered one."""
    from ..models import OutboxMessage

    table = {"table": OutboxMessage._meta.db_table}
    firsts = ", ".join(
        queries.sql(
            "next_due_first",
            identifiers=table,
            fragments={"clock": clock, "part": _SEQUENCE[part], "window": window},
        )
        for part in ((False, True) if ordered else (False,))
    )
    return queries.sql("next_due", fragments={"clock": clock, "firsts": firsts})


def next_due_in(connection: BaseDatabaseWrapper) -> float | None:
    """Seconds until the first unfinished row that is not due yet comes due (named
    query ``next_due_in``); None when there is none."""
    with connection.cursor() as cursor:
        cursor.execute(queries.sql("next_due_in", fragments={"next_due": _next_due_sql(_NOW)}))
        (seconds,) = cursor.fetchone()
    return None if seconds is None else float(seconds)


#: The clock of a read outside the claim: the statement's (Django's ``Now()``).
_NOW = "statement_timestamp()"


@functools.lru_cache(maxsize=64)
def _claim_sql(
    ordered: bool = True,
    unflushed: bool = False,
    alone: bool = False,
    window: Window | None = None,
) -> str:
    """The claim statement for the outbox table: named query ``claim`` (its gate
    ``ordered_gate``), or ``claim_unordered`` without ``ordered``; ``alone`` (the
    claim is its own transaction), after ``claim_without_jit`` in the same query, and
    with ``unflushed`` after ``claim_commit_unflushed`` too; each part reading the ids
    of ``window`` only when given. Cached (a relay's window changes seldom): clear it
    (``_claim_sql.cache_clear()``) after replacing a named query."""
    from ..models import OutboxMessage, OutboxStatus

    table = {"table": OutboxMessage._meta.db_table}
    literals = {"processing": OutboxStatus.PROCESSING.value}
    ids = _window_sql(window)
    due = {
        "due": _due_sql("now()", ids),
        "next_due": _next_due_sql("now()", ordered, ids),
        "window": ids,
        "lease_window": _window_sql(window, "o.id"),
    }
    payload = {  # claim_payload of each pick's payload column
        name: queries.sql("claim_payload", fragments={"payload": column})
        for name, column in [
            ("payload", "payload"),
            ("later_payload", "later.payload"),  # the runs' rows (claim)
        ]
    }
    fragments = {
        name: queries.sql(query, identifiers=table, literals=literals, fragments={**due, **payload})
        for name, query in [
            ("unordered_rows", "claim_unordered_rows"),
            ("bounded", "claim_bounded"),
            ("lease", "claim_lease"),
            ("ordered_gate", "ordered_gate"),
        ]
    }
    name = "claim" if ordered else "claim_unordered"
    statement = queries.sql(name, identifiers=table, fragments={**due, **payload, **fragments})
    settings = [queries.sql("claim_without_jit")] if alone else []
    if unflushed:
        settings.append(queries.sql("claim_commit_unflushed"))
    return ";\n".join([*settings, statement])


def claim(
    connection: BaseDatabaseWrapper,
    limit: int,
    max_bytes: int,
    lease_seconds: float,
    worker: str,
    token: uuid.UUID,
    *,
    ordered: bool = True,
    window: Window | None = None,
) -> ClaimedBatch:
    """One query, so one implicit transaction and one round trip: pick due
    unordered rows through ``outbox_due_idx`` and the heads of ordered keys with
    the runs after them (named query ``claim``), all with SKIP LOCKED, lease
    them, return them. The payload comes back as JSON text, ready to publish
    without a decode/encode.

    Of the picked rows only a prefix whose payload text adds up to ``max_bytes``
    are leased (the first one always), and every key keeps a prefix of its run:
    a locking CTE cannot hold the window function, so a later CTE sums the sizes.
    Picked rows left out are unlocked when the statement ends, and the next claim
    takes them (the batch's ``left_behind``). Without ``ordered`` only unordered rows
    are claimed (``claim_unordered``: cheaper to plan), and the claim's commit does not
    wait for its WAL flush. A claim in a transaction of its own is never JIT-compiled.
    With a ``window`` (a partitioned outbox's, :func:`.partitions.claim_window`) it
    reads those ids only, and PostgreSQL plans the partitions that hold them only."""
    params: list[Any] = [limit, limit, limit, limit] if ordered else [limit, limit]
    params += [max_bytes, lease_seconds, worker, token]
    with connection.cursor() as cursor:
        alone = _alone(connection, cursor)
        unflushed = alone and not ordered
        cursor.execute(_claim_sql(ordered, unflushed, alone, window), params)
        for _setting in range(alone + unflushed):
            cursor.nextset()  # from the SETs' results to the claim's
        columns = [column.name for column in cursor.description]
        build = ClaimedMessage.reader(
            columns, headers=_headers(), created_at=_created_at(connection)
        )
        rows = cursor.fetchall()
        considered = rows[0][columns.index("considered")] if rows else 0
        next_due = rows[0][columns.index("next_due_in")] if rows else None
        messages = sorted(map(build, rows), key=lambda message: message.id)
        return ClaimedBatch(
            messages,
            left_behind=considered > len(messages),
            next_due_in=None if next_due is None else float(next_due),
        )


@functools.cache
def _finalize_sql(name: str) -> str:
    """The finalize's named query ``name`` (``mark_published`` or ``delete_published``)
    for the outbox table, its lease check ``lease_held``. Cached: clear it after
    replacing a named query."""
    from ..models import OutboxMessage, OutboxStatus

    return queries.sql(
        name,
        identifiers={"table": OutboxMessage._meta.db_table},
        literals={"published": OutboxStatus.PUBLISHED.value},
        fragments={"lease_held": queries.sql("lease_held")},
    )


def _id_array(ids: Sequence[int]) -> str:
    """``ids`` as the text of a PostgreSQL array: the driver's quoting of a list of 500
    ids took half a millisecond."""
    return f"{{{','.join(map(str, ids))}}}"


def mark_published(connection: BaseDatabaseWrapper, ids: Sequence[int], token: uuid.UUID) -> int:
    """PROCESSING -> PUBLISHED for the rows of ``ids`` still leased under ``token``; how
    many. One statement of constant text: Django's compile of the same UPDATE cost the
    relay 0.45 ms of CPU per batch, a quarter of what it spent per event at a trickle."""
    with connection.cursor() as cursor:
        cursor.execute(_finalize_sql("mark_published"), [_id_array(ids), token])
        return cursor.rowcount


def delete_published(
    connection: BaseDatabaseWrapper, ids: Sequence[int], token: uuid.UUID
) -> set[int]:
    """Delete the rows of ``ids`` still leased under ``token``; returns their ids. One
    statement of constant text, as :func:`mark_published`."""
    with connection.cursor() as cursor:
        cursor.execute(_finalize_sql("delete_published"), [_id_array(ids), token])
        return {pk for (pk,) in cursor.fetchall()}


def _alone(connection: BaseDatabaseWrapper, cursor: Any) -> bool:
    """Whether the claim is a transaction of its own, whose settings its SET LOCALs may
    change (``claim_without_jit``; the unordered claim's commit may skip its WAL flush,
    ``claim_commit_unflushed``): outside a transaction of the caller's (whose commit and
    statements they would change too), through psycopg's client-side binding cursor
    (Django's default), which sends the statements in one simple-protocol query."""
    import psycopg

    driver_cursor = getattr(cursor, "cursor", None)
    return connection.get_autocommit() and isinstance(driver_cursor, psycopg.ClientCursor)


#: What the claim's ``created_at`` counts microseconds from.
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _utc(micros: int) -> dt.datetime:
    """The claim's ``created_at`` (microseconds since the epoch), aware, in UTC. Sent as
    a number because Django's loader of ``timestamptz`` text runs in Python: it was a
    tenth of the relay's database thread; this is one addition."""
    return _EPOCH + dt.timedelta(0, 0, micros)  # positional: a third faster than by keyword


def _created_at(connection: BaseDatabaseWrapper) -> Callable[[int], dt.datetime]:
    """How one claim reads its ``created_at`` column (:func:`_to_datetime`), once per
    distinct value: the events staged in one transaction share the transaction's time,
    and then one datetime object, which the Redis writer formats once."""
    convert = _to_datetime(connection)
    seen: dict[int, dt.datetime] = {}

    def read(micros: int) -> dt.datetime:
        at = seen.get(micros)
        if at is None:
            at = seen[micros] = convert(micros)
        return at

    return read


def _to_datetime(connection: BaseDatabaseWrapper) -> Callable[[int], dt.datetime]:
    """How the claim's ``created_at`` becomes what Django returns for a stored datetime
    on ``connection``: aware in the connection's time zone with ``USE_TZ`` (UTC unless
    ``DATABASES[...]["TIME_ZONE"]`` says otherwise), naive in ``TIME_ZONE`` without."""
    if not settings.USE_TZ:
        local = zoneinfo.ZoneInfo(connection.timezone_name)
        return lambda micros: timezone.make_naive(_utc(micros), local)
    zone = connection.timezone
    if zone is dt.UTC:
        return _utc
    return lambda micros: _utc(micros).astimezone(zone)


def _headers() -> Callable[[str], Any]:
    """How one claim reads the headers column (JSON text, as Django's psycopg setup
    returns ``jsonb``): each distinct text is decoded once per claim, since the events
    staged together share theirs (a trace context, a correlation id); decoding it for
    every row was most of what tracing cost the claim. Each message gets a dict of its
    own, a copy of the decoded one's top level (nested values are shared; nothing in
    the package changes headers). A column that is not an object (a row written around
    ``stage()``) comes back as decoded, for the publish to fail that message alone."""
    decoded: dict[str, Any] = {}

    def read(text: str) -> Any:
        if text == "{}":
            return {}
        headers = decoded.get(text)
        if headers is None:
            headers = decoded[text] = json.loads(text)
        return headers.copy() if type(headers) is dict else headers

    return read


#: A count of the backlog: a state, and for PENDING and PROCESSING (in the due indexes,
#: with no index of their own) which due index: True the ordered rows', False the others'.
BacklogPart = tuple[str, bool | None]

_SEQUENCE = {None: "", False: " AND sequence IS NULL", True: " AND sequence IS NOT NULL"}
#: Each state's partial index for backlog_count: the named query of its condition;
#: "scheduled" (PENDING rows not due yet) is not a state, but counted as one.
_INDEX_PART = {
    "pending": "backlog_part_unfinished",
    "scheduled": "backlog_part_unfinished",
    "processing": "backlog_part_unfinished",
    "failed": "backlog_part_failed",
    "published": "backlog_part_published",
    "abandoned": "backlog_part_abandoned",
}


def backlog(
    connection: BaseDatabaseWrapper, parts: tuple[BacklogPart, ...], *, limit: int, blocked: bool
) -> list[Any]:
    """One statement (named query ``backlog``) for the figures of a scrape: the rows of
    each of ``parts`` counted up to ``limit + 1``, the ``available_at`` of the oldest
    due row of each due index (None: none), then with ``blocked`` the blocked keys,
    counted up to ``limit + 1``. Each figure is read through a partial index."""
    with connection.cursor() as cursor:
        cursor.execute(_backlog_sql(parts, blocked), [limit + 1] * (len(parts) + blocked))
        return list(cursor.fetchone())


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A session holding the database's oldest snapshot (named query ``oldest_snapshot``)."""

    pid: int
    user: str
    application: str
    state: str  # "idle in transaction", "active" ...
    held: float  # seconds its transaction has been open

    def describe(self) -> str:
        """``backend 4321 (user 'report', application 'psql', idle in transaction)``."""
        application = f", application {self.application!r}" if self.application else ""
        return f"backend {self.pid} (user {self.user!r}{application}, {self.state or 'unknown'})"


def oldest_snapshot(connection: BaseDatabaseWrapper) -> Snapshot | None:
    """The other session of the database whose snapshot is the oldest, or None."""
    with connection.cursor() as cursor:
        cursor.execute(queries.sql("oldest_snapshot"))
        row = cursor.fetchone()
    if row is None:
        return None
    pid, user, application, state, held = row
    return Snapshot(int(pid), user, application, state, float(held))


#: The backlog's PENDING rows are the due ones; its "scheduled" rows, PENDING rows not
#: due yet (the named queries of each range).
_WHEN = {"pending": "backlog_part_due", "scheduled": "backlog_part_scheduled"}
_STORED = {"scheduled": "pending"}


def _part(status: str, ordered: bool | None) -> str:
    """What a part of ``status`` adds to its index's condition: which due index, and
    for PENDING and scheduled rows which range of it."""
    return _SEQUENCE[ordered] + (f" {queries.sql(_WHEN[status])}" if status in _WHEN else "")


@functools.cache
def _backlog_sql(parts: tuple[BacklogPart, ...], blocked: bool) -> str:
    from ..models import OutboxMessage, OutboxStatus

    table = {"table": OutboxMessage._meta.db_table}
    figures = [
        queries.sql(
            "backlog_count",
            identifiers=table,
            literals={"status": _STORED.get(status, status)},
            fragments={"part": f" {queries.sql(_INDEX_PART[status])}{_part(status, ordered)}"},
        )
        for status, ordered in parts
    ]
    due = _due_sql(_NOW)
    figures += [
        queries.sql(
            "backlog_oldest_due",
            identifiers=table,
            fragments={"due": due, "part": _SEQUENCE[ordered]},
        )
        for ordered in (False, True)
    ]
    if blocked:
        gate = queries.sql("ordered_gate", identifiers=table, fragments={"window": ""})
        abandoned = {"abandoned": OutboxStatus.ABANDONED.value}
        figures.append(
            queries.sql(
                "backlog_blocked", identifiers=table, literals=abandoned, fragments={"gate": gate}
            )
        )
    return queries.sql("backlog", fragments={"figures": ",\n       ".join(figures)})


def estimated_rows(queryset: QuerySet[Any]) -> int:
    """The planner's row estimate for ``queryset`` (``EXPLAIN (FORMAT JSON)``,
    which plans the query but does not run it).

    Unfiltered, this is ``pg_class.reltuples`` scaled to the table's current
    size, so it is right even before the first ANALYZE; filtered, it comes
    from the column statistics ANALYZE (or autovacuum) keeps.
    """
    (plan,) = json.loads(queryset.explain(format="json"))
    return int(plan["Plan"]["Plan Rows"])


#: Rows one INSERT writes at most: PostgreSQL takes 65,535 parameters a statement
#: (psycopg's ``server_side_binding`` sends them apart), and a row sends 7; a row of
#: ``insert_ordered`` sends 8, and its scope up to 3 more.
INSERT_MAX_ROWS = 65_535 // 7
INSERT_ORDERED_MAX_ROWS = 65_535 // 11


def insert(
    connection: BaseDatabaseWrapper,
    rows: list[OutboxMessage],
    ordered: frozenset[str] = frozenset(),
) -> None:
    """Stage ``rows`` with one INSERT per ``INSERT_MAX_ROWS`` rows and set what the
    database filled in (id, ``available_at`` unless given, ``created_at``: both the
    statement's time, as the columns' ``Now()`` defaults would have it).

    Rows to the destinations ``ordered`` take their key's next sequence numbers in
    the same statement (named query ``insert_ordered``); several statements, when
    that many rows are staged at once, take the keys in one order (sorted).

    Leaner than ``bulk_create``: only the columns a new row needs are sent, and the
    ones every new row starts with (PENDING, no attempts, no lease) are constants."""
    if not any(row.destination in ordered for row in rows):
        for start in range(0, len(rows), INSERT_MAX_ROWS):
            _insert(connection, rows[start : start + INSERT_MAX_ROWS])
        return
    if len(rows) > INSERT_ORDERED_MAX_ROWS:  # the statements lock the keys in order too
        rows = sorted(rows, key=lambda row: _scope(row, ordered) or ("", ""))  # stable
    for start in range(0, len(rows), INSERT_ORDERED_MAX_ROWS):
        _insert(connection, rows[start : start + INSERT_ORDERED_MAX_ROWS], ordered)


#: A row of ``insert_deduplicated`` sends 8 parameters.
INSERT_DEDUPLICATED_MAX_ROWS = 65_535 // 8


def insert_deduplicated(
    connection: BaseDatabaseWrapper, rows: list[OutboxMessage], replace: bool
) -> tuple[set[uuid.UUID], set[tuple[str, str]]]:
    """Stage ``rows`` (each with a dedup key, no two alike, none ordered) with
    ``INSERT ... ON CONFLICT`` on ``outbox_dedup_unfinished_idx`` (named query
    ``insert_deduplicated``): a row whose (destination, dedup key) has an unfinished
    row is not inserted; with ``replace`` that row takes its payload, headers and
    time unless it is PROCESSING. Returns the event ids inserted (their rows filled in
    as :func:`insert` does) and the (destination, dedup key) of the rows replaced."""
    from ..models import OutboxMessage, OutboxStatus

    inserted: set[uuid.UUID] = set()
    replaced: set[tuple[str, str]] = set()
    by_event = {row.event_id: row for row in rows}
    row_sql = queries.sql("deduplicated_row", literals={"pending": OutboxStatus.PENDING.value})
    for start in range(0, len(rows), INSERT_DEDUPLICATED_MAX_ROWS):
        batch = rows[start : start + INSERT_DEDUPLICATED_MAX_ROWS]
        sql = queries.sql(
            "insert_deduplicated",
            identifiers={"table": OutboxMessage._meta.db_table},
            literals={"processing": OutboxStatus.PROCESSING.value},
            fragments={
                "rows": ", ".join([row_sql] * len(batch)),
                "replace": "true" if replace else "false",
            },
        )
        params = [param for row in batch for param in (*_row_params(row), row.dedup_key)]
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            for event_id, destination, dedup_key, pk, available_at, created_at in cursor:
                row = by_event.get(event_id)
                if row is None:
                    replaced.add((destination, dedup_key))
                    continue
                inserted.add(event_id)
                row.pk, row.available_at, row.created_at = pk, available_at, created_at
                row._state.adding, row._state.db = False, connection.alias
    return inserted, replaced


def partitioned_for_staging(connection: BaseDatabaseWrapper) -> bool:
    """Lock the outbox table as staging's INSERT will (named query ``dedup_partitioned``:
    it waits out ``outbox_partition``), then whether it is partitioned."""
    from ..models import OutboxMessage

    table = OutboxMessage._meta.db_table
    sql = queries.sql(
        "dedup_partitioned",
        identifiers={"table": table},
        literals={"name": queries.quote_identifier(table)},
    )
    with connection.cursor() as cursor:
        cursor.execute(sql)
        cursor.nextset()  # from the LOCK's result to the probe's
        return bool(cursor.fetchone()[0])


def lock_dedup_keys(connection: BaseDatabaseWrapper, scopes: Sequence[tuple[str, str]]) -> None:
    """Lock each (destination, dedup key) of ``scopes``, in their order, until the
    transaction ends (named query ``dedup_locks``): a partitioned outbox's arbiter in
    place of ``outbox_dedup_unfinished_idx``. Raises :class:`OutboxConfigurationError`
    unless the transaction is READ COMMITTED, where the next statement sees the row of
    a transaction that held the lock before."""
    sql = queries.sql(
        "dedup_locks", fragments={"rows": ", ".join([queries.sql("dedup_lock")] * len(scopes))}
    )
    params = [value for scope in scopes for value in scope]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        _, isolation = cursor.fetchone()
    if isolation != "read committed":
        raise OutboxConfigurationError(
            f"stage(dedup_key=...) on a partitioned outbox needs READ COMMITTED transactions, "
            f"not {isolation.upper()}: a later snapshot would not see a concurrent staging of "
            "the same key (docs/scaling.md)"
        )


def _scope(row: OutboxMessage, ordered: frozenset[str]) -> tuple[str, str] | None:
    """The scope of ``row``'s sequence, None when its destination is not ordered."""
    return (row.destination, row.ordering_key) if row.destination in ordered else None


def _insert(
    connection: BaseDatabaseWrapper,
    rows: list[OutboxMessage],
    ordered: frozenset[str] | None = None,
) -> None:
    if ordered is None:
        sql = _insert_sql(len(rows))
        params = [param for row in rows for param in _row_params(row)]
    else:
        from ..models import OutboxMessage, OutboxStatus

        table = {"table": OutboxMessage._meta.db_table}
        pending = {"pending": OutboxStatus.PENDING.value}
        sql, params = _ordered_insert(rows, ordered, table, pending)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        saved = {event_id: values for event_id, *values in cursor.fetchall()}
    for row in rows:
        row.pk, row.available_at, row.created_at, *sequence = saved[row.event_id]
        if sequence:
            row.sequence = sequence[0]
        row._state.adding, row._state.db = False, connection.alias


#: The largest INSERT whose text is kept, once built: the few events a transaction
#: usually stages (building a larger one costs little next to running it).
_KEPT_INSERT_ROWS = 64


def _insert_sql(rows: int) -> str:
    """The statement ``insert`` of ``rows`` rows (``insert_row`` repeated)."""
    return _kept_insert_sql(rows) if rows <= _KEPT_INSERT_ROWS else _build_insert_sql(rows)


@functools.lru_cache(maxsize=_KEPT_INSERT_ROWS)
def _kept_insert_sql(rows: int) -> str:
    return _build_insert_sql(rows)


def _build_insert_sql(rows: int) -> str:
    from ..models import OutboxMessage, OutboxStatus

    values = queries.sql("insert_row", literals={"pending": OutboxStatus.PENDING.value})
    return queries.sql(
        "insert",
        identifiers={"table": OutboxMessage._meta.db_table},
        fragments={"rows": ", ".join([values] * rows)},
    )


def _ordered_insert(
    rows: list[OutboxMessage],
    ordered: frozenset[str],
    table: dict[str, str],
    pending: dict[str, str],
) -> tuple[str, list[Any]]:
    """The statement ``insert_ordered`` for ``rows`` and its parameters: each scope
    (sorted) with its number of rows, then each row with its place counted back
    from its scope's last number."""
    from ..models import OutboxSequence

    counts = collections.Counter(filter(None, (_scope(row, ordered) for row in rows)))
    params: list[Any] = [value for item in sorted(counts.items()) for value in (*item[0], item[1])]
    for row in rows:
        scope = _scope(row, ordered)
        if scope is not None:
            counts[scope] -= 1
        params += (*_row_params(row), None if scope is None else counts[scope])
    sql = queries.sql(
        "insert_ordered",
        identifiers={**table, "sequences": OutboxSequence._meta.db_table},
        literals=pending,
        fragments={
            "scopes": ", ".join([queries.sql("sequence_scope")] * len(counts)),
            "rows": ", ".join([queries.sql("ordered_row")] * len(rows)),
        },
    )
    return sql, params


def _row_params(row: OutboxMessage) -> tuple[Any, ...]:
    """The parameters of ``insert_row`` (and the first ones of ``ordered_row``)."""
    available_at = row.available_at
    return (
        row.event_id,
        row.event_type,
        row.destination,
        json.dumps(row.payload),
        json.dumps(row.headers),
        row.ordering_key,
        None if isinstance(available_at, DatabaseDefault) else available_at,
    )


class Listener:
    """A dedicated autocommit connection that LISTENs for staged rows.

    Kept apart from Django's connection so that waiting never holds a
    transaction open and a restart of PostgreSQL surfaces as an error here.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        import psycopg

        params = connection.get_connection_params()
        for django_only in ("cursor_factory", "context", "server_side_binding"):
            params.pop(django_only, None)
        self._conn = psycopg.connect(**params, autocommit=True)
        self._conn.execute(queries.sql("listen", identifiers={"channel": NOTIFY_CHANNEL}))

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a notification; True if one came.
        Notifications that piled up meanwhile are consumed too."""
        woke = False
        for _ in self._conn.notifies(timeout=timeout, stop_after=1):
            woke = True
        if woke:
            for _ in self._conn.notifies(timeout=0):
                pass
        return woke

    def close(self) -> None:
        self._conn.close()
