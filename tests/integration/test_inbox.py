"""The inbox: process_once, @inbox_handler and the failure records, on real PostgreSQL."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import uuid

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_outbox import InvalidMessage, ReceivedEvent, inbox_handler, process_once
from django_outbox.inbox import record_failure
from django_outbox.models import InboxFailure, InboxMessage
from tests.support import manage, row_retention, wait_until
from tests.testapp.models import Delivery

pytestmark = pytest.mark.django_db(transaction=True)


def test_first_delivery_is_new_and_a_second_is_not():
    event_id = uuid.uuid4()
    with process_once("billing", event_id) as new:
        assert new is True
        Delivery.objects.create(consumer="billing", event_id=event_id)
    with process_once("billing", str(event_id)) as new:
        assert new is False
    assert InboxMessage.objects.filter(consumer="billing", event_id=event_id).count() == 1
    assert Delivery.objects.count() == 1


def test_the_mark_is_one_statement_inside_the_transaction():
    with CaptureQueriesContext(connection) as queries, process_once("billing", uuid.uuid4()):
        pass
    inserts = [q["sql"] for q in queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1
    assert "ON CONFLICT DO NOTHING" in inserts[0]


def test_a_handler_error_rolls_back_the_mark_with_the_writes():
    event_id = uuid.uuid4()
    with pytest.raises(RuntimeError), process_once("billing", event_id) as new:
        assert new
        Delivery.objects.create(consumer="billing", event_id=event_id)
        raise RuntimeError("boom")
    assert not InboxMessage.objects.exists()
    assert not Delivery.objects.exists()
    with process_once("billing", event_id) as new:
        assert new is True  # the retry runs the handler


def test_different_consumers_each_handle_the_event_once():
    event_id = uuid.uuid4()
    runs = []
    for consumer in ("billing", "shipping", "billing", "shipping", "mail"):
        with process_once(consumer, event_id) as new:
            if new:
                runs.append(consumer)
    assert runs == ["billing", "shipping", "mail"]


def test_decorator_runs_once_and_returns_none_for_a_duplicate():
    calls = []

    @inbox_handler("mail")
    def send_mail(event, greeting):
        calls.append((event.event_id, greeting))
        return "sent"

    event = ReceivedEvent(uuid.uuid4(), "order.placed", {"order_id": 1}, {})
    assert send_mail(event, "hi") == "sent"
    assert send_mail(event, "hi again") is None
    assert send_mail({"event_id": str(event.event_id)}, "dict form") is None
    assert calls == [(event.event_id, "hi")]
    assert send_mail.inbox_consumer == "mail"
    assert send_mail.__wrapped__.__name__ == "send_mail"


def test_decorator_with_event_types_ignores_other_types_without_an_inbox_row(caplog):
    calls = []

    @inbox_handler("billing", event_types=("order.placed",))
    def bill(event):
        calls.append(event.event_type)
        return "billed"

    placed = ReceivedEvent(uuid.uuid4(), "order.placed", {}, {})
    shipped = ReceivedEvent(uuid.uuid4(), "order.shipped", {}, {})
    with caplog.at_level(logging.DEBUG, logger="django_outbox.inbox"):
        assert bill(shipped) is None
        assert bill({"event_id": str(shipped.event_id), "event_type": "order.shipped"}) is None
        assert bill(placed) == "billed"
    assert calls == ["order.placed"]
    assert bill.inbox_event_types == frozenset({"order.placed"})
    assert list(InboxMessage.objects.values_list("event_id", flat=True)) == [placed.event_id]
    ignored = [r for r in caplog.records if getattr(r, "action", None) == "inbox.ignored"]
    line = (
        f"billing: event {shipped.event_id} of type 'order.shipped' ignored "
        "(handles only order.placed)"
    )
    assert [r.getMessage() for r in ignored] == [line, line]
    assert {r.levelno for r in ignored} == {logging.DEBUG}


@pytest.mark.parametrize(
    ("event_types", "error", "message"),
    [
        (
            "order.placed",
            TypeError,
            "event_types must be a list of event type names, not one str: "
            "write event_types=['order.placed']",
        ),
        (
            [],
            ValueError,
            "event_types must name at least one event type; got an empty list",
        ),
        (
            ["order.placed", 7],
            TypeError,
            "event_types must hold non-empty str event type names; got 7",
        ),
        (
            ["order.placed", ""],
            TypeError,
            "event_types must hold non-empty str event type names; got ''",
        ),
        (
            42,
            TypeError,
            "event_types must be a list of event type names; got int 42",
        ),
    ],
)
def test_decorator_refuses_bad_event_types_when_it_decorates(event_types, error, message):
    with pytest.raises(error) as info:
        inbox_handler("billing", event_types=event_types)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (object(), "an inbox handler's first argument needs an event_id; got object"),
        ({"event_id": "nope"}, "an event id must be a UUID; got 'nope'"),
    ],
)
def test_decorator_refuses_an_event_without_a_usable_id(event, message):
    @inbox_handler("mail")
    def handler(event):
        raise AssertionError("must not run")

    with pytest.raises(InvalidMessage) as info:
        handler(event)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_process_once_refuses_a_bad_consumer_name():
    with pytest.raises(ValueError, match=r"an inbox consumer name is 1-255 characters; got ''"):
        with process_once("", uuid.uuid4()):
            pass


def _waiting_on_a_lock() -> bool:
    """Whether some backend waits for a lock (pg_locks is live; pg_stat_activity
    would show a snapshot frozen for the length of the caller's transaction)."""
    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
        return cursor.fetchone()[0] > 0


@pytest.mark.parametrize("first_commits", [True, False])
def test_two_concurrent_deliveries_run_the_body_exactly_once(first_commits):
    """Two threads (two real PostgreSQL connections) deliver one event at once.

    The first holds its uncommitted mark until the second is seen waiting on the
    unique index; then it commits (the second must skip) or fails (the second
    must run the body instead).
    """
    event_id = uuid.uuid4()
    first_inside = threading.Event()
    ran: list[str] = []
    errors: list[BaseException] = []

    def deliver(name: str, *, wait_for_rival: bool, fail: bool) -> None:
        try:
            with process_once("billing", event_id) as new:
                if new:
                    ran.append(name)
                    Delivery.objects.create(consumer=name, event_id=event_id)
                    first_inside.set()
                    if wait_for_rival:
                        wait_until(_waiting_on_a_lock, timeout=30, what="the rival to block")
                    if fail:
                        raise RuntimeError("handler failed")
        except RuntimeError:
            pass
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        finally:
            connections.close_all()

    first = threading.Thread(
        target=deliver, args=("first",), kwargs={"wait_for_rival": True, "fail": not first_commits}
    )
    first.start()
    assert first_inside.wait(30)
    second = threading.Thread(
        target=deliver, args=("second",), kwargs={"wait_for_rival": False, "fail": False}
    )
    second.start()
    first.join(60)
    second.join(60)
    assert errors == []
    assert ran == ["first"] if first_commits else ["first", "second"]
    survivor = "first" if first_commits else "second"
    assert list(Delivery.objects.values_list("consumer", flat=True)) == [survivor]
    assert InboxMessage.objects.filter(event_id=event_id).count() == 1


def test_record_failure_counts_deliveries_and_parks_at_the_limit():
    event = ReceivedEvent(uuid.uuid4(), "order.placed", {"n": 1}, {"event_id": "x", "a": 1})
    results = [
        record_failure(
            "billing", event, error=f"boom {i}", queue="orders", body='{"n": 1}', park_after=3
        )
        for i in range(3)
    ]
    assert results == [(1, False), (2, False), (3, True)]
    failure = InboxFailure.objects.get()
    assert (failure.consumer, failure.event_id, failure.queue, failure.event_type) == (
        "billing",
        event.event_id,
        "orders",
        "order.placed",
    )
    assert (failure.attempts, failure.last_error, failure.body) == (3, "boom 2", '{"n": 1}')
    assert failure.headers == {"event_id": "x", "a": 1}
    assert failure.parked_at is not None
    assert list(InboxFailure.objects.parked()) == [failure]


def test_record_failure_trusts_the_brokers_delivery_count_when_higher():
    quorum = ReceivedEvent(uuid.uuid4(), "t", {}, {})
    assert record_failure("c", quorum, error="e", broker_deliveries=5, park_after=5) == (5, True)
    classic = ReceivedEvent(uuid.uuid4(), "t", {}, {})
    assert record_failure("c", classic, error="e", park_after=5) == (1, False)
    assert InboxFailure.objects.get(event_id=classic.event_id).parked_at is None


@row_retention
def test_cleanup_removes_old_inbox_marks_and_failures_only():
    now = timezone.now()
    old, young = uuid.uuid4(), uuid.uuid4()
    InboxMessage.objects.create(consumer="c", event_id=old)
    InboxMessage.objects.create(consumer="c", event_id=young)
    InboxMessage.objects.filter(event_id=old).update(processed_at=now - dt.timedelta(days=8))
    stale = InboxFailure.objects.create(consumer="c", event_id=uuid.uuid4(), attempts=1)
    fresh = InboxFailure.objects.create(consumer="c", event_id=uuid.uuid4(), attempts=1)
    parked_old = InboxFailure.objects.create(consumer="c", event_id=uuid.uuid4(), attempts=5)
    parked_young = InboxFailure.objects.create(consumer="c", event_id=uuid.uuid4(), attempts=5)
    InboxFailure.objects.filter(pk=stale.pk).update(last_failed_at=now - dt.timedelta(days=8))
    # A parked row is kept for ABANDONED_RETENTION (30 days), however old its failures.
    InboxFailure.objects.filter(pk=parked_old.pk).update(
        last_failed_at=now - dt.timedelta(days=40), parked_at=now - dt.timedelta(days=31)
    )
    InboxFailure.objects.filter(pk=parked_young.pk).update(
        last_failed_at=now - dt.timedelta(days=40), parked_at=now - dt.timedelta(days=29)
    )

    counts = (
        "0 published, 0 abandoned, 1 inbox, 1 failures, 1 parked, "
        "0 tasks, 0 samples, 0 workers rows"
    )
    assert manage("outbox_cleanup", "--dry-run").stdout.strip() == f"would delete {counts}"
    assert manage("outbox_cleanup").stdout.strip() == f"deleted {counts}"
    assert list(InboxMessage.objects.values_list("event_id", flat=True)) == [young]
    assert set(InboxFailure.objects.values_list("pk", flat=True)) == {fresh.pk, parked_young.pk}


def test_inbox_retention_is_a_checked_setting():
    from django.test import override_settings

    from django_outbox.ops.checks import check_settings

    with override_settings(OUTBOX={"BROKER_URL": "memory://", "INBOX_RETENTION": "a week"}):
        [error] = check_settings(None)
    assert error.id == "django_outbox.E003"
    assert error.msg == (
        'OUTBOX["INBOX_RETENTION"] must be a positive number of seconds or a timedelta; '
        "got 'a week'."
    )
