"""Retention runs off the publishing path: a DELETE held up by a lock does not hold up
the relay's batches (real PostgreSQL, real RabbitMQ)."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
from django.conf import settings
from django.db import connection, connections, transaction
from django.test.utils import override_settings
from django.utils import timezone

from django_outbox.models import OutboxMessage
from django_outbox.relay import BatchStats, Relay
from tests.factories import OutboxMessageFactory
from tests.support import delete_queue, stage_events, unique_destination, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def destination():
    name = unique_destination()
    yield name
    delete_queue(name)


def deletes_waiting_for_a_lock() -> int:
    """Statements deleting outbox rows that wait for a lock, on any connection."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query ILIKE 'DELETE FROM %%django_outbox_outboxmessage%%'"
        )
        return cursor.fetchone()[0]


def hold_row_lock(pk: int, locked: threading.Event, release: threading.Event) -> None:
    """A second connection locks row ``pk`` (as a long transaction would) until ``release``."""
    try:
        with transaction.atomic():
            OutboxMessage.objects.select_for_update().get(pk=pk)
            locked.set()
            release.wait(120)
    finally:
        connections.close_all()


@pytest.mark.plain_outbox(
    "holds a row lock against retention's row DELETE: on a partitioned outbox the"
    " row's range is not closed, so retention issues no DELETE to hold"
)
def test_a_blocked_retention_delete_does_not_delay_batches(destination):
    expired = OutboxMessageFactory(
        published=True, published_at=timezone.now() - dt.timedelta(days=30)
    )
    locked, release, stop = threading.Event(), threading.Event(), threading.Event()
    published: list[BatchStats] = []
    locker = threading.Thread(target=hold_row_lock, args=(expired.pk, locked, release))
    locker.start()
    assert locked.wait(30)

    def on_batch(stats: BatchStats) -> None:
        published.append(stats)

    def run() -> None:
        try:
            Relay().run(stop, on_batch=on_batch)
        finally:
            connections.close_all()

    relay = threading.Thread(target=run)
    with override_settings(OUTBOX={**settings.OUTBOX, "CLEANUP_INTERVAL": 0.001}):
        relay.start()
        try:
            wait_until(lambda: deletes_waiting_for_a_lock() == 1, timeout=30, what="a held DELETE")
            stage_events(5, destination)
            wait_until(
                lambda: sum(s.published for s in published) == 5, timeout=30, what="5 published"
            )
            # Published while the retention DELETE was (and still is) waiting for the lock.
            assert deletes_waiting_for_a_lock() == 1
            assert OutboxMessage.objects.filter(pk=expired.pk).exists()
        finally:
            release.set()
            locker.join(60)
            stop.set()
            relay.join(60)
    assert not relay.is_alive()
    # Stopping the relay waited for the retention pass, which then deleted the row.
    assert not OutboxMessage.objects.filter(pk=expired.pk).exists()
    assert OutboxMessage.objects.filter(destination=destination, status="published").count() == 5
