"""Retention with more expired rows than one delete batch, on real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import io
import uuid

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_outbox.db import partitions
from django_outbox.models import InboxMessage, OutboxMessage, TaskResultRecord, TaskStatus
from django_outbox.relay import retention
from tests.support import row_retention

pytestmark = pytest.mark.django_db(transaction=True)

Status = OutboxMessage.Status


def _outbox_rows(count: int, **fields) -> set[int]:
    rows = OutboxMessage.objects.bulk_create(
        OutboxMessage(event_type="e", destination="d", payload={"n": n}, **fields)
        for n in range(count)
    )
    return {row.pk for row in rows}


def _inbox_marks(count: int, processed_at: dt.datetime) -> None:
    InboxMessage.objects.bulk_create(
        InboxMessage(consumer="c", event_id=uuid.uuid4()) for _ in range(count)
    )
    InboxMessage.objects.filter(processed_at__gt=processed_at).update(processed_at=processed_at)


def _task_results(count: int, status: str, finished_at: dt.datetime | None) -> set[uuid.UUID]:
    rows = TaskResultRecord.objects.bulk_create(
        TaskResultRecord(
            id=uuid.uuid4(),
            task_path="t.t",
            backend="default",
            queue_name="default",
            status=status,
            finished_at=finished_at,
        )
        for _ in range(count)
    )
    return {row.id for row in rows}


def _deletes(queries: CaptureQueriesContext, table: str) -> int:
    return sum(q["sql"].startswith(f'DELETE FROM "{table}"') for q in queries.captured_queries)


@row_retention
def test_cleanup_deletes_every_expired_row_over_several_batches_and_keeps_the_rest():
    now = timezone.now()
    week_ago, month_ago = now - dt.timedelta(days=8), now - dt.timedelta(days=31)
    old_published = _outbox_rows(2_345, status=Status.PUBLISHED, published_at=week_ago)
    young_published = _outbox_rows(
        40, status=Status.PUBLISHED, published_at=now - dt.timedelta(days=6)
    )
    _outbox_rows(1_001, status=Status.ABANDONED, abandoned_at=month_ago)
    young_abandoned = _outbox_rows(
        30, status=Status.ABANDONED, abandoned_at=now - dt.timedelta(days=29)
    )
    waiting = _outbox_rows(20, available_at=month_ago)  # PENDING however old: never deleted
    _inbox_marks(1_000, week_ago)  # exactly one batch: the next select finds none
    _task_results(1_100, TaskStatus.SUCCESSFUL, week_ago)
    _task_results(50, TaskStatus.FAILED, week_ago)
    young_results = _task_results(10, TaskStatus.FAILED, now - dt.timedelta(days=6))
    unfinished = _task_results(5, TaskStatus.RUNNING, None)  # however old: never deleted
    unfinished |= _task_results(5, TaskStatus.READY, None)

    assert retention.cleanup(dry_run=True) == {
        "published": 2_345,
        "abandoned": 1_001,
        "inbox": 1_000,
        "failures": 0,
        "parked": 0,
        "tasks": 1_150,
        "samples": 0,
        "workers": 0,
    }
    assert OutboxMessage.objects.count() == 2_345 + 40 + 1_001 + 30 + 20

    with CaptureQueriesContext(connection) as queries:
        counts = retention.cleanup()

    assert counts == {
        "published": 2_345,
        "abandoned": 1_001,
        "inbox": 1_000,
        "failures": 0,
        "parked": 0,
        "tasks": 1_150,
        "samples": 0,
        "workers": 0,
    }
    # Batches of DELETE_BATCH (1000) rows: 3 for the published rows, 2 for the abandoned.
    assert retention.DELETE_BATCH == 1000
    assert _deletes(queries, OutboxMessage._meta.db_table) == 3 + 2
    assert _deletes(queries, InboxMessage._meta.db_table) == 1
    assert _deletes(queries, TaskResultRecord._meta.db_table) == 2
    assert set(TaskResultRecord.objects.values_list("id", flat=True)) == young_results | unfinished
    left = set(OutboxMessage.objects.values_list("pk", flat=True))
    assert left == young_published | young_abandoned | waiting
    assert not left & old_published
    assert InboxMessage.objects.count() == 0
    assert retention.cleanup() == dict.fromkeys(counts, 0)


@row_retention
def test_a_small_batch_size_takes_as_many_rounds_as_it_needs():
    week_ago = timezone.now() - dt.timedelta(days=8)
    _outbox_rows(23, status=Status.PUBLISHED, published_at=week_ago)
    kept = _outbox_rows(5, status=Status.PUBLISHED, published_at=timezone.now())

    with CaptureQueriesContext(connection) as queries:
        counts = retention.cleanup(batch_size=5)

    assert counts["published"] == 23
    assert _deletes(queries, OutboxMessage._meta.db_table) == 5  # 5+5+5+5+3
    assert set(OutboxMessage.objects.values_list("pk", flat=True)) == kept


@pytest.mark.plain_outbox("partitions the outbox itself, inside the test's transaction")
@pytest.mark.django_db  # not transactional: the conversion rolls back with the test
def test_outbox_cleanup_counts_the_partitions_it_drops_apart_from_the_rows():
    _outbox_rows(3, status=Status.PUBLISHED, published_at=timezone.now() - dt.timedelta(8))
    partitions.convert(connection, rows=1000, ahead=2)  # the rows staged so far: one range
    young = _outbox_rows(2, status=Status.PUBLISHED, published_at=timezone.now())
    rows = "0 published, 0 abandoned, 0 inbox, 0 failures, 0 parked, 0 tasks, 0 samples"
    for options, verb in ((["--dry-run"], "would delete"), ([], "deleted")):
        out = io.StringIO()
        call_command("outbox_cleanup", *options, stdout=out)
        assert out.getvalue() == f"{verb} {rows}, 0 workers rows and 1 partition\n"
    assert set(OutboxMessage.objects.values_list("pk", flat=True)) == young
