"""Dedup keys and cancellation (docs/scheduling.md) on real PostgreSQL transactions,
and on SQLite where the portable path stages them."""

from __future__ import annotations

import datetime as dt
import threading
import uuid

import pytest
from django.db import transaction
from django.test.utils import override_settings
from django.utils import timezone

from django_outbox import (
    CancelRefused,
    EventInFlight,
    InvalidEvent,
    NotInTransaction,
    cancel,
    db,
    event_committed,
    publish_on_success,
    stage,
    stage_many,
)
from django_outbox.models import OutboxMessage
from django_outbox.state import store
from tests.integration.test_ordering import _Thread, _waiting_for_a_lock
from tests.support import unique_destination, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _stage(destination: str, n: int, using: str = "default", **options) -> OutboxMessage:
    with transaction.atomic(using=using):
        return stage("t", {"n": n}, destination=destination, using=using, **options)


def _claim(using: str = "default") -> list[int]:
    batch = db.claim(using, limit=10, lease_seconds=30, worker="w", token=uuid.uuid4())
    return [message.id for message in batch]


def test_two_transactions_staging_one_dedup_key_at_once_leave_one_event():
    """T1 stages the key and stays open; T2 stages it too and waits on the unique index
    for T1's commit, then learns it was deduplicated: no read-then-write race."""
    destination = unique_destination()
    staged, release = threading.Event(), threading.Event()
    outcomes: dict[str, str] = {}

    def first() -> None:
        with transaction.atomic():
            outcomes["t1"] = stage(
                "t", {"n": 1}, destination=destination, dedup_key="k"
            ).staging_outcome
            staged.set()
            assert release.wait(30)

    def second() -> None:
        assert staged.wait(30)
        outcomes["t2"] = _stage(destination, 2, dedup_key="k").staging_outcome

    threads = [_Thread(first), _Thread(second)]
    for thread in threads:
        thread.start()
    wait_until(_waiting_for_a_lock, timeout=30, what="T2 to wait for T1's row")
    release.set()
    for thread in threads:
        thread.join_checked()
    assert outcomes == {"t1": "staged", "t2": "deduplicated"}
    assert list(OutboxMessage.objects.values_list("payload", flat=True)) == [{"n": 1}]


def test_writers_released_together_stage_one_event_per_dedup_key():
    destination = unique_destination()
    barrier = threading.Barrier(4)
    outcomes: list[str] = []

    def writer(n: int) -> None:
        with transaction.atomic():
            barrier.wait(30)
            outcomes.append(
                stage("t", {"n": n}, destination=destination, dedup_key="k").staging_outcome
            )

    threads = [_Thread(lambda n=n: writer(n)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join_checked()
    assert sorted(outcomes) == ["deduplicated"] * 3 + ["staged"]
    assert OutboxMessage.objects.filter(destination=destination).count() == 1


def test_a_duplicate_keeps_the_first_event_by_default():
    destination = unique_destination()
    first = _stage(destination, 1, dedup_key="k")
    again = _stage(destination, 2, dedup_key="k", available_at=timezone.now())
    assert (again.pk, again.payload, again.staging_outcome) == (first.pk, {"n": 1}, "deduplicated")
    assert OutboxMessage.objects.get().payload == {"n": 1}


def test_replace_takes_the_payload_headers_and_time_of_the_later_event():
    destination = unique_destination()
    first = _stage(destination, 1, dedup_key="k")
    later = timezone.now() + dt.timedelta(hours=1)
    again = _stage(
        destination,
        2,
        dedup_key="k",
        on_duplicate="replace",
        headers={"h": "2"},
        available_at=later,
    )
    assert (again.pk, again.staging_outcome) == (first.pk, "replaced")
    row = OutboxMessage.objects.get()
    assert (row.payload, row.headers["h"], row.available_at) == ({"n": 2}, "2", later)


def test_replace_leaves_an_event_in_flight_alone_and_says_so():
    destination = unique_destination()
    first = _stage(destination, 1, dedup_key="k")
    assert _claim() == [first.pk]
    again = _stage(destination, 2, dedup_key="k", on_duplicate="replace")
    assert (again.pk, again.staging_outcome) == (first.pk, "in_flight")
    assert OutboxMessage.objects.get().payload == {"n": 1}


def test_a_dedup_key_is_free_again_once_its_event_is_published():
    destination = unique_destination()
    first = _stage(destination, 1, dedup_key="k")
    token = uuid.uuid4()
    db.claim("default", limit=10, lease_seconds=30, worker="w", token=token)
    assert db.mark_published("default", [first.pk], token) == 1
    again = _stage(destination, 2, dedup_key="k")
    assert again.staging_outcome == "staged" and again.pk != first.pk
    assert OutboxMessage.objects.filter(destination=destination).count() == 2


def test_event_committed_lists_only_the_events_added():
    destination = unique_destination()
    sent: list[list[int]] = []

    def receiver(sender, messages, using, **kwargs):
        sent.append([message.pk for message in messages])

    event_committed.connect(receiver)
    try:
        first = _stage(destination, 1, dedup_key="k")
        _stage(destination, 2, dedup_key="k")
        _stage(destination, 3, dedup_key="k", on_duplicate="replace")
    finally:
        event_committed.disconnect(receiver)
    assert sent == [[first.pk]]


def test_an_abandoned_event_frees_its_dedup_key():
    destination = unique_destination()
    first = _stage(destination, 1, dedup_key="k")
    assert store.abandon("default", OutboxMessage.objects.filter(pk=first.pk)) == 1
    assert _stage(destination, 2, dedup_key="k").staging_outcome == "staged"


def test_a_requeue_leaves_out_an_abandoned_event_whose_dedup_key_is_held(caplog):
    """Requeued, the abandoned rows would name two unfinished events with one dedup key
    (the unique index would refuse the whole requeue): the one staged since keeps it,
    and of two abandoned ones the newer takes it."""
    destination = unique_destination()
    old, older = _stage(destination, 1, dedup_key="k"), _stage(destination, 2, dedup_key="j")
    store.abandon("default", OutboxMessage.objects.filter(pk__in=[old.pk, older.pk]))
    newer = _stage(destination, 3, dedup_key="j")
    store.abandon("default", OutboxMessage.objects.filter(pk=newer.pk))
    holder = _stage(destination, 4, dedup_key="k")
    assert store.requeue("default") == 1
    states = dict(OutboxMessage.objects.values_list("id", "status"))
    assert states == {
        old.pk: "abandoned",
        older.pk: "abandoned",
        newer.pk: "pending",
        holder.pk: "pending",
    }
    held = [r.id for r in caplog.records if getattr(r, "action", "") == "outbox.requeue_dedup_held"]
    assert sorted(held) == sorted([old.pk, older.pk])


def test_the_same_dedup_key_on_another_destination_is_another_event():
    first = _stage(unique_destination(), 1, dedup_key="k")
    other = _stage(unique_destination(), 2, dedup_key="k")
    assert other.staging_outcome == "staged" and other.pk != first.pk


def test_stage_many_stages_a_dedup_key_given_twice_in_one_call_once():
    destination = unique_destination()
    events = [
        {"event_type": "t", "payload": {"n": n}, "destination": destination} for n in range(4)
    ]
    events[0]["dedup_key"] = events[2]["dedup_key"] = "a"
    events[1]["dedup_key"] = "b"
    with transaction.atomic():
        rows = stage_many(events)
    assert [row.staging_outcome for row in rows] == ["staged", "staged", "deduplicated", "staged"]
    assert rows[2].pk == rows[0].pk and rows[2].payload == {"n": 0}
    assert sorted(OutboxMessage.objects.values_list("payload__n", flat=True)) == [0, 1, 3]
    with pytest.raises(InvalidEvent, match=r"events #0 and #2 share dedup key 'a'"):
        with transaction.atomic():
            stage_many(events, on_duplicate="replace")


@pytest.mark.parametrize(
    ("dedup_key", "match"),
    [
        (7, "dedup_key must be None or a non-empty string of at most 255 characters; got int"),
        ("", "dedup_key must be None or a non-empty string"),
        ("x" * 256, "dedup_key must be None or a non-empty string of at most 255"),
        ("a\x00b", "the dedup key of event 't'"),
    ],
)
def test_a_bad_dedup_key_is_refused_before_any_sql(dedup_key, match):
    with pytest.raises(InvalidEvent, match=match), transaction.atomic():
        stage("t", {}, destination="q", dedup_key=dedup_key)
    assert not OutboxMessage.objects.exists()


def test_a_bad_on_duplicate_is_refused():
    with pytest.raises(
        InvalidEvent, match="on_duplicate must be one of 'keep', 'replace'; got 'merge'"
    ):
        _stage("q", 1, dedup_key="k", on_duplicate="merge")


def test_publish_on_success_takes_a_dedup_key_mapper():
    destination = unique_destination()

    @publish_on_success(
        "t",
        destination=destination,
        payload=lambda result, n: {"n": n},
        dedup_key=lambda result, n: f"k{n % 2}",
    )
    def work(n: int) -> int:
        return n

    for n in range(4):
        work(n)
    assert sorted(OutboxMessage.objects.values_list("payload__n", flat=True)) == [0, 1]


def test_publish_on_success_refuses_a_bad_dedup_key_when_applied():
    with pytest.raises(InvalidEvent, match="dedup_key must be None or a non-empty string"):
        publish_on_success("t", destination="q", payload=lambda result: {}, dedup_key="")


def test_a_dedup_key_staged_twice_in_one_transaction_stages_once():
    destination = unique_destination()
    with transaction.atomic():
        first = stage("t", {"n": 1}, destination=destination, dedup_key="k")
        again = stage("t", {"n": 2}, destination=destination, dedup_key="k", on_duplicate="replace")
    assert (again.pk, again.staging_outcome, again.payload) == (first.pk, "replaced", {"n": 2})
    assert OutboxMessage.objects.get().payload == {"n": 2}


def test_cancel_removes_an_event_not_yet_claimed_and_says_whether_it_did():
    destination = unique_destination()
    by_key = _stage(destination, 1, dedup_key="k")
    by_id = _stage(destination, 2)
    with transaction.atomic():
        assert cancel(destination=destination, dedup_key="k") is True
        assert cancel(destination=destination, event_id=by_id.event_id) is True
        assert cancel(destination=destination, dedup_key="k") is False
    assert not OutboxMessage.objects.filter(pk__in=[by_key.pk, by_id.pk]).exists()
    assert _stage(destination, 3, dedup_key="k").staging_outcome == "staged"


def test_cancel_rolls_back_with_the_callers_transaction():
    destination = unique_destination()
    _stage(destination, 1, dedup_key="k")
    with pytest.raises(RuntimeError), transaction.atomic():
        assert cancel(destination=destination, dedup_key="k")
        raise RuntimeError("the business write failed")
    assert OutboxMessage.objects.filter(destination=destination).count() == 1


def test_cancel_refuses_an_event_in_flight():
    destination = unique_destination()
    row = _stage(destination, 1, dedup_key="k")
    _claim()
    with (
        pytest.raises(EventInFlight, match=r"is in flight \(claimed by relay 'w'\)"),
        transaction.atomic(),
    ):
        cancel(destination=destination, dedup_key="k")
    assert OutboxMessage.objects.get().pk == row.pk


def test_cancel_refuses_an_event_of_an_ordered_route():
    destination = unique_destination()
    with override_settings(OUTBOX={"ROUTES": {destination: {"exchange": "x", "ordered": True}}}):
        row = _stage(destination, 1, key="a")
        with pytest.raises(CancelRefused, match="ordered route"), transaction.atomic():
            cancel(destination=destination, event_id=row.event_id)
        with pytest.raises(InvalidEvent, match="dedup_key is refused on ordered routes"):
            _stage(destination, 2, key="a", dedup_key="k")
    assert OutboxMessage.objects.get().pk == row.pk


def test_cancel_outside_a_transaction_is_refused():
    with pytest.raises(NotInTransaction, match=r"cancel\(\) must run inside transaction.atomic"):
        cancel(destination="q", dedup_key="k")
    with pytest.raises(TypeError, match="exactly one"):
        cancel(destination="q")


@pytest.mark.django_db(transaction=True, databases=["lite"])
def test_sqlite_deduplicates_replaces_and_cancels():
    first = _stage("q", 1, using="lite", dedup_key="k")
    assert _stage("q", 2, using="lite", dedup_key="k").staging_outcome == "deduplicated"
    replaced = _stage("q", 3, using="lite", dedup_key="k", on_duplicate="replace")
    assert (replaced.pk, replaced.staging_outcome, replaced.payload) == (
        first.pk,
        "replaced",
        {"n": 3},
    )
    with transaction.atomic(using="lite"):
        assert cancel(destination="q", dedup_key="k", using="lite") is True
    assert not OutboxMessage.objects.using("lite").exists()
