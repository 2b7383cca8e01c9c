"""Celery routes end to end: the relay sends tasks, a real worker runs them through the inbox."""

from __future__ import annotations

import json
import re
import signal
import threading

import pytest
from django.db import transaction
from django.db.models.functions import Now
from django.test import override_settings

from django_outbox import InvalidEvent, stage
from django_outbox.conf.routes import CELERY_FIELDS
from django_outbox.exceptions import BrokerOutOfMemory
from django_outbox.models import InboxMessage, OutboxMessage
from django_outbox.relay import Relay
from django_outbox.staging import RESERVED_HEADERS
from django_outbox.transports.celery import CeleryTransport
from tests.integration.test_amqp_wire import small_frames
from tests.integration.test_silent_broker import memory_alarm
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    confirming_celery_queue,
    delete_queue,
    delete_redis_keys,
    drain_raw,
    queue_settled,
    rabbitmqctl,
    redis_maxmemory,
    services,
    stage_events,
    start_worker,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp.models import Delivery
from tests.testapp.tasks import bill, record_payment

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.disrupts]

TASK = "testapp.record_payment"
ROUTES = {"payments": {"celery_task": TASK}}


@pytest.fixture
def celery_queue():
    """A Celery app (current in this process, for the relay) sending to a private queue."""
    from celery import Celery

    queue = unique_destination("celery")
    app = Celery("outbox-tests-relay", broker=AMQP_URL, set_as_current=True)
    app.conf.task_default_queue = queue
    yield queue
    delete_queue(queue)


def relay_all() -> None:
    assert relay_until_done().published == OutboxMessage.objects.count()


def relay_until_done():  # type: ignore[no-untyped-def]
    """Relay every due row to the Celery route of "payments"; the totals."""
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": ROUTES}):
        return Relay().run(threading.Event(), drain=True)


#: Tasks relayed twice to one worker: several batches of the relay and prefetches of the
#: worker (it was 1,000, which took a minute of CI for nothing more).
TASKS = 300


@pytest.mark.slow
def test_a_worker_runs_each_relayed_task_once_though_every_task_arrives_twice(
    celery_queue, tmp_path
):
    stage_events(TASKS, "payments")
    relay_all()
    log = tmp_path / "worker.log"
    worker = start_worker(celery_queue, log)
    try:
        wait_until(
            lambda: Delivery.objects.filter(consumer="celery").count() == TASKS,
            timeout=300,
            what=f"the worker to run {TASKS} tasks",
        )
        # The relay publishes them all again (as after a crash before finalize).
        OutboxMessage.objects.update(
            status=OutboxMessage.Status.PENDING, available_at=Now(), published_at=None
        )
        relay_all()
        wait_until(lambda: queue_settled(celery_queue), timeout=300, what="the queue to drain")
    finally:
        stop(worker, signal.SIGTERM)
    output = log.read_text()
    assert worker.returncode == 0, output
    assert Delivery.objects.filter(consumer="celery").count() == TASKS
    ids = set(OutboxMessage.objects.values_list("event_id", flat=True))
    assert set(Delivery.objects.values_list("event_id", flat=True)) == ids
    assert set(InboxMessage.objects.filter(consumer=TASK).values_list("event_id", flat=True)) == ids
    # Django's console handler prints each of our records bare, once.
    skipped = re.findall(rf"^{TASK}: event \S+ already handled; skipped$", output, re.MULTILINE)
    assert len(skipped) == TASKS


def test_a_failing_task_body_rolls_back_its_mark_so_a_retry_runs_it(celery_queue):
    """Run in-process with task_always_eager: Celery's own request context, no worker."""
    from celery import current_app

    current_app.conf.task_always_eager = True
    try:
        ok = record_payment.apply(kwargs={"n": 1}, task_id="7b1f1b42-51a5-4a57-9a9c-8ad2a0d3f0a1")
        again = record_payment.apply(
            kwargs={"n": 1}, task_id="7b1f1b42-51a5-4a57-9a9c-8ad2a0d3f0a1"
        )
        broken = record_payment.apply(
            kwargs={"n": "not a number"}, task_id="c0e2d4a6-34b8-4b0f-9d37-0a3a4b7f2c11"
        )
        retried = record_payment.apply(
            kwargs={"n": 2}, task_id="c0e2d4a6-34b8-4b0f-9d37-0a3a4b7f2c11"
        )
    finally:
        current_app.conf.task_always_eager = False
    assert (ok.result, again.result, retried.result) == (1, None, 2)
    assert broken.failed()
    assert sorted(Delivery.objects.values_list("n", flat=True)) == [1, 2]
    # A direct call is not a delivery: no task id, no inbox.
    assert record_payment(3) == 3
    assert InboxMessage.objects.count() == 2


def test_inbox_event_types_runs_the_body_for_those_event_types_only(celery_queue):
    """Run in-process with task_always_eager: Celery's own request context, no worker."""
    from celery import current_app

    placed, shipped = "5a0d3c1e-8f5b-4c4e-9d1a-2b7c6e0f4a11", "9e4b2f70-1c3d-4a5b-8e6f-7a8b9c0d1e22"
    current_app.conf.task_always_eager = True
    try:
        results = [
            bill.apply(kwargs={"order_id": n}, task_id=task_id, headers={"event_type": kind})
            for n, task_id, kind in [(1, placed, "order.placed"), (2, shipped, "order.shipped")]
        ]
    finally:
        current_app.conf.task_always_eager = False
    assert [result.result for result in results] == [1, None]
    assert list(Delivery.objects.values_list("n", flat=True)) == [1]
    assert [str(i) for i in InboxMessage.objects.values_list("event_id", flat=True)] == [placed]


@pytest.mark.parametrize(
    ("event_types", "error"),
    [
        ("order.placed", TypeError),
        ([], ValueError),
        ([None], TypeError),
    ],
)
def test_inbox_event_types_are_checked_when_the_task_class_is_made(event_types, error):
    from django_outbox.celery import InboxTask

    with pytest.raises(error, match=r"^event_types must "):
        type("Bill", (InboxTask,), {"inbox_event_types": event_types})


@pytest.mark.slow
def test_a_worker_runs_an_inbox_event_types_task_for_its_event_types_only(celery_queue, tmp_path):
    with transaction.atomic():
        placed = stage("order.placed", {"order_id": 1}, destination="billing")
        stage("order.shipped", {"order_id": 1}, destination="billing")
    routes = {"billing": {"celery_task": "testapp.bill"}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        assert Relay().run(threading.Event(), drain=True).published == 2
    log = tmp_path / "worker.log"
    worker = start_worker(celery_queue, log)
    try:
        wait_until(lambda: queue_settled(celery_queue), timeout=120, what="the queue to drain")
    finally:
        stop(worker, signal.SIGTERM)
    assert worker.returncode == 0, log.read_text()
    assert list(Delivery.objects.values_list("event_id", "n")) == [(placed.event_id, 1)]
    assert list(InboxMessage.objects.values_list("event_id", flat=True)) == [placed.event_id]


@pytest.mark.slow
def test_the_first_task_after_a_broker_restart_is_sent_at_once(celery_queue):
    """kombu pools Celery's producers per broker URL: the pool still holds the
    connection the restart broke, and the relay must not spend an attempt on it."""
    stage_events(1, "payments")
    relay_all()
    services("restart", "rabbitmq")
    stage_events(1, "payments")
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": ROUTES}):
        with Relay() as relay:
            stats = relay.run_once()
    assert (stats.published, stats.failed) == (1, 0)


@pytest.mark.slow
def test_a_task_the_broker_never_confirms_spends_no_attempt():
    """A memory alarm: RabbitMQ takes the task and confirms nothing. The broker stalled,
    the task is not at fault (no attempt without a publish), as on a broker route; found
    by the chaos suite's memory alarm once it sent Django tasks. (The alarm is lifted
    after 3 s: until then the send hangs closing its blocked connection.)"""
    stage_events(1, "payments")
    short = {"BROKER_URL": AMQP_URL, "ROUTES": ROUTES, "LEASE_SECONDS": 3}  # 1 s confirms
    with confirming_celery_queue(), override_settings(OUTBOX=short):
        with memory_alarm():
            lift = threading.Timer(3, rabbitmqctl, ["set_vm_memory_high_watermark", "0.4"])
            lift.start()
            with Relay() as relay:
                stalled = relay.run_once()
            lift.join()
        row = OutboxMessage.objects.get()
        assert (stalled.published, row.attempts) == (0, 0), row.last_error
        OutboxMessage.objects.update(available_at=Now())
        assert Relay().run(threading.Event(), drain=True).published == 1
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("published", 0)


@pytest.fixture
def redis_celery_app():  # type: ignore[no-untyped-def]
    """A Celery app (current in this process) whose broker is the test Redis, its pool
    connected before a test makes Redis refuse writes."""
    from celery import Celery

    app = Celery("outbox-tests-redis", broker=REDIS_URL, set_as_current=True)
    app.conf.task_default_queue = queue = unique_destination("celery-redis")
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=1)
    yield app
    app.close()
    delete_redis_keys(queue)


def test_a_celery_route_on_a_full_redis_spends_no_attempt(redis_celery_app):
    """A Celery route (and so every Django task) whose app's broker is a Redis at its
    maxmemory: kombu wraps Redis's refusal in its OperationalError, and the row is an
    outage all the same (no attempt, its own reason), as on the relay's own Redis route;
    the relay's check of the app's broker says out of memory until Redis takes writes.
    (Before: an attempt charged per try, the error read as the message's.)"""
    stage_events(1, "payments")
    with override_settings(OUTBOX={"BROKER_URL": REDIS_URL, "ROUTES": ROUTES}):
        with redis_maxmemory():
            with Relay() as relay:
                stats = relay.run_once()
            with pytest.raises(BrokerOutOfMemory, match=r"^Redis refuses every write \(out of"):
                CeleryTransport().check()
        CeleryTransport().check()  # writes taken again: up
        row = OutboxMessage.objects.get()
        assert (stats.published, row.status, row.attempts) == (0, "failed", 0), row.last_error
        assert row.last_error.startswith("the broker is out of memory (Redis maxmemory reached")
        assert "OperationalError: " in row.last_error
        OutboxMessage.objects.update(available_at=Now())
        with Relay() as relay:
            assert relay.run_once().published == 1
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("published", 0)


# -- hostile input: headers, serializer, nacks ----------------------------------------


def test_the_refused_headers_are_the_names_the_installed_celery_reads_as_its_own():
    """CELERY_FIELDS against the Celery installed here: every header its protocol writes
    and every name of a task's request, and nothing Celery would pass on as a custom header."""
    from celery import Celery
    from celery.app.task import Context

    written = set(Celery("names").amqp.as_task_v2("an-id", "a.task").headers)
    request_names = {name for name in vars(Context) if not name.startswith("__")}
    assert written | request_names <= CELERY_FIELDS
    kept_as_custom = {name for name in CELERY_FIELDS if Context()._get_custom_headers({name: 1})}
    assert kept_as_custom == set()


def test_a_celery_field_as_a_header_is_refused_at_stage_time_on_a_celery_route_only():
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": ROUTES}):
        for name in sorted(CELERY_FIELDS - RESERVED_HEADERS):  # those are refused everywhere
            with pytest.raises(InvalidEvent) as refused, transaction.atomic():
                stage("payment.made", {"n": 1}, destination="payments", headers={name: "x"})
            assert str(refused.value) == (
                f"event 'payment.made': headers [{name!r}] are fields of Celery's task message "
                "on the Celery route 'payments' and cannot be given"
            )
        with transaction.atomic():  # a broker route carries them as any other header
            stage("payment.made", {"n": 1}, destination="refunds", headers={"task": "x", "id": 1})
            stage("payment.made", {"n": 1}, destination="payments", headers={"tenant": "acme"})
    assert OutboxMessage.objects.count() == 2


@pytest.mark.slow
def test_a_header_cannot_pick_the_task_a_worker_runs_nor_its_task_id(celery_queue, tmp_path):
    """Rows staged while "payments" was a broker route (so stage() let the headers in),
    relayed once it is a Celery route: the relay abandons them, a real worker runs only
    the task of the route under the event's own id."""
    with transaction.atomic():
        honest = stage("payment.made", {"n": 1}, destination="payments", headers={"t": "acme"})
        other_task = stage(
            "payment.made", {"n": 2}, destination="payments", headers={"task": "testapp.hijacked"}
        )
        twin = stage(
            "payment.made", {"n": 3}, destination="payments", headers={"id": str(honest.event_id)}
        )
    totals = relay_until_done()
    assert (totals.published, totals.abandoned) == (1, 2)
    worker = start_worker(celery_queue, tmp_path / "worker.log")
    try:
        wait_until(lambda: Delivery.objects.exists(), timeout=120, what="the worker to run a task")
        wait_until(lambda: queue_settled(celery_queue), timeout=60, what="the queue to drain")
    finally:
        stop(worker, signal.SIGTERM)
    ran = list(Delivery.objects.values_list("consumer", "event_id", "n"))
    assert ran == [("celery", honest.event_id, 1)]
    for row, name in ((other_task, "task"), (twin, "id")):
        row.refresh_from_db()
        assert row.status == OutboxMessage.Status.ABANDONED
        assert row.last_error == (
            f"headers [{name!r}] are fields of Celery's task message on the Celery route "
            "'payments' and cannot be given"
        )


def test_a_task_goes_as_json_though_the_app_serializes_tasks_with_pickle(celery_queue):
    from celery import current_app

    current_app.conf.task_serializer = "pickle"
    current_app.conf.accept_content = ["pickle", "json"]
    (event_id,) = stage_events(1, "payments")
    relay_all()
    (message,) = drain_raw(celery_queue)
    assert message.content_type == "application/json"
    assert message.headers["id"] == event_id
    args, kwargs, _ = json.loads(message.body)
    assert (args, kwargs) == ([], {"n": 0})


def due_again() -> None:
    OutboxMessage.objects.filter(status=OutboxMessage.Status.FAILED).update(available_at=Now())


#: The queue refuses a message that would take it past 1,000 bytes.
LIMIT = {"x-max-length-bytes": 1000, "x-overflow": "reject-publish"}


def test_a_nacked_task_fails_alone_and_the_tasks_around_it_are_sent_once():
    """Confirms on as docs/consuming.md says; the queue's LIMIT makes RabbitMQ nack the big
    task in the middle of the batch and ack the small ones."""
    payloads = [{"n": 0}, {"n": 1}, {"n": 2, "pad": "x" * 2000}, {"n": 3}, {"n": 4}]
    with transaction.atomic():
        rows = [stage("payment.made", p, destination="payments") for p in payloads]
    ids = [str(row.event_id) for row in rows]
    with confirming_celery_queue(**LIMIT) as name:
        first = relay_until_done()
        due_again()
        second = relay_until_done()
        in_queue = [message.headers["id"] for message in drain_raw(name)]
    assert (first.published, first.failed, second.published, second.failed) == (4, 1, 0, 1)
    assert in_queue == ids[:2] + ids[3:]  # each once, though the relay ran twice
    for row in rows:
        row.refresh_from_db()
    assert [row.status for row in rows] == ["published"] * 2 + ["failed"] + ["published"] * 2
    assert rows[2].attempts == 2
    assert rows[2].last_error == "the broker refused the message (basic.nack)"


def test_a_header_larger_than_the_frame_on_a_celery_route_fails_alone():
    """a, b, c to a Celery route on a RabbitMQ whose frame_max is 4096, b with a 5,000-byte
    header (staging allows 64 KiB): b fails alone and for good, before anything is
    written, with the relay's own frames' check; a and c are sent once. (Before: RabbitMQ
    closed the connection, 501 FRAME_ERROR, and all three failed, an attempt each.)"""
    with transaction.atomic():
        rows = [
            stage("payment.made", {"n": 1}, destination="payments"),
            stage("payment.made", {"n": 2}, destination="payments", headers={"x-big": "x" * 5000}),
            stage("payment.made", {"n": 3}, destination="payments"),
        ]
    with small_frames(), confirming_celery_queue() as name:  # its pool connects meanwhile
        stats = relay_until_done()
        in_queue = [message.headers["id"] for message in drain_raw(name)]
    for row in rows:
        row.refresh_from_db()
    assert [(row.status, row.attempts) for row in rows] == [
        ("published", 0),
        ("abandoned", 1),
        ("published", 0),
    ]
    assert (stats.published, stats.abandoned) == (2, 1)
    assert in_queue == [str(rows[0].event_id), str(rows[2].event_id)]
    assert rows[1].last_error.startswith("FrameTooLarge: the message's content header frame (")
    assert "frame_max (4096 bytes" in rows[1].last_error


def test_celery_routes_on_rabbitmq_without_confirms_get_a_warning():
    from celery import Celery

    from django_outbox.ops.checks import check_celery_confirms

    def warnings(**outbox: object) -> list[str]:
        with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, **outbox}):
            return [message.id for message in check_celery_confirms()]

    Celery("outbox-tests-unconfirmed", broker=AMQP_URL, set_as_current=True)
    assert warnings(ROUTES=ROUTES) == ["django_outbox.W004"]
    assert warnings() == []  # no Celery route
    with confirming_celery_queue():  # the documented settings
        assert warnings(ROUTES=ROUTES) == []
    Celery("outbox-tests-redis", broker=REDIS_URL, set_as_current=True)
    assert warnings(ROUTES=ROUTES) == []  # Redis has no confirms to turn on


def test_a_payload_a_celery_worker_would_decode_as_another_type_is_refused(celery_queue):
    """A worker decodes task bodies with kombu's JSON, which turns an object of exactly
    the keys __type__ and __value__ into a datetime, Decimal ... (and fails on an unknown
    type, so the task cannot be decoded): the relay refuses such a payload for a
    Celery route, and the payloads around it go through."""
    from kombu.utils.json import loads

    typed = {"__type__": "datetime", "__value__": "2020-01-01T00:00:00"}
    assert loads(json.dumps({"when": typed})) != {"when": typed}  # why it is refused
    with transaction.atomic():
        stage("payment.made", {"n": 1}, destination="payments")
        bad = stage("payment.made", {"at": [{"when": typed}]}, destination="payments")
        stage("payment.made", {"n": 2, "when": {**typed, "note": "x"}}, destination="payments")
    relay_until_done()
    bad.refresh_from_db()
    assert bad.status != OutboxMessage.Status.PUBLISHED
    assert bad.last_error == (
        f"route 'payments' sends Celery task {TASK!r}, whose worker would decode the object "
        "at $.at[0].when (keys __type__ and __value__) as another type or refuse it: "
        "kombu's JSON reads such objects so"
    )
    assert OutboxMessage.objects.filter(status=OutboxMessage.Status.PUBLISHED).count() == 2
    assert len(drain_raw(celery_queue)) == 2
