"""Two relays maintaining one partitioned outbox at once, on real PostgreSQL.

Every relay runs retention, so two passes can pick the same range to make or to drop:
the one that comes second must find the work done and end its pass quietly, not fail it
(``outbox.cleanup_failed``, the pass's row retention skipped). The chaos suite's
partitioned profile met both (``DuplicateTable`` in its relays' logs). Each test runs
the second relay's whole pass, in a thread with its own connection, at the point where
the first has chosen its range and not yet touched it (a wrapper around the function
that chose it): the interleaving is fixed, the statements and the database are real.

The partitioned table lives in a schema of its own, found first on each session's
search_path: the public schema's table stays as every other test needs it.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection, connections
from django.utils import timezone

from django_outbox.db import partitions
from django_outbox.models import OutboxMessage

pytestmark = pytest.mark.django_db(transaction=True)

SCHEMA = "outbox_partition_race"
ROWS = 10
DAY, MONTH = dt.timedelta(days=1), dt.timedelta(days=30)


def _search_path() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"SET search_path TO {SCHEMA}, public")


@pytest.fixture
def partitioned() -> Iterator[None]:
    """The outbox table, copied into ``SCHEMA`` and partitioned there into ranges of
    ``ROWS`` ids (one ahead); dropped with the schema afterwards."""
    table = OutboxMessage._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        cursor.execute(f"CREATE SCHEMA {SCHEMA}")
        cursor.execute(f'CREATE TABLE {SCHEMA}."{table}" (LIKE public."{table}" INCLUDING ALL)')
    _search_path()
    try:
        partitions.convert(connection, ROWS, 1)
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET search_path")
            cursor.execute(f"DROP SCHEMA {SCHEMA} CASCADE")


def _as_other_relay(work: Callable[[Any], Any]) -> Any:
    """``work(connection)`` run to its end by another relay: a thread of its own, so a
    database session of its own."""
    done: list[Any] = []

    def run() -> None:
        try:
            _search_path()
            done.append(work(connection))
        finally:
            connections.close_all()  # this thread's

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert done, "the other relay's pass failed"
    return done[0]


def _once(wrapped: Callable[..., Any], then: Callable[[], Any]) -> Callable[..., Any]:
    """``wrapped``, with ``then()`` run after its first call returns (the other relay's
    calls, through the module, get it plain)."""
    calls: list[Any] = []

    def first(*args: Any) -> Any:
        found = wrapped(*args)
        if not calls:
            calls.append(None)  # taken: the other relay's call comes through here too
            calls[0] = then()
        return found

    first.calls = calls  # type: ignore[attr-defined]
    return first


def _stage(count: int, **fields: Any) -> None:
    OutboxMessage.objects.bulk_create(
        OutboxMessage(event_type="e", destination="d", payload={"n": n}, **fields)
        for n in range(count)
    )


def test_a_range_another_relay_made_meanwhile_ends_the_pass_without_an_error(
    partitioned: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stage(5)  # into ids 1 to 11: no range lies wholly above the ids drawn
    other = _once(
        partitions._next_range,
        lambda: _as_other_relay(lambda c: partitions.ensure_ahead(c, ROWS, 1)),
    )
    monkeypatch.setattr(partitions, "_next_range", other)

    made = partitions.ensure_ahead(connection, ROWS, 1)

    assert [p.name for p in other.calls[0]] == [partitions.partition_name(11)]
    assert made == []
    ranges = [(p.lower, p.upper) for p in partitions.partitions(connection) if not p.default]
    assert ranges == [(None, 1), (1, 11), (11, 21)]


def test_a_range_another_relay_dropped_meanwhile_ends_the_pass_without_an_error(
    partitioned: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ids 1 to 10: the range of ids 1 to 11 is closed, its rows past retention.
    _stage(ROWS, status=OutboxMessage.Status.PUBLISHED, published_at=timezone.now() - 2 * DAY)
    other = _once(
        partitions.droppable,
        lambda: _as_other_relay(lambda c: partitions.drop_expired(c, DAY, MONTH)),
    )
    monkeypatch.setattr(partitions, "droppable", other)

    dropped = partitions.drop_expired(connection, DAY, MONTH)

    first, full = partitions.partition_name(0), partitions.partition_name(1)
    assert [p.name for p in other.calls[0]] == [first, full]
    assert dropped == []
    ranges = [(p.lower, p.upper) for p in partitions.partitions(connection) if not p.default]
    assert ranges == []
    assert OutboxMessage.objects.count() == 0
