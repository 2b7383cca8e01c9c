"""A partitioned outbox (issue 44): what removing one period's final rows costs
PostgreSQL, and the claim with many retained rows in closed ranges.

:func:`retention_by_partition` puts ``rows`` PUBLISHED rows past
``PUBLISHED_RETENTION`` in the outbox and runs the package's retention pass
(``retention.cleanup()``) on them twice: on the plain table, which deletes them row by
row, and on the table made partitioned (:func:`django_outbox.db.partitions.convert`,
ranges of ``rows`` ids), where the same rows fill one closed range, which the pass
drops. Each time: the pass's wall time, the WAL it wrote (``pg_current_wal_lsn()``
before and after, a ``CHECKPOINT`` just before, so both start without page images
owed), and the dead tuples left in the outbox's tables (``n_dead_tup`` of the table and
its partitions, read from a new session once the one that ran the pass is gone and two
reads agree: :func:`benchmarks.pgcost.settled`). Autovacuum is off for the plain table while it is
measured, so the count is what the pass left for vacuum, not what a vacuum racing it
had removed; the VACUUM that pays that debt is then timed too.

:func:`partitioned_claim_growth` is :func:`benchmarks.scenarios.claim_growth` on the
partitioned table: the claim with 1,000 PUBLISHED rows kept, then with ``retained``
kept in ``RANGES`` closed ranges (made ahead as the relays' retention makes them).

Both run after every other scenario: the table cannot be made plain again.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import statistics
import time
from collections.abc import Callable
from typing import Any, TypeVar

from django.conf import settings
from django.db import connection
from django.test import override_settings

from django_outbox.conf import outbox_settings
from django_outbox.db import partitions
from django_outbox.models import OutboxMessage
from django_outbox.relay import retention

from .pgcost import SETTLE_SECONDS, settled
from .scenarios import TABLE, claim_latencies, claim_plan, insert_published, reset_outbox

T = TypeVar("T")
#: The closed ranges the partitioned claim's retained rows fill.
RANGES = 10
#: How far past ``PUBLISHED_RETENTION`` the expired rows were published.
PAST_RETENTION = dt.timedelta(hours=1)
_DEAD_TUPLES = """
SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables
WHERE relid = %s::regclass OR relid IN (SELECT relid FROM pg_partition_tree(%s::regclass))
"""


@dataclasses.dataclass(frozen=True)
class Pass:
    """What one retention pass cost."""

    seconds: float
    wal_bytes: float
    dead_tuples: int
    counts: dict[str, int]


def _sql(statement: str, *params: Any) -> Any:
    """The first value of ``statement``'s first row (None when it returns none)."""
    with connection.cursor() as cursor:
        cursor.execute(statement, params or None)
        row = cursor.fetchone() if cursor.description else None
    return row[0] if row else None


def _partitioning(rows: int) -> override_settings:
    """The benchmark's settings with ``OUTBOX["PARTITIONING"]`` ranges of ``rows`` ids."""
    partitioning = {"rows": rows, "ahead": 2}
    return override_settings(OUTBOX={**settings.OUTBOX, "PARTITIONING": partitioning})


def _dead_tuples() -> int:
    """``n_dead_tup`` of the outbox table (and its partitions), once counted: the session
    that made the changes is closed (a backend flushes its statistics as it exits, where
    ``pg_stat_force_next_flush()`` once left them unflushed past two reads), and a new
    one reads them when that backend is gone and two reads agree."""
    connection.close()
    with connection.cursor() as cursor:
        deadline = time.monotonic() + SETTLE_SECONDS
        (dead,) = settled(cursor, _DEAD_TUPLES, [f'"{TABLE}"'] * 2, deadline)
    return int(dead)


def _expire(rows: int) -> None:
    """``rows`` PUBLISHED rows past their retention, vacuumed as autovacuum would."""
    insert_published(rows, ago=outbox_settings.PUBLISHED_RETENTION + PAST_RETENTION)
    _sql(f'VACUUM ANALYZE "{TABLE}"')


def _measured(work: Callable[[], T]) -> tuple[T, float, float]:
    """``work``'s answer, its seconds, and the WAL bytes written meanwhile."""
    before = _sql("SELECT pg_current_wal_lsn()")
    started = time.perf_counter()
    answer = work()
    seconds = time.perf_counter() - started
    return answer, seconds, float(_sql("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", before))


def _cleanup() -> Pass:
    """One retention pass, measured after a checkpoint; fails when it left an expired row."""
    _sql("CHECKPOINT")
    counts, seconds, wal = _measured(retention.cleanup)
    if OutboxMessage.objects.exists():
        raise RuntimeError(f"retention left expired rows (it reported {counts})")
    return Pass(seconds, wal, _dead_tuples(), counts)


def _vacuum() -> tuple[float, float]:
    """VACUUM of the outbox table: its seconds and WAL bytes."""
    _, seconds, wal = _measured(lambda: _sql(f'VACUUM "{TABLE}"'))
    return seconds, wal


def _by_deletion(rows: int) -> tuple[Pass, tuple[float, float]]:
    """The pass on the plain table, autovacuum off meanwhile; then the VACUUM it owes."""
    reset_outbox()
    _expire(rows)
    _sql(f'ALTER TABLE "{TABLE}" SET (autovacuum_enabled = off)')
    try:
        deleted = _cleanup()
        debt = _vacuum()
    finally:
        _sql(f'ALTER TABLE "{TABLE}" RESET (autovacuum_enabled)')
    return deleted, debt


def _by_drop(rows: int) -> Pass:
    """The pass on the table made partitioned in ranges of ``rows`` ids, the rows filling
    the first range above the ids drawn (a pass first drops the emptied table's range)."""
    reset_outbox()
    with _partitioning(rows):
        partitions.convert(connection, rows, 2)
        retention.cleanup()
        _expire(rows)
        return _cleanup()


def retention_by_partition(rows: int) -> dict[str, Any]:
    """``rows`` expired PUBLISHED rows removed by a retention pass: deleted from the plain
    table, then as a partition dropped (figures ``retention_*``)."""
    deleted, (vacuum_seconds, vacuum_wal) = _by_deletion(rows)
    dropped = _by_drop(rows)
    return {
        "retention_rows": rows,
        "retention_delete_seconds": deleted.seconds,
        "retention_delete_wal_bytes": deleted.wal_bytes,
        "retention_delete_dead_tuples": deleted.dead_tuples,
        "retention_delete_vacuum_seconds": vacuum_seconds,
        "retention_delete_vacuum_wal_bytes": vacuum_wal,
        "retention_drop_seconds": dropped.seconds,
        "retention_drop_wal_bytes": dropped.wal_bytes,
        "retention_drop_dead_tuples": dropped.dead_tuples,
        "retention_drop_partitions": dropped.counts.get("partitions", 0),
        "retention_drop_vs_delete": dropped.seconds / deleted.seconds,
    }


def _fresh_ranges(rows: int) -> None:
    """An emptied partitioned outbox whose ranges are ``rows`` ids from the ids drawn:
    the sequence moves past the ranges there are, and a retention pass drops them (all
    empty and closed) and makes new ones ahead."""
    reset_outbox()
    top = max((p.upper for p in partitions.partitions(connection) if p.upper), default=None)
    if top is not None and top > partitions.next_id(connection):
        _sql(f"SELECT setval(pg_get_serial_sequence('\"{TABLE}\"', 'id'), %s)", top - 1)
    retention.cleanup()


def _fill(retained: int, rows: int) -> int:
    """Top the outbox up to ``retained`` PUBLISHED rows in ranges of ``rows`` ids, the
    ranges made ahead before each range's rows (as the relays' retention makes them),
    then VACUUM ANALYZE; returns the partitions there are."""
    have = OutboxMessage.objects.published().count()
    for start in range(have, retained, rows):
        partitions.ensure_ahead(connection, rows, 2)
        insert_published(min(rows, retained - start))
    partitions.ensure_ahead(connection, rows, 2)
    _sql(f'VACUUM ANALYZE "{TABLE}"')
    return len(partitions.partitions(connection))


def _planned(batch_size: int, times: int = 5) -> dict[str, float]:
    """Of ``times`` claims of a batch, explained (:func:`benchmarks.scenarios.claim_plan`):
    the median planning and execution milliseconds and shared buffers touched."""
    plans = [claim_plan(batch_size) for _ in range(times)]
    return {
        "planning_ms": statistics.median(plan["Planning Time"] for plan in plans),
        "execution_ms": statistics.median(plan["Execution Time"] for plan in plans),
        "buffers": statistics.median(
            plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"] for plan in plans
        ),
    }


def _claims(retained: int, rows: int, claim_rows: int, batch_size: int) -> dict[str, float]:
    """The outbox topped up to ``retained`` PUBLISHED rows: the median claim's seconds, the
    partitions, and the claim's plan (:func:`_planned`)."""
    count = _fill(retained, rows)
    seconds = statistics.median(claim_latencies(claim_rows, batch_size))
    return {"seconds": seconds, "partitions": count, **_planned(batch_size)}


def partitioned_claim_growth(retained: int, claim_rows: int, batch_size: int) -> dict[str, Any]:
    """Median claim latency on a partitioned outbox with 1k PUBLISHED rows kept, then
    with ``retained`` kept in :data:`RANGES` closed ranges (figures
    ``partitioned_claim_*``), and what a claim's plan says of each."""
    rows = max(retained // RANGES, claim_rows)
    with _partitioning(rows):
        if not partitions.is_partitioned(connection):
            partitions.convert(connection, rows, 2)
        _fresh_ranges(rows)
        few = _claims(1_000, rows, claim_rows, batch_size)
        many = _claims(retained, rows, claim_rows, batch_size)
    reset_outbox()
    return {
        "partitioned_retained_rows": retained,
        "partitioned_claim_ms_1k": few["seconds"] * 1000,
        "partitioned_claim_ms_retained": many["seconds"] * 1000,
        "partitioned_claim_growth": many["seconds"] / few["seconds"],
        **{
            f"partitioned_claim_{name}_1k": value
            for name, value in few.items()
            if name != "seconds"
        },
        **{
            f"partitioned_claim_{name}_retained": value
            for name, value in many.items()
            if name != "seconds"
        },
        "partitioned_claim_buffers_growth": many["buffers"] / few["buffers"],
    }


#: The held-horizon drain's backlog spans this many ranges of a partitioned outbox.
HORIZON_RANGES = 10


def held_horizon(rows: int, batch_size: int) -> dict[str, Any]:
    """The claim under a held snapshot (:func:`benchmarks.horizon.held_on_partitions`) on
    a partitioned outbox whose ranges each hold a tenth of the backlog, made ahead."""
    from .horizon import held_on_partitions

    ranges = max(rows // HORIZON_RANGES, batch_size)
    with _partitioning(ranges):
        if not partitions.is_partitioned(connection):
            partitions.convert(connection, ranges, 2)
        _fresh_ranges(ranges)
        partitions.ensure_ahead(connection, ranges, HORIZON_RANGES + 2)
        return {"partitioned_horizon_range_rows": ranges, **held_on_partitions(rows, batch_size)}
