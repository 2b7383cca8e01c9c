"""What README.md and docs/ promise about statements and transports, measured.

- "one INSERT for N events": on PostgreSQL one statement writes up to
  ``INSERT_MAX_ROWS`` (9,362) rows, the most PostgreSQL's limit of 65,535 parameters
  allows with server-side binding; elsewhere ``bulk_create`` splits the rows by the
  database's own limit (SQLite: 999 parameters on Django 5.2, the connection's limit on
  Django 6), and the docs say so.
- "any kombu transport (memory ...)": a relay on ``memory://`` publishes, and a kombu
  consumer of the same in-process transport reads what the relay sent.
"""

from __future__ import annotations

import json
import sqlite3

import django
import kombu
import pytest
from django.conf import settings
from django.db import connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

from django_outbox import stage_many
from django_outbox.db.postgresql import INSERT_MAX_ROWS
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from tests.support import unique_destination

TABLE = OutboxMessage._meta.db_table


def _events(count: int, destination: str = "orders") -> list[dict]:
    return [
        {
            "event_type": "order.placed",
            "payload": {"order_id": n, "lines": [{"sku": f"s{n}", "qty": 1}]},
            "destination": destination,
            "key": f"order-{n}",
            "headers": {"tenant": "t1"},
        }
        for n in range(count)
    ]


def _staged_with(using: str, count: int) -> tuple[int, list[OutboxMessage]]:
    """Stage ``count`` events on ``using``; the INSERT statements it took, and the rows."""
    with CaptureQueriesContext(connections[using]) as queries:
        with transaction.atomic(using=using):
            rows = stage_many(_events(count), using=using)
    inserts = [q for q in queries.captured_queries if q["sql"].startswith(f'INSERT INTO "{TABLE}"')]
    return len(inserts), rows


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("count", [1, 1000])
def test_stage_many_is_one_insert_on_postgresql(count):
    inserts, rows = _staged_with("default", count)
    assert inserts == 1
    assert OutboxMessage.objects.count() == count
    assert len({row.pk for row in rows}) == count  # every row got its id back


@pytest.fixture
def server_side_binding():
    """Django's psycopg 3 option that sends parameters apart from the SQL, where
    PostgreSQL takes at most 65,535 of them a statement."""
    connection = connections["default"]
    options = connection.settings_dict["OPTIONS"]
    connection.close()
    connection.settings_dict["OPTIONS"] = {**options, "server_side_binding": True}
    try:
        yield
    finally:
        connection.close()
        connection.settings_dict["OPTIONS"] = options


@pytest.mark.django_db(transaction=True)
def test_stage_many_past_postgresqls_parameter_limit_with_server_side_binding(
    server_side_binding,
):
    assert INSERT_MAX_ROWS == 9362  # 65,535 parameters, 7 a row
    inserts, rows = _staged_with("default", INSERT_MAX_ROWS + 1)
    assert inserts == 2
    assert OutboxMessage.objects.count() == INSERT_MAX_ROWS + 1
    assert len({row.pk for row in rows}) == INSERT_MAX_ROWS + 1


@pytest.fixture
def sqlite_limit_999():
    """The "lite" connection's limit of parameters a statement lowered to 999, as in SQLite
    before 3.32, and restored after. Django 5.2 assumes 999 on SQLite whatever the
    connection allows; Django 6 reads the connection's limit, so at 999 both split alike."""
    connection = connections["lite"]
    connection.ensure_connection()
    limit = sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER
    before = connection.connection.setlimit(limit, 999)  # returns the old limit
    try:
        yield
    finally:
        connection.connection.setlimit(limit, before)


@pytest.mark.django_db(transaction=True, databases=["lite"])
def test_on_sqlite_stage_many_splits_the_rows_by_the_parameter_limit(sqlite_limit_999):
    inserts, rows = _staged_with("lite", 1000)
    # 999 parameters a statement (Django's max_query_params), and each row sends one per
    # column: about 60 rows an INSERT.
    assert connections["lite"].features.max_query_params == 999
    assert 10 < inserts < 1000
    assert OutboxMessage.objects.using("lite").count() == 1000
    assert len({row.pk for row in rows}) == 1000


@pytest.mark.skipif(
    django.VERSION < (6, 0),
    reason="Django 5.2 assumes 999 parameters on SQLite whatever the connection allows",
)
@pytest.mark.django_db(transaction=True, databases=["lite"])
def test_on_sqlite_django_6_takes_the_connections_own_parameter_limit():
    connection = connections["lite"]
    connection.ensure_connection()
    limit = connection.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
    assert connection.features.max_query_params == limit
    assert limit >= 32766  # SQLite's default since 3.32 (Debian builds it with 250,000)
    inserts, rows = _staged_with("lite", 1000)
    assert inserts == 1
    assert len({row.pk for row in rows}) == 1000


@pytest.mark.django_db(transaction=True)
def test_a_relay_on_the_memory_transport_publishes_what_a_kombu_consumer_reads():
    destination = unique_destination("mem")
    with override_settings(OUTBOX={**settings.OUTBOX, "BROKER_URL": "memory://"}):
        with transaction.atomic():
            rows = stage_many(_events(5, destination))
        with Relay() as relay:
            stats = relay.run_once()
    assert (stats.claimed, stats.published, stats.failed) == (5, 5, 0)
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {"published"}

    with kombu.Connection("memory://") as connection:
        queue = connection.SimpleQueue(destination)
        received = []
        while len(received) < 6:  # one more than sent: nothing else is there
            try:
                message = queue.get(block=False)
            except queue.Empty:
                break
            message.ack()
            received.append(message)
        queue.close()
    assert [m.headers["event_id"] for m in received] == [str(row.event_id) for row in rows]
    assert [json.loads(m.body) for m in received] == [e["payload"] for e in _events(5)]
    first = received[0]
    assert first.content_type == "application/json"
    assert first.headers["tenant"] == "t1"
    assert first.headers["ordering_key"] == "order-0"
    assert first.properties["message_id"] == str(rows[0].event_id)
