"""Celery routes end to end: the relay sends tasks, a real worker runs them through the inbox."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import pytest
from django.db.models.functions import Now
from django.test import override_settings

from django_outbox.models import InboxMessage, OutboxMessage
from django_outbox.relay import Relay
from tests.support import (
    AMQP_URL,
    REPO,
    delete_queue,
    rabbitmqctl,
    relay_env,
    services,
    stage_events,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp.models import Delivery
from tests.testapp.tasks import record_payment

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "testapp.record_payment"


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
    routes = {"payments": {"celery_task": TASK}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        totals = Relay().run(threading.Event(), drain=True)
    assert totals.published == OutboxMessage.objects.count()


def queue_settled(queue: str) -> bool:
    """No message waiting and none delivered but unacked (tasks ack late)."""
    for line in rabbitmqctl(
        "list_queues", "name", "messages", "messages_unacknowledged"
    ).splitlines():
        name, *counts = line.split()
        if name == queue:
            return counts == ["0", "0"]
    return False


@pytest.mark.slow
def test_a_worker_runs_each_relayed_task_once_though_every_task_arrives_twice(
    celery_queue, tmp_path
):
    stage_events(1000, "payments")
    relay_all()
    log = tmp_path / "worker.log"  # a file, not a pipe: a full pipe would stall the worker
    with log.open("w") as log_file:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.celery_app",
                "worker",
                "--pool",
                "solo",
                "--queues",
                celery_queue,
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "INFO",
            ],
            cwd=REPO,
            env={**relay_env(), "TEST_CELERY_QUEUE": celery_queue},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        wait_until(
            lambda: Delivery.objects.filter(consumer="celery").count() == 1000,
            timeout=300,
            what="the worker to run 1000 tasks",
        )
        # The relay publishes all 1,000 again (as after a crash before finalize).
        OutboxMessage.objects.update(status=OutboxMessage.Status.PENDING, available_at=Now())
        relay_all()
        wait_until(lambda: queue_settled(celery_queue), timeout=300, what="the queue to drain")
    finally:
        stop(worker, signal.SIGTERM)
    output = log.read_text()
    assert worker.returncode == 0, output
    assert Delivery.objects.filter(consumer="celery").count() == 1000
    ids = set(OutboxMessage.objects.values_list("event_id", flat=True))
    assert set(Delivery.objects.values_list("event_id", flat=True)) == ids
    assert set(InboxMessage.objects.filter(consumer=TASK).values_list("event_id", flat=True)) == ids
    # Django's console handler prints each of our records bare, once.
    skipped = re.findall(rf"^{TASK}: event \S+ already handled; skipped$", output, re.MULTILINE)
    assert len(skipped) == 1000


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


@pytest.mark.slow
def test_the_first_task_after_a_broker_restart_is_sent_at_once(celery_queue):
    """kombu pools Celery's producers per broker URL: the pool still holds the
    connection the restart broke, and the relay must not spend an attempt on it."""
    stage_events(1, "payments")
    relay_all()
    services("restart", "rabbitmq")
    stage_events(1, "payments")
    routes = {"payments": {"celery_task": TASK}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        with Relay() as relay:
            stats = relay.run_once()
    assert (stats.published, stats.failed) == (1, 0)
