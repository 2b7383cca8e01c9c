"""A partitioned outbox (PostgreSQL): the table split into ranges of ``id``, made ahead
by the relays and dropped whole once every row in one is past its retention.

Why ranges of ``id`` and not of time: the primary key stays ``id`` alone, so the model,
the admin and every lookup by id are unchanged and each one reads a single partition;
a row never changes partition (its state and times change, its id does not), so a
claim and a finalize stay the HOT updates docs/relay.md describes; and ids grow with
time, so the oldest partition is the oldest day (or hour) of events. A range holds
``OUTBOX["PARTITIONING"]["rows"]`` ids: size it to the events of the period retention
should drop at once.

A **default** partition takes the rows no range does, so staging never fails when the
relays stopped making partitions ahead (they were down); ranges made later start above
the rows it holds, and retention deletes its expired rows one by one as it does on a
table that is not partitioned. A range is dropped when all its ids have been drawn and
no row in it would be kept (:func:`expiry`); a range that still holds an unfinished
row, or an ABANDONED ordered row, is kept whole, and dropped when it no longer does.

The statements are the named queries ``partition*`` and ``convert*`` of
``queries.sql``. PostgreSQL cannot enforce a unique index across partitions unless it
includes the partition key: the partitioned table has non-unique twins of the table's
unique indexes (``event_id``, a key's unfinished sequence numbers, dedup keys) and
staging arbitrates dedup keys itself (:mod:`django_outbox.db.postgresql`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.utils import DatabaseError, OperationalError

from ..exceptions import OutboxConfigurationError
from . import queries

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

#: How long ``outbox_partition`` waits for the table (every transaction that staged an
#: event and is still open holds it).
CONVERT_LOCK_TIMEOUT = "10s"
#: Ids left between the rows the default partition holds and the first range made after
#: them: a statement that drew its id just before the range was made still finds the
#: default partition its place.
OVERFLOW_GAP = 10_000

_BOUNDS = re.compile(r"FOR VALUES FROM \((MINVALUE|'?-?\d+'?)\) TO \((MAXVALUE|'?-?\d+'?)\)")


@dataclasses.dataclass(frozen=True, order=True)
class Partition:
    """One partition: the ids ``lower`` (None: no lower bound) to ``upper`` (excluded;
    None: no upper bound); the default partition has neither and ``default`` True."""

    lower: int | None
    upper: int | None
    name: str
    default: bool = False

    @property
    def ids(self) -> str:
        """``"ids 1000 to 2000"`` (the upper one excluded); ``".."``: no bound."""
        return f"ids {'..' if self.lower is None else self.lower} to {self.upper or '..'}"


@dataclasses.dataclass(frozen=True)
class Expiry:
    """What keeps one partition: ``unfinished`` rows or an ABANDONED ordered one (kept
    until an operator acts), else the time its last row's retention passes."""

    partition: Partition
    blocked: bool
    expires_at: dt.datetime | None
    now: dt.datetime

    @property
    def expired(self) -> bool:
        return not self.blocked and (self.expires_at is None or self.expires_at <= self.now)


def _table() -> str:
    from ..models import OutboxMessage

    return OutboxMessage._meta.db_table


def _quoted(name: str) -> str:
    return queries.quote_identifier(name)


def _rows(connection: BaseDatabaseWrapper, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with connection.cursor() as cursor:
        cursor.execute(sql, params or None)
        return cursor.fetchall() if cursor.description else []


def is_partitioned(connection: BaseDatabaseWrapper) -> bool:
    """Whether the outbox table of ``connection`` is partitioned (False off PostgreSQL)."""
    if connection.vendor != "postgresql":
        return False
    return bool(_rows(connection, queries.sql("partitioned"), _quoted(_table()))[0][0])


def _bound(text: str) -> int | None:
    return None if text.endswith("VALUE") else int(text.strip("'"))


def partitions(connection: BaseDatabaseWrapper) -> list[Partition]:
    """The partitions of the outbox table, ranges by their ids, the default one last."""
    found = []
    for name, bounds in _rows(connection, queries.sql("partitions"), _quoted(_table())):
        if bounds is None:  # dropped since this statement's snapshot: pg_get_expr finds none
            continue
        match = _BOUNDS.fullmatch(bounds)
        if match is None:
            found.append(Partition(None, None, name, default=True))
        else:
            found.append(Partition(_bound(match[1]), _bound(match[2]), name))
    return sorted(found, key=lambda p: (p.default, -(2**63) if p.lower is None else p.lower))


def partition_name(lower: int) -> str:
    """The name of the range starting at id ``lower``: ``<table>_p<lower>``."""
    return f"{_table()}_p{lower}"


def next_id(connection: BaseDatabaseWrapper) -> int:
    """The id the next staged row takes, or a greater one: every id below is drawn."""
    sequence = _rows(connection, queries.sql("serial_sequence"), _quoted(_table()))[0][0]
    return int(_rows(connection, queries.sql("next_id", fragments={"sequence": sequence}))[0][0])


def _storage(connection: BaseDatabaseWrapper, partition: str) -> str:
    """``WITH (...)``: the storage parameters of ``partition``, for a new partition."""
    options = _rows(connection, queries.sql("convert_storage"), _quoted(partition))
    items = options[0][0] if options else []
    return f"WITH ({', '.join(items)})" if items else ""


def _execute(connection: BaseDatabaseWrapper, query: str, **values: Any) -> None:
    """Run the named query ``query``: ``table`` is filled in, the other ``values`` are
    identifiers when str, numbers (as they are) when int."""
    names = {key: v for key, v in values.items() if isinstance(v, str)}
    numbers = {key: str(int(v)) for key, v in values.items() if not isinstance(v, str)}
    sql = queries.sql(query, identifiers={"table": _table(), **names}, fragments=numbers)
    with connection.cursor() as cursor:
        cursor.execute(sql)


def _convert_timeouts(connection: BaseDatabaseWrapper) -> None:
    sql = queries.sql("convert_timeouts", literals={"timeout": CONVERT_LOCK_TIMEOUT})
    with connection.cursor() as cursor:
        cursor.execute(sql)


def ensure_ahead(connection: BaseDatabaseWrapper, rows: int, ahead: int) -> list[Partition]:
    """Attach empty ranges of ``rows`` ids until ``ahead`` ranges lie wholly above the
    ids drawn so far; returns those attached. Each is made, attached and committed on
    its own (:func:`_briefly`): when its locks do not come, the rest wait for the next
    pass."""
    made: list[Partition] = []
    while (lower := _next_range(connection, rows, ahead)) is not None:
        partition = Partition(lower, lower + rows, partition_name(lower))
        if _briefly(connection, functools.partial(_attach, connection, partition)) is None:
            break
        made.append(partition)
    return made


def _attach(connection: BaseDatabaseWrapper, partition: Partition) -> bool:
    storage = _storage(connection, partitions(connection)[0].name)
    _execute_with(connection, "partition_create", partition, storage)
    bounds = {"lower": partition.lower, "upper": partition.upper}
    _execute(connection, "partition_attach", partition=partition.name, **bounds)
    return True


def _briefly(connection: BaseDatabaseWrapper, work: Callable[[], bool]) -> bool | None:
    """Run ``work`` in a transaction of its own: ``work``'s answer, or None (rolled back)
    when another session makes or drops partitions now (the transaction-level advisory
    lock ``maintenance_lock``), when a lock did not come within the lock timeout (a
    little longer than ``deadlock_timeout``, after which PostgreSQL cancels an
    autovacuum in the way), or when another session made or dropped the range since
    this one chose it (``RACED``)."""
    try:
        with transaction.atomic(using=connection.alias):
            if not _rows(connection, queries.sql("maintenance_lock"))[0][0]:
                return None
            return work()
    except DatabaseError as error:
        if getattr(error.__cause__, "sqlstate", None) not in (LOCK_NOT_AVAILABLE, *RACED):
            raise
        return None


def _execute_with(
    connection: BaseDatabaseWrapper, name: str, partition: Partition, storage: str
) -> None:
    sql = queries.sql(
        name,
        identifiers={"table": _table(), "partition": partition.name},
        fragments={"storage": storage},
    )
    with connection.cursor() as cursor:
        cursor.execute(sql)


def _next_range(connection: BaseDatabaseWrapper, rows: int, ahead: int) -> int | None:
    """The lower bound of the next range to make, None when ``ahead`` ranges lie wholly
    above the ids drawn. Ranges follow each other, but when the ids drawn went past the
    last one (the default partition took them), the next starts ``OVERFLOW_GAP`` above."""
    ranges = [p for p in partitions(connection) if not p.default]
    drawn = next_id(connection)
    if sum(p.lower is not None and p.lower >= drawn for p in ranges) >= ahead:
        return None
    top = max((p.upper for p in ranges if p.upper is not None), default=None)
    return top if top is not None and top >= drawn else drawn + OVERFLOW_GAP


def expiry(
    connection: BaseDatabaseWrapper,
    partition: Partition,
    published: dt.timedelta,
    abandoned: dt.timedelta,
) -> Expiry:
    """What keeps ``partition``, read through its indexes: ``published`` and
    ``abandoned`` are the retention periods of PUBLISHED and ABANDONED rows."""
    sql = queries.sql("partition_expiry", identifiers={"partition": partition.name})
    unfinished, ordered, last_published, last_abandoned, now = _rows(connection, sql)[0]
    times = [
        *([last_published + published] if last_published is not None else []),
        *([last_abandoned + abandoned] if last_abandoned is not None else []),
    ]
    return Expiry(partition, unfinished or ordered, max(times, default=None), now)


def closed(connection: BaseDatabaseWrapper) -> Iterator[Partition]:
    """The ranges whose ids have all been drawn: no row will ever be staged in them."""
    drawn = next_id(connection)
    for partition in partitions(connection):
        if not partition.default and partition.upper is not None and partition.upper <= drawn:
            yield partition


def drop_expired(
    connection: BaseDatabaseWrapper, published: dt.timedelta, abandoned: dt.timedelta
) -> list[Partition]:
    """Drop each closed range whose rows are all past their retention (read again with
    the range locked, so that a row requeued meanwhile keeps it); returns those dropped.
    When a range's locks do not come (:func:`_briefly`), it and the ones after it wait
    for the next pass: staging would wait behind each in turn."""
    dropped = []
    for partition in droppable(connection, published, abandoned):
        drop = functools.partial(_drop, connection, partition, published, abandoned)
        done = _briefly(connection, drop)
        if done is None:  # the next would wait as long: staging waits behind each
            break
        if done:
            dropped.append(partition)
    return dropped


def droppable(
    connection: BaseDatabaseWrapper, published: dt.timedelta, abandoned: dt.timedelta
) -> list[Partition]:
    """The closed ranges whose rows are all past their retention now."""
    found = list(closed(connection))
    return [p for p in found if expiry(connection, p, published, abandoned).expired]


def _drop(
    connection: BaseDatabaseWrapper,
    partition: Partition,
    published: dt.timedelta,
    abandoned: dt.timedelta,
) -> bool:
    _execute(connection, "partition_lock", partition=partition.name)
    if not expiry(connection, partition, published, abandoned).expired:
        return False
    _execute(connection, "partition_drop", partition=partition.name)
    return True


#: The SQLSTATE of a lock not had within ``lock_timeout``.
LOCK_NOT_AVAILABLE = "55P03"
#: The SQLSTATEs of a range another session made (duplicate_table, or unique_violation
#: when both create it at once) or dropped (undefined_table) between this pass's choice
#: and its statement, or of a range whose ids the default partition took meanwhile
#: (check_violation: the next pass starts the range above them).
RACED = ("42P07", "42P01", "23505", "23514")


def claim_window(connection: BaseDatabaseWrapper) -> tuple[int | None, int] | None:
    """The ids a claim reads on a partitioned outbox: from the first range that may
    hold a row to claim (its ids not all drawn yet, or an unfinished row in it; its
    lower bound, None when it has none) to the top of the ranges. None (read every
    id) on a table that is not partitioned, or while the default partition holds an
    unfinished row: its ids lie outside the ranges.

    A row that becomes unfinished again in a range below (an operator's requeue), or
    that a transaction staged there and committed after this was read, waits until
    the window is read again; so does a row staged past the top into the default
    partition."""
    if not is_partitioned(connection):
        return None
    drawn = next_id(connection)
    found = partitions(connection)
    uppers = [(p, p.upper) for p in found if not p.default and p.upper is not None]
    if not uppers or any(_blocked(connection, p) for p in found if p.default):
        return None
    first = next(
        (p for p, upper in uppers if upper > drawn or _blocked(connection, p)), uppers[-1][0]
    )
    return first.lower, max(upper for _, upper in uppers)


def blockers(connection: BaseDatabaseWrapper, partition: Partition, limit: int = 3) -> list[int]:
    """The ids of the first ``limit`` rows that keep ``partition``: unfinished, or
    ABANDONED ordered (until an operator requeues or skips them)."""
    sql = queries.sql("partition_blockers", identifiers={"partition": partition.name})
    return [pk for (pk,) in _rows(connection, sql, limit)]


def _blocked(connection: BaseDatabaseWrapper, partition: Partition) -> bool:
    """Whether ``partition`` holds an unfinished row (or an ABANDONED ordered one)."""
    return expiry(connection, partition, dt.timedelta(0), dt.timedelta(0)).blocked


def range_spans(connection: BaseDatabaseWrapper) -> list[tuple[int | None, int | None]]:
    """The ids of the ranges, which retention drops whole, as merged ``(lower, upper)``
    spans: row-by-row retention deletes outside them only, in the default partition. A
    range a row keeps (:func:`blockers`) keeps all its rows until that row is finished.
    Empty when the table is not partitioned."""
    spans: list[tuple[int | None, int | None]] = []
    if not is_partitioned(connection):
        return spans
    for partition in partitions(connection):
        if partition.default:
            continue
        if spans and spans[-1][1] == partition.lower:
            spans[-1] = (spans[-1][0], partition.upper)
        else:
            spans.append((partition.lower, partition.upper))
    return spans


def _indexes(connection: BaseDatabaseWrapper, table: str) -> list[tuple[str, str | None, bool]]:
    """Each index of ``table``: its name, the constraint it backs, whether attached."""
    return [
        (name, constraint, attached)
        for name, constraint, attached in _rows(
            connection, queries.sql("convert_indexes"), _quoted(table)
        )
    ]


def _twin_indexes() -> list[Any]:
    """The partitioned table's indexes: the model's, and a non-unique twin of each of
    its unique constraints and unique fields (same name, same condition)."""
    from django.db import models

    from ..models import OutboxMessage

    meta = OutboxMessage._meta
    twins = [
        models.Index(fields=list(c.fields), condition=c.condition, name=c.name)
        for c in meta.constraints
        if isinstance(c, models.UniqueConstraint)
    ]
    unique = [f for f in meta.local_fields if f.unique and not f.primary_key]
    twins += [models.Index(fields=[f.name], name=f"outbox_{f.name}_idx") for f in unique]
    return [*meta.indexes, *twins]


def convert(connection: BaseDatabaseWrapper, rows: int, ahead: int) -> list[Partition]:
    """Make the outbox table partitioned, in one transaction that holds it alone: its
    rows become the first range (every id drawn so far), a default partition and
    ``ahead`` empty ranges of ``rows`` ids follow, so that the first event staged after
    it finds its range. Returns the partitions.

    PostgreSQL reads the rows once (the range check) and builds the twins of the unique
    indexes on them: on a large table this holds staging for that long (docs/scaling.md)."""
    from ..models import OutboxMessage

    if is_partitioned(connection):
        raise OutboxConfigurationError("the outbox table is partitioned already")
    table, first = _table(), partition_name(0)
    with connection.schema_editor() as editor:
        _convert_timeouts(connection)
        _lock_alone(connection)
        _refuse_attachments(connection)
        pkey, sequence = _rows(connection, queries.sql("convert_names"), *[_quoted(table)] * 2)[0]
        acl = queries.sql("convert_acl", identifiers={"table": table})
        owner, grants = _rows(connection, acl, _quoted(table))[0]
        upper = next_id(connection)
        _execute(connection, "convert_rename", partition=first)
        for number, (index, _, _) in enumerate(_indexes(connection, first)):
            _execute(connection, "convert_rename_index", index=index, name=f"{first}_{number}")
        _execute(connection, "convert_detach_identity", partition=first)
        _execute(
            connection, "convert_parent", partition=first, sequence=sequence, start=upper, pkey=pkey
        )
        _execute(connection, "convert_owner", owner=owner)
        for grant in grants:  # the roles that staged, claimed or read the table still do
            editor.execute(grant)
        for index in _twin_indexes():
            editor.execute(index.create_sql(OutboxMessage, editor))
        _execute(connection, "convert_attach_first", partition=first, upper=upper)
        _drop_unattached(connection, first)
        default = Partition(None, None, f"{table}_default", default=True)
        _execute_with(connection, "partition_default", default, _storage(connection, first))
        _execute(connection, "notify_trigger")
        for lower in range(upper, upper + rows * ahead, rows):  # in place before staging goes on
            _attach(connection, Partition(lower, lower + rows, partition_name(lower)))
    return partitions(connection)


def _refuse_attachments(connection: BaseDatabaseWrapper) -> None:
    """Refuse, naming them, what the conversion would leave on the first partition."""
    counts = _rows(connection, queries.sql("convert_attachments"), *[_quoted(_table())] * 3)[0]
    if any(counts):
        publications, triggers, policies = counts
        raise OutboxConfigurationError(
            f"the outbox table has {publications} publications, {triggers} triggers and "
            f"{policies} row security policies of its own, which outbox_partition would leave "
            "on its first partition: drop them, partition, then make them again on the table"
        )


def _lock_alone(connection: BaseDatabaseWrapper) -> None:
    """Lock the table for the conversion; the one-line error when it stays busy."""
    try:
        with transaction.atomic(using=connection.alias):
            _execute(connection, "convert_lock")
    except OperationalError as error:
        if getattr(error.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
            raise
        raise OutboxConfigurationError(
            f"another transaction held the outbox table for {CONVERT_LOCK_TIMEOUT}: nothing "
            "changed; run outbox_partition again when no long transaction is open"
        ) from None


def _drop_unattached(connection: BaseDatabaseWrapper, first: str) -> None:
    """Drop the first partition's unique indexes: the partitioned table has their twins."""
    for index, constraint, attached in _indexes(connection, first):
        if attached:
            continue
        if constraint is None:
            _execute(connection, "convert_drop_index", index=index)
        else:
            _execute(connection, "convert_drop_constraint", partition=first, constraint=constraint)
