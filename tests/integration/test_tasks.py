"""Django tasks (``django.tasks``, Django 6) through the outbox, run by a real Celery worker
process on the real RabbitMQ: enqueue commits with the caller, the task's effects happen
once though its message arrives twice or its worker dies mid-task, results are readable.

Skipped where ``django.tasks`` does not exist (Django 5.2)."""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import kombu
import pytest

pytest.importorskip("django.tasks", reason="django.tasks is Django 6.0+")

from celery import Celery
from django.db import OperationalError, connection, transaction
from django.tasks import TaskResultStatus
from django.tasks.exceptions import TaskResultDoesNotExist
from django.utils import timezone

from django_outbox import stage
from django_outbox.conf.routes import TASKS_PREFIX
from django_outbox.models import InboxMessage, OutboxMessage, TaskResultRecord
from django_outbox.relay import Relay
from django_outbox.tasks import runner as taskrunner
from tests.support import (
    AMQP_URL,
    REPO,
    broker_connection,
    delete_queue,
    priority_queue,
    queue_settled,
    rabbitmqctl,
    relay_env,
    start_worker,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp import djtasks
from tests.testapp.models import Delivery

# Not marked slow, though they start workers: they run on Django 6 only, whose CI run
# skips the slow tests (scripts/test), and this is where they must run.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def queue() -> Iterator[str]:
    """A task queue of its own, sent to through a current Celery app as a project's is
    (with publisher confirms); deleted after."""
    name = unique_destination("tasks")
    app = Celery("outbox-tests-tasks", broker=AMQP_URL, set_as_current=True)
    app.conf.broker_transport_options = {"confirm_publish": True}
    yield name
    app.close()
    delete_queue(name)


@pytest.fixture
def worker(queue: str, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A real Celery worker on ``queue`` and its log; stopped with SIGQUIT (Celery's cold
    shutdown: SIGTERM's warm one waits about 10 s for nothing here)."""
    log = tmp_path / "worker.log"
    process = start_worker(queue, log)
    yield process, log
    if process.poll() is None:
        stop_worker(process)


#: How long a worker's cold shutdown may take before it is killed.
COLD_SHUTDOWN_SECONDS = 30


def stop_worker(process: subprocess.Popen[str]) -> None:
    """SIGQUIT (Celery's cold shutdown), then SIGKILL if the worker is still there after
    ``COLD_SHUTDOWN_SECONDS``. Celery 5.7's cold shutdown of an idle solo worker has hung
    past 60 s (seen once here, on a loaded machine: "Hitting Ctrl+C again ..." logged, then
    nothing); what these tests check is in the database and the queues by then, and a kill
    leaves both as a stop would (an unacked message goes back to its queue)."""
    try:
        stop(process, signal.SIGQUIT, timeout=COLD_SHUTDOWN_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate(timeout=COLD_SHUTDOWN_SECONDS)


def relay_all() -> int:
    """Relay every due row through the current Celery app; the number published."""
    return Relay().run(threading.Event(), drain=True).published


def wait_logged(log: Path, text: str) -> None:
    wait_until(lambda: text in log.read_text(), timeout=60, what=repr(text))


def finished(result_id: str) -> bool:
    done = ["SUCCESSFUL", "FAILED"]
    return TaskResultRecord.objects.filter(id=result_id, status__in=done).exists()


def wait_finished(result, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    """Wait until the task of ``result`` (a TaskResult) has finished; refresh it."""
    wait_until(lambda: finished(result.id), timeout=timeout, what=f"task {result.id} to finish")
    result.refresh()


def test_a_rolled_back_enqueue_never_runs_and_a_committed_one_runs_once(queue, worker):
    with pytest.raises(RuntimeError), transaction.atomic():
        rolled_back = djtasks.add.using(queue_name=queue).enqueue(40, 2)
        raise RuntimeError("the caller's transaction rolls back")
    with transaction.atomic():
        committed = djtasks.add.using(queue_name=queue).enqueue(1, 2)
    assert committed.status == TaskResultStatus.READY
    assert committed.id == str(OutboxMessage.objects.get().event_id)

    assert relay_all() == 1
    wait_finished(committed)

    assert committed.status == TaskResultStatus.SUCCESSFUL
    assert committed.return_value == 3
    assert committed.started_at is not None and committed.finished_at is not None
    assert len(committed.worker_ids) == 1 and committed.attempts == 1
    assert list(Delivery.objects.values_list("consumer", "n")) == [("add", 3)]
    with pytest.raises(TaskResultDoesNotExist):
        djtasks.add.get_result(rolled_back.id)
    process, log = worker
    wait_logged(log, f"[{committed.id}] succeeded in")  # acked: SIGQUIT finds it idle
    stop_worker(process)
    output = log.read_text()
    # Django's own receivers of task_started and task_finished, in the worker.
    assert f"Task id={committed.id} path=tests.testapp.djtasks.add state=RUNNING" in output
    assert f"Task id={committed.id} path=tests.testapp.djtasks.add state=SUCCESSFUL" in output


def test_a_failing_task_is_failed_with_its_error_and_its_writes_rolled_back(queue, worker):
    with transaction.atomic():
        result = djtasks.explode.using(queue_name=queue).enqueue("out of stock")
    relay_all()
    wait_finished(result)

    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class is ValueError
    assert "ValueError: out of stock" in error.traceback
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018
    assert not Delivery.objects.filter(consumer="explode").exists()


def test_an_async_task_runs_in_the_worker(queue, worker):
    with transaction.atomic():
        result = djtasks.add_async.using(queue_name=queue).enqueue(20, 22)
    relay_all()
    wait_finished(result)
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 42)
    assert list(Delivery.objects.values_list("consumer", "n")) == [("add_async", 42)]


def test_a_task_waits_for_run_after_and_a_queue_for_its_own_worker(queue, worker):
    run_after = timezone.now() + dt.timedelta(seconds=3)
    other = unique_destination("tasks")
    try:
        with transaction.atomic():
            later = djtasks.label.using(queue_name=queue, run_after=run_after).enqueue("later")
            elsewhere = djtasks.label.using(queue_name=other).enqueue("elsewhere")
        assert relay_all() == 1  # the task for the other queue; the later one is not due
        assert OutboxMessage.objects.get(event_id=later.id).status == "pending"

        wait_until(lambda: timezone.now() > run_after, timeout=10, what="run_after to pass")
        assert relay_all() == 1
        wait_finished(later)
        assert later.status == TaskResultStatus.SUCCESSFUL
        assert later.started_at >= run_after
        # Nothing consumes the other queue: its task waits there, READY.
        assert queue_depth(other) == 1
        elsewhere.refresh()
        assert elsewhere.status == TaskResultStatus.READY
    finally:
        delete_queue(other)


def queue_depth(name: str) -> int:
    """Messages in RabbitMQ's queue ``name``, ready and unacked."""
    for line in rabbitmqctl("list_queues", "name", "messages").splitlines():
        queue, _, count = line.partition("\t")
        if queue == name:
            return int(count)
    raise AssertionError(f"no queue {name}")


def test_a_higher_priority_task_runs_first_on_a_priority_queue(queue, tmp_path):
    from celery import current_app

    current_app.conf.task_queues = [priority_queue(queue)]
    with transaction.atomic():
        for name in ("low-1", "low-2", "low-3"):
            djtasks.label.using(queue_name=queue, priority=-100).enqueue(name)
        djtasks.label.using(queue_name=queue, priority=0).enqueue("middle")
        last = djtasks.label.using(queue_name=queue, priority=100).enqueue("high")
    assert relay_all() == 5
    assert queue_depth(queue) == 5  # all waiting before a worker takes the first
    worker = start_worker(queue, tmp_path / "worker.log", TEST_CELERY_PRIORITY="1")
    try:
        wait_until(lambda: Delivery.objects.count() == 5, timeout=60, what="5 tasks to run")
    finally:
        stop_worker(worker)
    ran = list(Delivery.objects.order_by("id").values_list("consumer", flat=True))
    assert ran == ["label:high", "label:middle", "label:low-1", "label:low-2", "label:low-3"]
    last.refresh()
    assert last.return_value == "high"


def test_a_worker_killed_mid_task_leaves_no_effect_and_the_next_attempt_runs_it(queue, tmp_path):
    with transaction.atomic():
        result = djtasks.stalls_on_first_attempt.using(queue_name=queue).enqueue(60)
    relay_all()
    first = start_worker(queue, tmp_path / "first.log")
    try:
        wait_until(
            lambda: TaskResultRecord.objects.filter(id=result.id, status="RUNNING").exists(),
            timeout=60,
            what="the first attempt to start",
        )
    finally:
        first.kill()  # SIGKILL mid-task: its transaction never commits
        first.wait(timeout=30)
    assert not Delivery.objects.exists()  # the first attempt's write is gone with it
    second = start_worker(queue, tmp_path / "second.log")  # RabbitMQ redelivers the task
    try:
        wait_finished(result)
        wait_until(lambda: queue_settled(queue), timeout=30, what="the queue to settle")
    finally:
        stop_worker(second)
    assert (result.status, result.return_value, result.attempts) == ("SUCCESSFUL", 2, 2)
    assert list(Delivery.objects.values_list("consumer", "n")) == [("stalls", 2)]


@pytest.fixture
def stuck_finalize() -> Iterator[None]:
    """Every UPDATE that marks an outbox row PUBLISHED sleeps in the database: a relay has
    published its batch and hangs before marking it, the worst moment to die."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION test_stall() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN PERFORM pg_sleep(120); RETURN NEW; END $$"
        )
        cursor.execute(
            "CREATE TRIGGER test_stall BEFORE UPDATE ON django_outbox_outboxmessage "
            "FOR EACH ROW WHEN (NEW.status = 'published') EXECUTE FUNCTION test_stall()"
        )
    try:
        yield
    finally:
        unstall()


def unstall() -> None:
    """End :func:`stuck_finalize`: the killed relay's session, still asleep in its UPDATE
    (holding the row), is ended first; the trigger then goes (its lock is free)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE wait_event = 'PgSleep' AND datname = current_database()"
        )
        cursor.execute("DROP TRIGGER IF EXISTS test_stall ON django_outbox_outboxmessage")
        cursor.execute("DROP FUNCTION IF EXISTS test_stall()")


def test_a_relay_killed_after_publishing_before_marking_runs_the_task_once(
    queue, worker, stuck_finalize
):
    with transaction.atomic():
        result = djtasks.add.using(queue_name=queue).enqueue(2, 2)
    lease = {"LEASE_SECONDS": 2}
    relay = subprocess.Popen(
        [sys.executable, "-m", "tests.celery_relay"],
        cwd=REPO,
        env={**relay_env(**lease), "TEST_CELERY_QUEUE": queue},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_finished(result)  # published and run, while the relay sleeps in its finalize
    finally:
        relay.kill()
        relay.wait(timeout=30)
    assert OutboxMessage.objects.get().status == "processing"  # never marked
    unstall()
    wait_until(lambda: relay_all() == 1, timeout=30, what="the lease to expire, the task resent")
    wait_until(lambda: queue_settled(queue), timeout=30, what="the duplicate to be consumed")
    process, log = worker
    stop_worker(process)
    assert list(Delivery.objects.values_list("consumer", "n")) == [("add", 4)]
    assert f"task {result.id} is SUCCESSFUL; not run" in log.read_text()


NOT_A_TASK = "tests.testapp.djtasks.not_a_task"


def enqueue_not_a_task(queue: str) -> OutboxMessage:
    """Stage a task message naming a plain function, and its result record, as an
    enqueue would have (``enqueue()`` itself refuses a function)."""
    with transaction.atomic():
        row = stage(
            NOT_A_TASK,
            {"backend": "default", "task": NOT_A_TASK, "priority": 0},
            destination=TASKS_PREFIX + queue,
        )
        TaskResultRecord.objects.create(
            id=row.event_id, task_path=NOT_A_TASK, backend="default", queue_name=queue
        )
    return row


def test_a_message_naming_a_function_that_is_not_a_task_runs_nothing(queue, worker):
    row = enqueue_not_a_task(queue)
    relay_all()
    process, log = worker
    # Celery logs the retry once it is sent: a cold shutdown (SIGQUIT) while it is being
    # sent interrupts that send (the test below).
    wait_logged(log, f"[{row.event_id}] retry: Retry in 30s")
    stop_worker(process)
    assert f"{NOT_A_TASK!r} is a function, not a task" in log.read_text()
    assert "sent again in 30s" in log.read_text()  # Celery's retry: the message is kept
    assert not Delivery.objects.exists()
    record = TaskResultRecord.objects.get(id=row.event_id)
    assert (record.status, record.worker_ids) == ("READY", [])  # never started


def test_a_retry_the_broker_refuses_leaves_the_message_in_its_queue(queue, tmp_path):
    """Celery drops a message whose retry it could not send (``Reject(requeue=False)``);
    the runner requeues it. The broker refuses the retry for real: the worker's queue is
    bound through an exchange that is then declared again with another type, so the
    retry's declaration of it fails (PRECONDITION_FAILED); the task comes through the
    exchange named like the queue."""
    log = tmp_path / "worker.log"
    process = start_worker(queue, log, TEST_CELERY_EXCHANGE=f"{queue}-direct")
    try:
        wait_logged(log, "ready.")
        with broker_connection() as conn:
            exchange = kombu.Exchange(f"{queue}-direct", channel=conn.default_channel)
            exchange.delete()
            exchange.type = "fanout"
            exchange.declare()
        row = enqueue_not_a_task(queue)
        assert relay_all() == 1
        received = f"run_task[{row.event_id}] received"
        wait_until(
            lambda: log.read_text().count(received) >= 2, timeout=60, what="a second delivery"
        )
    finally:
        stop(process, signal.SIGKILL)  # mid-task: an unacked message goes back, as it should
        with broker_connection() as conn:
            kombu.Exchange(f"{queue}-direct", channel=conn.default_channel).delete()
    unsent = f"task {row.event_id}: its retry was not sent (Exchange.declare: (406) "
    assert unsent in log.read_text() and "; requeued in 5s" in log.read_text()
    assert queue_depth(queue) == 1  # ready or, until the broker sees the kill, unacked
    record = TaskResultRecord.objects.get(id=row.event_id)
    assert (record.status, record.worker_ids) == ("READY", [])


def test_task_enqueued_is_sent_on_commit_only():
    from django.tasks.signals import task_enqueued

    sent = []

    def receiver(sender, task_result, **kwargs):  # type: ignore[no-untyped-def]
        sent.append(
            (task_result.id, OutboxMessage.objects.filter(event_id=task_result.id).exists())
        )

    task_enqueued.connect(receiver)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            djtasks.add.enqueue(1, 1)
            assert sent == []  # not inside the transaction
            raise RuntimeError("rolled back")
        with transaction.atomic():
            result = djtasks.add.enqueue(2, 2)
            assert sent == []
    finally:
        task_enqueued.disconnect(receiver)
    assert sent == [(result.id, True)]  # once, after the commit, for the committed task


def test_a_prefork_child_killed_mid_task_is_requeued_by_its_parent_and_run_again(queue, tmp_path):
    """reject_on_worker_lost: the parent of a child that died mid-task requeues the
    message (Celery would ack it otherwise, and the task would be lost)."""
    with transaction.atomic():
        result = djtasks.stalls_on_first_attempt.using(queue_name=queue).enqueue(60)
    relay_all()
    worker = start_worker(queue, tmp_path / "worker.log", pool="prefork")
    try:
        wait_until(
            lambda: TaskResultRecord.objects.filter(id=result.id, status="RUNNING").exists(),
            timeout=60,
            what="the first attempt to start",
        )
        children = subprocess.run(
            ["pgrep", "-P", str(worker.pid)], capture_output=True, text=True, check=True
        ).stdout.split()
        assert len(children) == 1, children
        os.kill(int(children[0]), signal.SIGKILL)
        wait_finished(result)
    finally:
        stop_worker(worker)
    assert (result.status, result.return_value, result.attempts) == ("SUCCESSFUL", 2, 2)
    assert list(Delivery.objects.values_list("consumer", "n")) == [("stalls", 2)]


def test_a_task_whose_workers_died_five_times_is_failed_not_started_again(queue, worker):
    """As if five workers had died running it (each start adds a worker id)."""
    with transaction.atomic():
        result = djtasks.add.using(queue_name=queue).enqueue(3, 3)
    lost = [f"lost-{n}" for n in range(5)]
    TaskResultRecord.objects.filter(id=result.id).update(status="RUNNING", worker_ids=lost)
    relay_all()
    wait_finished(result)
    assert result.status == TaskResultStatus.FAILED
    (error,) = result.errors
    assert error.exception_class_path == "django_outbox.tasks.runner.WorkerLost"
    assert "started 5 times" in error.traceback
    assert not Delivery.objects.exists()


def test_a_task_whose_database_fails_mid_task_is_not_failed_and_runs_again(monkeypatch):
    """The database goes away while the worker writes the outcome (a PostgreSQL restart
    mid-task, found by the chaos suite; here the worker's session is terminated, on the
    real database): nothing of the attempt commits, the task is not FAILED for it, and the
    error reaches Celery, which sends the task again (run_django_task retries any error of
    the runner)."""
    with transaction.atomic():
        result = djtasks.add.enqueue(1, 2)

    def database_gone(*args: object, **kwargs: object) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")

    monkeypatch.setattr(taskrunner, "_finish", database_gone)
    with pytest.raises(OperationalError):
        taskrunner.run({"backend": "default"}, result.id, "worker-1")
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING
    assert not Delivery.objects.exists() and not InboxMessage.objects.exists()
    monkeypatch.undo()
    taskrunner.run({"backend": "default"}, result.id, "worker-2")  # Celery's next delivery
    result.refresh()
    assert (result.status, result.return_value, result.attempts) == ("SUCCESSFUL", 3, 2)
    assert list(Delivery.objects.values_list("consumer", "n")) == [("add", 3)]


def test_a_task_whose_exception_cannot_be_printed_is_failed_and_task_finished_sent():
    """A task raising an exception whose ``__str__`` raises (a library's bug): the runner
    logs it, records it FAILED and sends task_finished; nothing reaches Celery, which
    would send the task again (called in process, as Celery's delivery calls it)."""
    from django.tasks.signals import task_finished

    finished: list[str] = []

    def receiver(sender: object, task_result: object, **kwargs: object) -> None:
        finished.append(task_result.id)  # type: ignore[attr-defined]

    with transaction.atomic():
        result = djtasks.fails_unprintably.enqueue()
    task_finished.connect(receiver)
    try:
        taskrunner.run({"backend": "default"}, result.id, "worker-1")
    finally:
        task_finished.disconnect(receiver)
    result.refresh()
    assert (result.status, finished) == ("FAILED", [result.id])
    (error,) = result.errors
    assert error.exception_class_path == "tests.testapp.djtasks.Unprintable"
    assert "Unprintable: <exception str() failed>" in error.traceback
    assert not Delivery.objects.exists()  # its writes rolled back


def test_a_task_whose_own_query_is_cancelled_is_failed_once_with_its_error():
    """A task whose query hits the statement timeout it set raises QueryCanceled, an
    OperationalError, with its connection usable: its own failure, FAILED at once with
    that error. It was taken for the database failing: run again 5 times, then FAILED as
    WorkerLost ("its worker died each time"), its error in no record."""
    with transaction.atomic():
        result = djtasks.times_out.enqueue()
    taskrunner.run({"backend": "default"}, result.id, "worker-1")  # raises nothing to Celery
    result.refresh()
    assert (result.status, result.attempts) == ("FAILED", 1)
    (error,) = result.errors
    assert error.exception_class_path == "django.db.utils.OperationalError"
    assert "canceling statement due to statement timeout" in error.traceback
    assert list(Delivery.objects.values_list("consumer", flat=True)) == []  # rolled back


def test_error_texts_and_return_values_the_database_cannot_store_are_stored_readable(queue, worker):
    """A NUL or a lone surrogate in a task's error or return value (form input in an
    error message): jsonb refuses the one, psycopg the other. Before, the FAILED write
    raised, Celery sent the task again every 30 s, and the real error was lost."""
    with transaction.atomic():
        failed = djtasks.fails_with_unstorable_text.using(queue_name=queue).enqueue()
        returned = djtasks.returns_unstorable_values.using(queue_name=queue).enqueue()
    relay_all()
    _, log = worker
    wait_until(
        lambda: (finished(failed.id) and finished(returned.id)) or "sent again" in log.read_text(),
        timeout=60,
        what="both tasks to finish, or the worker to give one back to Celery",
    )
    failed.refresh()
    returned.refresh()
    assert "sent again" not in log.read_text()
    assert (failed.status, failed.attempts) == (TaskResultStatus.FAILED, 1)
    (error,) = failed.errors
    assert error.exception_class is ValueError
    # Replaced as the inbox replaces them: a NUL by U+FFFD, a lone surrogate by "?".
    assert "ValueError: bad name a\ufffdb ?\n" in error.traceback
    assert (returned.status, returned.attempts) == (TaskResultStatus.SUCCESSFUL, 1)
    assert returned.return_value == {"name": "a\ufffdb", "half": "?", "ratio": "nan"}
    assert Delivery.objects.filter(consumer="returns_unstorable_values").count() == 1


@pytest.mark.parametrize("pool", ["solo", "prefork"])
def test_a_task_that_raises_system_exit_is_failed_once_and_the_worker_goes_on(
    queue, tmp_path, pool
):
    """Django's own backends record any BaseException but KeyboardInterrupt as the task's
    failure. Before, SystemExit crashed the solo pool (the worker exited 1) and killed a
    prefork child, and Celery ran the task again, up to 5 times."""
    with transaction.atomic():
        exits = djtasks.exits.using(queue_name=queue).enqueue(3)
        after = djtasks.add.using(queue_name=queue).enqueue(1, 1)
    relay_all()
    log = tmp_path / "worker.log"
    process = start_worker(queue, log, pool=pool)
    try:
        wait_until(
            lambda: (
                (finished(exits.id) and finished(after.id))
                or process.poll() is not None
                or len(TaskResultRecord.objects.get(id=exits.id).worker_ids) > 1
            ),
            timeout=60,
            what="both tasks to finish, the worker to exit or the task to start again",
        )
        assert process.poll() is None, log.read_text()[-3000:]
    finally:
        stop_worker(process)
    exits.refresh()
    after.refresh()
    assert (exits.status, exits.attempts) == (TaskResultStatus.FAILED, 1)
    (error,) = exits.errors
    assert error.exception_class_path == "builtins.SystemExit"
    assert "SystemExit: 3" in error.traceback
    assert (after.status, after.return_value) == (TaskResultStatus.SUCCESSFUL, 2)
    assert list(Delivery.objects.values_list("consumer", flat=True)) == ["add"]


def test_a_duplicate_delivered_while_a_failure_is_being_recorded_does_not_run_the_task(
    queue, tmp_path
):
    """The failing delivery is held after its task raised and before its FAILED outcome
    commits (the task's error holds it while the runner formats it: see
    djtasks.HeldOpen); meanwhile the relay publishes the task again, as a relay whose
    lease ran out does, and the other worker takes that duplicate. Before, the rollback
    of the task had released the record, so the duplicate started the task again."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    os.mkfifo(barrier / "go")
    with transaction.atomic():
        result = djtasks.fails_held_open.using(queue_name=queue).enqueue(str(barrier))
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    # One message at a time each: the busy worker cannot hold the duplicate back.
    workers = [start_worker(queue, log, name=log.stem, TEST_CELERY_PREFETCH="1") for log in logs]
    try:
        for log in logs:
            wait_logged(log, "ready.")
        assert relay_all() == 1
        wait_until((barrier / "holding").exists, timeout=60, what="the failure to be held")
        # The relay's lease ran out before it marked the row: it publishes it again.
        OutboxMessage.objects.filter(event_id=result.id).update(
            status="processing", locked_until=timezone.now(), published_at=None
        )
        assert relay_all() == 1
        done = f"run_task[{result.id}] succeeded in"
        wait_until(
            lambda: sum(log.read_text().count(done) for log in logs) == 1,
            timeout=60,
            what="the duplicate delivery to be done with",
        )
        release(barrier)
        wait_finished(result)
        wait_until(lambda: queue_settled(queue), timeout=30, what="the queue to settle")
    finally:
        release(barrier)
        for process in workers:
            stop_worker(process)
    assert (barrier / "runs").read_text() == "run\n"  # run once, not twice
    assert (result.status, result.attempts) == (TaskResultStatus.FAILED, 1)
    (error,) = result.errors
    assert error.exception_class_path == "tests.testapp.djtasks.HeldOpen"
    held = [log.read_text() for log in logs if "another delivery is running it" in log.read_text()]
    assert len(held) == 1


def release(barrier: Path) -> None:
    """Let the delivery held at ``barrier`` go on (nothing, if none got there). Opening
    the FIFO waits for the held delivery to open it, which it does right after it says
    it is holding."""
    if (barrier / "holding").exists() and not (barrier / "released").exists():
        os.close(os.open(barrier / "go", os.O_WRONLY))
        (barrier / "released").touch()


def test_a_result_is_read_in_a_process_that_cannot_import_its_task():
    """A dashboard or a service that reads results but does not deploy the workers' code
    (this process has no module billing). Before, get_result() raised InvalidTask."""
    from django.tasks import default_task_backend
    from django.tasks.exceptions import InvalidTask

    record = TaskResultRecord.objects.create(
        id=uuid.uuid4(),
        task_path="billing.tasks.charge",
        backend="default",
        queue_name="billing",
        priority=10,
        args=[42],
        status="SUCCESSFUL",
        return_value={"charged": 42},
        worker_ids=["celery@billing-1"],
    )
    result = default_task_backend.get_result(str(record.id))
    assert (result.status, result.args) == ("SUCCESSFUL", [42])
    assert result.return_value == {"charged": 42}
    assert (result.task.module_path, result.task.name) == ("billing.tasks.charge", "charge")
    assert (result.task.queue_name, result.task.priority) == ("billing", 10)
    with pytest.raises(InvalidTask, match=r"cannot import the task 'billing\.tasks\.charge'"):
        result.task.call(42)
    TaskResultRecord.objects.filter(id=record.id).update(status="FAILED")
    result.refresh()
    assert result.status == "FAILED"


@pytest.mark.parametrize(
    ("task_path", "backend", "why"),
    [
        (
            "tests.testapp.worker_only_tasks.charge",
            "default",
            "cannot import the task 'tests.testapp.worker_only_tasks.charge': "
            "ImproperlyConfigured: set STRIPE_KEY",
        ),
        ("tests.testapp.djtasks.add", "billing", "InvalidTaskBackend: The connection 'billing'"),
    ],
    ids=["module-raises-on-import", "backend-alias-not-here"],
)
def test_a_result_is_read_whatever_stops_this_process_from_loading_its_task(
    task_path, backend, why
):
    """get_result() reads the stored result in a process whose import of the task's module
    raises something other than ImportError (a secret only the workers have), or that has
    no TASKS entry of the result's backend alias: both raised out of get_result()."""
    from django.tasks import default_task_backend
    from django.tasks.exceptions import InvalidTask

    record = TaskResultRecord.objects.create(
        id=uuid.uuid4(),
        task_path=task_path,
        backend=backend,
        queue_name="default",
        priority=0,
        args=[1, 2],
        status="SUCCESSFUL",
        return_value=3,
        worker_ids=["celery@billing-1"],
    )
    result = default_task_backend.get_result(str(record.id))
    assert (result.status, result.return_value, result.backend) == ("SUCCESSFUL", 3, backend)
    with pytest.raises(InvalidTask, match=re.escape(why)):
        result.task.call(1, 2)


def test_an_async_view_and_autocommit_code_enqueue_as_with_djangos_own_backends(queue, worker):
    """Each enqueue outside atomic() commits at once, on its own (aenqueue: from an async
    view, through the sync thread, which has no transaction open). Before, both raised
    NotInTransaction."""
    from asgiref.sync import async_to_sync
    from django.test import AsyncClient

    response = async_to_sync(AsyncClient().get)(f"/tasks/add/?queue={queue}&a=2&b=3")
    assert response.status_code == 200, response.content
    from_view = djtasks.add.get_result(response.json()["result_id"])
    assert response.json()["status"] == from_view.status == TaskResultStatus.READY
    in_autocommit = djtasks.add.using(queue_name=queue).enqueue(20, 30)
    assert relay_all() == 2  # both committed already
    wait_finished(from_view)
    wait_finished(in_autocommit)
    assert (from_view.return_value, in_autocommit.return_value) == (5, 50)


def test_aenqueue_called_from_code_under_atomic_joins_its_transaction():
    """async_to_sync from sync code inside atomic(): aenqueue runs enqueue in that same
    thread, so the task commits or rolls back with the block."""
    from asgiref.sync import async_to_sync

    with pytest.raises(RuntimeError), transaction.atomic():
        async_to_sync(djtasks.add.aenqueue)(1, 1)
        assert OutboxMessage.objects.count() == 1  # in the block's transaction
        raise RuntimeError("rolled back")
    assert not OutboxMessage.objects.exists() and not TaskResultRecord.objects.exists()
    with transaction.atomic():
        result = async_to_sync(djtasks.add.aenqueue)(2, 2)
    assert OutboxMessage.objects.get().event_id == uuid.UUID(result.id)


@pytest.mark.parametrize(
    "stop", ["builtins.KeyboardInterrupt", "celery.exceptions.WorkerTerminate"]
)
def test_a_worker_stopped_mid_task_commits_nothing_and_the_next_delivery_runs_it(stop):
    """Ctrl+C, or Celery's hard shutdown of a solo worker (WorkerTerminate, raised by its
    signal handler in the task's frame; raised by the task here, in-process, as the
    database-failure test does): not the task's failure. The attempt commits nothing and
    the exception goes through to the worker; the broker's redelivery runs the task."""
    from django_outbox.tasks.worker import WORKER_STOPS

    with transaction.atomic():
        result = djtasks.interrupted_on_first_attempt.enqueue(stop)
    with pytest.raises(BaseException) as raised:
        taskrunner.run({"backend": "default"}, result.id, "worker-1", interrupts=WORKER_STOPS)
    assert f"{type(raised.value).__module__}.{type(raised.value).__name__}" == stop
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING and not result.errors
    assert not Delivery.objects.exists() and not InboxMessage.objects.exists()
    taskrunner.run({"backend": "default"}, result.id, "worker-2", interrupts=WORKER_STOPS)
    result.refresh()
    assert (result.status, result.return_value, result.attempts) == ("SUCCESSFUL", 2, 2)
    assert list(Delivery.objects.values_list("consumer", "n")) == [("interrupted", 2)]


@pytest.mark.django_db
def test_a_required_transaction_is_required_under_the_test_cases_own_atomic_too():
    """pytest-django's test atomic is no transaction of the caller's: with
    REQUIRE_TRANSACTION an enqueue in it alone fails as it would in production."""
    from django.test import override_settings

    from django_outbox import NotInTransaction
    from tests.support import TASKS_REQUIRING_TRANSACTION

    with override_settings(TASKS=TASKS_REQUIRING_TRANSACTION):
        assert connection.in_atomic_block  # the test's own
        with pytest.raises(NotInTransaction, match="REQUIRE_TRANSACTION"):
            djtasks.add.enqueue(1, 2)
        with transaction.atomic():
            result = djtasks.add.enqueue(1, 2)
    assert TaskResultRecord.objects.filter(id=result.id).exists()
