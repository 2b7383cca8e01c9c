"""Outbox rows in the tests: events staged to a destination no other test uses, rows
counted per state, the database clock's minute, a claimed message built without a row,
TASKS that require a transaction, and the marks of tests that need the outbox table not
partitioned (tests/conftest.py's ``--partitioned-outbox``)."""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
import time
import uuid

import pytest
from django.db import connection, connections, transaction

from django_outbox import stage_many
from django_outbox.db import database_now
from django_outbox.envelope import ClaimedMessage
from django_outbox.models import OutboxMessage
from django_outbox.workers.samples import current_minute


def as_on_the_table(plan: str, using: str = "default") -> str:
    """``plan`` (EXPLAIN's text) as it reads on a table that is not partitioned: each
    partition's index named as the outbox's index it is part of, and the Seq Scan of a
    partition that holds no page (a range made ahead; the planner reads one for free)
    named ``Empty Partition``. The same text on a plain table."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT child.relname, parent.relname, pg_relation_size(child.oid) = 0"
            " FROM pg_inherits JOIN pg_class AS child ON child.oid = inhrelid"
            " JOIN pg_class AS parent ON parent.oid = inhparent"
        )
        found = cursor.fetchall()
    for child, parent, empty in found:
        if empty:
            plan = re.sub(rf"Seq Scan on {re.escape(child)}\b", "Empty Partition", plan)
        else:
            plan = re.sub(rf"\b{re.escape(child)}\b", parent, plan)
    return plan


#: A test that counts the outbox rows retention deletes one by one.
row_retention = pytest.mark.plain_outbox(
    "counts rows retention deletes one by one: a partitioned outbox drops closed ranges"
    " whole and deletes the default partition's rows only"
)


def unique_destination(prefix: str = "t") -> str:
    """A destination (and so a queue) no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def stage_events(
    count: int, destination: str, *, using: str = "default", chunk: int = 1000, keys: int = 0
):
    """Commit ``count`` events to ``destination``; payload {"n": i}. Returns their event ids."""
    ids: list[str] = []
    for start in range(0, count, chunk):
        with transaction.atomic(using=using):
            rows = stage_many(
                [
                    {
                        "event_type": "test.event",
                        "payload": {"n": n},
                        "destination": destination,
                        **({"key": f"k{n % keys}"} if keys else {}),
                    }
                    for n in range(start, min(start + chunk, count))
                ],
                using=using,
            )
        ids += [str(row.event_id) for row in rows]
    return ids


def claimed_message(n: int, destination: str = "orders") -> ClaimedMessage:
    """A message as the relay claims it (payload {"n": n}, key ``order-n``), no row behind it."""
    return ClaimedMessage(
        id=n,
        event_id=uuid.uuid4(),
        event_type="order.placed",
        destination=destination,
        payload=json.dumps({"n": n}),
        headers={"tenant": "t1"},
        ordering_key=f"order-{n}",
        attempts=0,
        created_at=dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
    )


def status_counts(using: str = "default") -> dict[str, int]:
    counts = {s.value: 0 for s in OutboxMessage.Status}
    for status in OutboxMessage.objects.using(using).values_list("status", flat=True):
        counts[status] += 1
    return counts


def minute_with_time_left(using: str = "default", *, seconds: int = 10) -> dt.datetime:
    """The database clock's minute, with at least ``seconds`` of it left (the end of a
    minute is waited out), so that what a test does next falls in this minute."""
    now = database_now(using)
    if now.second >= 60 - seconds:
        time.sleep(61 - now.second)
    return current_minute(using)


#: TASKS with the outbox backend refusing an enqueue outside the caller's transaction.
TASKS_REQUIRING_TRANSACTION = {
    "default": {
        "BACKEND": "django_outbox.tasks.OutboxTaskBackend",
        "QUEUES": [],
        "OPTIONS": {"REQUIRE_TRANSACTION": True},
    }
}


class Producer(threading.Thread):
    """Commits ``chunk`` events to ``destination`` every ``every`` seconds or so until
    stopped, so that a relay is publishing whenever a test's fault lands."""

    def __init__(self, destination: str, chunk: int = 25, every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.destination, self.chunk, self.every = destination, chunk, every
        self.ids: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self.ids += stage_events(self.chunk, self.destination)
                self.done.wait(self.every)
        finally:
            connection.close()

    def stop(self) -> list[str]:
        """Stop committing; the ids of every event committed."""
        self.done.set()
        if self.is_alive():
            self.join(timeout=60)
        return self.ids
