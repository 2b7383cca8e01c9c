"""Every transition of django_outbox.store on real PostgreSQL ("default") and on
SQLite through the portable ORM path ("lite"): what each writes, what a lost
lease leaves alone, and the states requeue and abandon refuse."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.utils import timezone

from django_outbox.exceptions import RequeueRefused
from django_outbox.models import OutboxMessage
from django_outbox.state import store
from tests.factories import OutboxMessageFactory

Status = OutboxMessage.Status
DATABASES = ["default", "lite"]
pytestmark = pytest.mark.django_db(transaction=True, databases=DATABASES)


@pytest.fixture(params=DATABASES, ids=["postgresql", "sqlite"])
def using(request) -> str:
    return request.param


def _row(using: str, status: Status | None = None, **fields) -> OutboxMessage:
    row = OutboxMessageFactory.build(**fields, **({"status": status} if status else {}))
    row.save(using=using)
    return row


def _lease(minutes: float, token: uuid.UUID | None = None) -> dict:
    """PROCESSING under ``token`` until ``minutes`` from now (negative: expired), as a
    claim leaves a row: due since before the claim, the lease in ``locked_until`` alone."""
    until = timezone.now() + dt.timedelta(minutes=minutes)
    return {
        "status": Status.PROCESSING,
        "available_at": timezone.now() - dt.timedelta(hours=1),
        "locked_until": until,
        "locked_by": "relay:1",
        "lease_token": token or uuid.uuid4(),
    }


def _fresh(using: str, row: OutboxMessage) -> OutboxMessage:
    return OutboxMessage.objects.using(using).get(pk=row.pk)


def _claim(using: str, token: uuid.UUID, limit: int = 10) -> list[int]:
    claimed = store.claim(using, limit=limit, lease_seconds=60, worker="w:2", token=token)
    return [message.id for message in claimed]


def test_claim_leases_due_rows_and_reclaims_expired_leases_only(using):
    pending = _row(using)
    failed = _row(using, Status.FAILED, attempts=1)
    expired = _row(using, **_lease(-5))
    live = _row(using, **_lease(5))
    published = _row(using, published=True)
    token = uuid.uuid4()
    assert _claim(using, token) == [pending.pk, failed.pk, expired.pk]
    for row in (pending, failed, expired):
        fresh = _fresh(using, row)
        assert (fresh.status, fresh.lease_token, fresh.locked_by) == (
            Status.PROCESSING,
            token,
            "w:2",
        )
        assert fresh.locked_until > timezone.now() + dt.timedelta(seconds=50)
        assert fresh.available_at == row.available_at  # the lease is locked_until alone
    assert _fresh(using, live).lease_token == live.lease_token
    assert _fresh(using, published).status == Status.PUBLISHED
    assert _claim(using, uuid.uuid4()) == []


def test_record_publishes_fails_and_abandons_under_the_lease(using):
    token = uuid.uuid4()
    ok, retry, free, poison = (_row(using, **_lease(5, token), attempts=1) for _ in range(4))
    OutboxMessage.objects.using(using).filter(pk=ok.pk).update(last_error="an earlier try")
    lost = store.record(
        using,
        token,
        published=[ok.pk],
        failed=[
            store.FailedRows([retry.pk], "broker down", abandon=False, delay=120),
            store.FailedRows([free.pk], "not attempted", abandon=False, delay=0, counts=False),
            store.FailedRows([poison.pk], "no route", abandon=True, delay=0),
        ],
    )
    assert lost == set()
    ok, retry, free, poison = (_fresh(using, row) for row in (ok, retry, free, poison))
    assert (ok.status, ok.lease_token, ok.locked_until) == (Status.PUBLISHED, token, None)
    assert ok.last_error == ""
    assert ok.published_at is not None
    assert (retry.status, retry.attempts, retry.last_error) == (Status.FAILED, 2, "broker down")
    assert retry.available_at > timezone.now() + dt.timedelta(seconds=100)
    assert (free.status, free.attempts) == (Status.FAILED, 1)
    assert (poison.status, poison.attempts, poison.last_error) == (
        Status.ABANDONED,
        2,
        "no route",
    )
    assert poison.abandoned_at is not None
    assert {row.locked_until for row in (retry, free, poison)} == {None}


def test_a_lost_lease_leaves_the_taken_rows_untouched(using):
    token = uuid.uuid4()
    kept, taken_published, taken_failed = (_row(using, **_lease(5, token)) for _ in range(3))
    other = uuid.uuid4()
    OutboxMessage.objects.using(using).filter(pk__in=[taken_published.pk, taken_failed.pk]).update(
        lease_token=other
    )  # as another relay's reclaim would
    lost = store.record(
        using,
        token,
        published=[kept.pk, taken_published.pk],
        failed=[store.FailedRows([taken_failed.pk], "boom", abandon=False, delay=1)],
    )
    assert lost == {taken_published.pk, taken_failed.pk}
    assert _fresh(using, kept).status == Status.PUBLISHED
    for row in (taken_published, taken_failed):
        fresh = _fresh(using, row)
        assert (fresh.status, fresh.lease_token, fresh.attempts) == (Status.PROCESSING, other, 0)


def test_requeue_brings_back_failed_and_abandoned_rows_only(using):
    failed = _row(using, Status.FAILED, attempts=3, last_error="x")
    abandoned = _row(using, Status.ABANDONED, attempts=5, abandoned_at=timezone.now())
    others = [_row(using), _row(using, **_lease(5)), _row(using, published=True)]
    before = {row.pk: _fresh(using, row).status for row in others}
    assert store.requeue(using) == 2
    for row in (failed, abandoned):
        fresh = _fresh(using, row)
        assert (fresh.status, fresh.attempts, fresh.last_error) == (Status.PENDING, 0, "")
        assert (fresh.abandoned_at, fresh.lease_token) == (None, None)
    assert {row.pk: _fresh(using, row).status for row in others} == before


def test_abandon_refuses_a_live_lease_and_final_states(using):
    expired_token = uuid.uuid4()
    stoppable = [_row(using), _row(using, Status.FAILED), _row(using, **_lease(-1, expired_token))]
    live = _row(using, **_lease(5))
    published = _row(using, published=True)
    rows = OutboxMessage.objects.using(using).all()
    assert store.abandon(using, rows) == 3
    for row in stoppable:
        fresh = _fresh(using, row)
        assert (fresh.status, fresh.lease_token) == (Status.ABANDONED, None)
    assert _fresh(using, live).status == Status.PROCESSING
    assert _fresh(using, published).status == Status.PUBLISHED
    # The relay whose expired lease was abandoned writes nothing afterwards.
    assert store.record(using, expired_token, published=[stoppable[2].pk], failed=[]) == {
        stoppable[2].pk
    }
    assert _fresh(using, stoppable[2]).status == Status.ABANDONED


def test_requeue_selected_refuses_the_whole_selection_for_one_bad_row(using):
    abandoned = _row(using, Status.ABANDONED)
    published = _row(using, published=True)
    with pytest.raises(RequeueRefused, match=rf"not {published.pk} \(published\); nothing"):
        store.requeue_selected(using, ids=[abandoned.event_id, published.pk])
    with pytest.raises(RequeueRefused, match="no outbox row matches 999999; nothing requeued"):
        store.requeue_selected(using, ids=[abandoned.pk, 999999])
    assert _fresh(using, abandoned).status == Status.ABANDONED
    assert store.requeue_selected(using, ids=[abandoned.event_id]) == 1
    assert _fresh(using, abandoned).status == Status.PENDING


def test_requeue_selected_filters_by_state_and_event_type(using):
    failed = _row(using, Status.FAILED, event_type="a")
    abandoned_a = _row(using, Status.ABANDONED, event_type="a")
    abandoned_b = _row(using, Status.ABANDONED, event_type="b")
    assert store.requeue_selected(using, status="abandoned", event_type="a") == 1
    statuses = [_fresh(using, row).status for row in (failed, abandoned_a, abandoned_b)]
    assert statuses == [Status.FAILED, Status.PENDING, Status.ABANDONED]


def test_delete_in_batches_deletes_the_selection_a_batch_at_a_time(using):
    for _ in range(5):
        _row(using, published=True)
    kept = _row(using)
    rows = OutboxMessage.objects.using(using).published()
    assert store.delete_in_batches(rows, batch_size=2) == 5
    assert list(OutboxMessage.objects.using(using).values_list("pk", flat=True)) == [kept.pk]


def test_record_sends_the_batchs_ids_as_one_parameter_on_postgresql(using):
    """The finalize names a batch's rows with ``= ANY(%s)`` and one array on PostgreSQL
    (one short statement to parse and plan, whatever the batch size), with ``IN`` on
    SQLite; both mark exactly the rows under the lease."""
    from django.db import connections
    from django.test.utils import CaptureQueriesContext

    token = uuid.uuid4()
    mine = [_row(using, **_lease(5, token)) for _ in range(3)]
    other = _row(using, **_lease(5))  # another claim's row: not in the batch
    with CaptureQueriesContext(connections[using]) as queries:
        lost = store.record(using, token, published=[row.pk for row in mine], failed=[])
    assert lost == set()
    [update] = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    if using == "default":
        assert "= ANY(" in update and " IN (" not in update
    else:
        assert " IN (" in update
    assert {_fresh(using, row).status for row in mine} == {Status.PUBLISHED}
    assert _fresh(using, other).status == Status.PROCESSING


def test_with_no_published_retention_a_confirmed_row_is_deleted_under_its_lease(using, settings):
    settings.OUTBOX = {**settings.OUTBOX, "PUBLISHED_RETENTION": 0}
    token, other = uuid.uuid4(), uuid.uuid4()
    kept, taken, retry = (_row(using, **_lease(5, token)) for _ in range(3))
    expired = _row(using, **_lease(-5, token))  # not yet reclaimed: still this lease's
    OutboxMessage.objects.using(using).filter(pk=taken.pk).update(lease_token=other)
    lost = store.record(
        using,
        token,
        published=[kept.pk, taken.pk, expired.pk],
        failed=[store.FailedRows([retry.pk], "broker down", abandon=False, delay=1)],
    )
    assert lost == {taken.pk}
    rows = OutboxMessage.objects.using(using)
    assert set(rows.values_list("pk", flat=True)) == {taken.pk, retry.pk}
    assert (_fresh(using, taken).status, _fresh(using, taken).lease_token) == (
        Status.PROCESSING,
        other,
    )
    assert _fresh(using, retry).status == Status.FAILED
    assert store.record(using, other, published=[taken.pk], failed=[]) == set()
    assert not rows.filter(pk=taken.pk).exists()
