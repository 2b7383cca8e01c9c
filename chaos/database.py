"""The runner's SQL: queries that ride out the PostgreSQL restarts the suite causes."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from django.db import DatabaseError, connection, transaction

from django_outbox.models import InboxFailure, InboxMessage, OutboxMessage, TaskResultRecord

from .destinations import CLUSTERED, KAFKA, KAFKA_ORDERED, KAFKA_TRANSACTIONAL, NATS, NATS_ORDERED
from .models import (
    BrokerCopy,
    Committed,
    Forged,
    Handled,
    Order,
    OrderedCopy,
    RolledBack,
    TaskEffect,
    Violation,
)

OUTBOX = OutboxMessage._meta.db_table
#: The outbox as the audit reads it: the table's rows and the rows deleted from it
#: (chaos migration 0006), a row deleted at its confirm as PUBLISHED.
OUTBOX_ROWS = "chaos_outbox_row"
#: The rows deleted from the outbox, as they were before their delete (migration 0006).
DELETED = "chaos_deleted_row"
INBOX = InboxMessage._meta.db_table
ORDER = Order._meta.db_table
HANDLED = Handled._meta.db_table
FORGED = Forged._meta.db_table
ROLLED_BACK = RolledBack._meta.db_table
BROKER = BrokerCopy._meta.db_table
VIOLATION = Violation._meta.db_table
ORDERED_COPY = OrderedCopy._meta.db_table
INBOX_FAILURE = InboxFailure._meta.db_table
TASK_RESULT = TaskResultRecord._meta.db_table
TASK_EFFECT = TaskEffect._meta.db_table
#: The events whose COMMIT returned to their producer (the pg-failover profiles).
COMMITTED = Committed._meta.db_table
RETRY_FOR = 120.0
#: The NATS destinations, as an SQL list. No consumer reads their stream during a run:
#: their events count as delivered once their row is PUBLISHED (the stream acknowledged
#: them), and the audit reads the stream at the end.
NATS_DESTINATIONS = f"('{NATS}', '{NATS_ORDERED}')"
#: The Kafka destinations (the kafka profile's), as SQL lists: the plain routes' (one
#: topic), and all three with the transactional one (a topic of its own). A consumer reads
#: each topic during the run, as RabbitMQ's queues.
KAFKA_PLAIN = f"('{KAFKA}', '{KAFKA_ORDERED}')"
KAFKA_DESTINATIONS = f"('{KAFKA}', '{KAFKA_ORDERED}', '{KAFKA_TRANSACTIONAL}')"
#: The committed orders a consumer handles: every one but the NATS destinations'.
CONSUMED = (
    f"(SELECT * FROM {ORDER} o WHERE NOT EXISTS (SELECT 1 FROM {OUTBOX_ROWS} r "
    f"WHERE r.event_id = o.event_id AND r.destination IN {NATS_DESTINATIONS}))"
)


def rows(sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
    """Run ``sql`` in autocommit; on a database error reconnect and try again, for up
    to two minutes (the injector restarts PostgreSQL under the runner too)."""
    deadline = time.monotonic() + RETRY_FOR
    while True:
        try:
            with connection.cursor() as cursor:
                cursor.execute(sql, params)
                return cursor.fetchall() if cursor.description else []
        except DatabaseError:
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def value(sql: str, params: Any = ()) -> Any:
    (row,) = rows(sql, params)
    return row[0]


def unhandled(up_to: int, after: int = 0) -> int:
    """Committed orders with ids in (``after``, ``up_to``] whose event the consumer has
    not handled, or (the NATS destinations') whose row is not PUBLISHED yet (``after``:
    an id up to which all are known handled, to keep this query small while the tables
    grow)."""
    return int(
        value(
            f"SELECT count(*) FROM {ORDER} o WHERE o.id > %s AND o.id <= %s AND NOT EXISTS "
            f"(SELECT 1 FROM {HANDLED} h WHERE h.event_id = o.event_id) AND NOT EXISTS "
            f"(SELECT 1 FROM {OUTBOX_ROWS} r WHERE r.event_id = o.event_id "
            f"AND r.destination IN {NATS_DESTINATIONS} AND r.status = 'published')",
            [after, up_to],
        )
    )


def stage_order(destination: str, key: str | None = None) -> str:
    """Commit an order of the runner's own (producer 0) with its event to
    ``destination`` (of an ordered route: with ``key``), as a producer does; returns the
    event id. Retried like :func:`rows`."""
    from django_outbox import stage

    deadline = time.monotonic() + RETRY_FOR
    while True:
        try:
            with transaction.atomic():
                row = stage(
                    "chaos.order", payload={"producer": 0}, destination=destination, key=key
                )
                Order.objects.create(producer=0, event_id=row.event_id)
            return str(row.event_id)
        except DatabaseError:
            connection.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def published_within(event_id: str, seconds: float) -> float | None:
    """The seconds until the event's row was PUBLISHED; None if not within ``seconds``."""
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        status = value(f"SELECT status FROM {OUTBOX_ROWS} WHERE event_id = %s", (event_id,))
        if status == "published":
            return time.monotonic() - began
        time.sleep(0.1)
    return None


def published_among(event_ids: list[str]) -> int:
    """How many of the events ``event_ids`` have their row PUBLISHED."""
    return int(
        value(
            f"SELECT count(*) FROM {OUTBOX_ROWS} WHERE event_id::text = ANY(%s) "
            "AND status = 'published'",
            [event_ids],
        )
    )


def last_order() -> int:
    return int(value(f"SELECT coalesce(max(id), 0) FROM {ORDER}"))


class Held(NamedTuple):
    """What :func:`held` finds of the rows a relay holds PROCESSING."""

    ids: list[int]
    handled: int  # handled by the consumer, or run by the task worker
    nats: list[str]  # the event ids of those of the NATS destinations
    kafka_handled: int  # of the Kafka destinations, and handled
    transactional_handled: int  # of those, the transactional destination's
    transactional: int  # of the transactional destination, handled or not


def held(worker: str, *, claimed_after: dt.datetime | None, lease: float) -> Held:
    """The rows ``worker`` holds PROCESSING, how many of them the consumer has already
    handled, or the task worker run (published, not yet finalized), the event ids of
    those of the NATS destinations (whether they are in the stream, the caller asks it),
    how many of them are of the Kafka destinations and handled (read from the topic), how
    many of those are of the transactional one (committed in a Kafka transaction), and how
    many rows of the transactional one it holds, handled or not.
    With ``claimed_after`` (a database time), only the rows it claimed after it (a
    claim's lease ends ``lease`` seconds after its transaction began)."""
    found = rows(
        f"SELECT o.id, EXISTS (SELECT 1 FROM {HANDLED} h WHERE h.event_id = o.event_id) "
        f"OR EXISTS (SELECT 1 FROM {TASK_EFFECT} t WHERE t.result_id = o.event_id), "
        f"CASE WHEN o.destination IN {NATS_DESTINATIONS} THEN o.event_id::text END, "
        f"o.destination IN {KAFKA_DESTINATIONS}, o.destination = '{KAFKA_TRANSACTIONAL}' "
        f"FROM {OUTBOX} o WHERE o.status = 'processing' AND o.locked_by = %s "
        "AND o.locked_until > coalesce(%s, '-infinity'::timestamptz) "
        "+ make_interval(secs => %s)",
        [worker, claimed_after, lease],
    )
    nats = [row[2] for row in found if row[2] is not None]
    handled = [row for row in found if row[1]]
    kafka = sum(1 for row in handled if row[3])
    transactional = sum(1 for row in handled if row[4])
    ids, of_transactional = [row[0] for row in found], sum(1 for row in found if row[4])
    return Held(ids, len(handled), nats, kafka, transactional, of_transactional)


@contextlib.contextmanager
def rows_locked(ids: list[int]) -> Iterator[None]:
    """Hold ``FOR UPDATE`` locks on the outbox rows ``ids`` for the block, in a
    transaction of the runner's own: a relay's mark of them waits until it ends."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SELECT id FROM {OUTBOX} WHERE id = ANY(%s) FOR UPDATE", [ids])
        yield


def terminate(application_name: str) -> None:
    """End the database sessions of ``application_name`` (a process killed: a statement
    of its still waiting for a lock would otherwise run once it is granted)."""
    rows(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
        [application_name],
    )


def still_held(ids: list[int], worker: str) -> int:
    return int(
        value(
            f"SELECT count(*) FROM {OUTBOX_ROWS} WHERE id = ANY(%s) AND status = 'processing' "
            "AND locked_by = %s",
            [ids, worker],
        )
    )


def backend_state(application_name: str) -> str | None:
    """The ``pg_stat_activity`` state of the process's connection (None: no connection)."""
    found = rows(
        "SELECT state FROM pg_stat_activity WHERE application_name = %s AND datname = "
        "current_database() ORDER BY state = 'idle'",
        [application_name],
    )
    return found[0][0] if found else None


def settled(after: int = 0) -> bool:
    """Every outbox row PUBLISHED and every committed order handled (with ``after``, every
    one with a higher id: a failover with asynchronous replication, chaos.failover)."""
    open_rows = value(f"SELECT count(*) FROM {OUTBOX_ROWS} WHERE status <> 'published'")
    return open_rows == 0 and unhandled(last_order(), after) == 0


def attempts() -> int:
    """Publish attempts spent so far on the rows published through the single broker
    (every destination but the cluster's: the broker faults act on that broker only, and
    a cluster connection a node restart left stale may reset at any time)."""
    return int(
        value(
            f"SELECT coalesce(sum(attempts), 0) FROM {OUTBOX_ROWS} WHERE destination <> %s",
            (CLUSTERED,),
        )
    )


def published() -> int:
    return int(value(f"SELECT count(*) FROM {OUTBOX_ROWS} WHERE status = 'published'"))


def last_outbox() -> int:
    return int(value(f"SELECT coalesce(max(id), 0) FROM {OUTBOX_ROWS}"))


def unpublished(up_to: int) -> int:
    """Outbox rows with ids up to ``up_to`` not PUBLISHED yet."""
    return int(
        value(
            f"SELECT count(*) FROM {OUTBOX_ROWS} WHERE id <= %s AND status <> 'published'",
            [up_to],
        )
    )


def now() -> Any:
    """The database's clock (the tasks' ``enqueued_at`` is written by it)."""
    return value("SELECT clock_timestamp()")


def unfinished_tasks(before: Any = None) -> int:
    """Committed Django tasks not finished (READY or RUNNING); with ``before``, only those
    enqueued before that time (of the database's clock)."""
    return int(
        value(
            f"SELECT count(*) FROM {TASK_RESULT} WHERE status IN ('READY', 'RUNNING') "
            "AND (%s::timestamptz IS NULL OR enqueued_at < %s)",
            [before, before],
        )
    )


def running_tasks() -> list[str]:
    """The ids of the Django tasks RUNNING now."""
    return [str(row[0]) for row in rows(f"SELECT id FROM {TASK_RESULT} WHERE status = 'RUNNING'")]


def task_attempts(ids: list[str]) -> list[tuple[str, int]]:
    """The status of each of the tasks ``ids`` and how many workers started it."""
    return [
        (status, int(workers))
        for status, workers in rows(
            f"SELECT status, jsonb_array_length(worker_ids) FROM {TASK_RESULT} "
            "WHERE id = ANY(%s::uuid[])",
            [ids],
        )
    ]
