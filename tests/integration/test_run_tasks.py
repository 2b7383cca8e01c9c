"""``django_outbox.testing.run_tasks()``: a test runs the Django tasks its code enqueued on
the outbox backend, in-process, through the runner a Celery worker uses (Django 6)."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test import override_settings

from django_outbox.exceptions import OutboxError
from django_outbox.testing import MAX_TASK_ROUNDS, drain, run_tasks

django_tasks = pytest.importorskip("django.tasks", reason="django.tasks is Django 6.0+")

from django.tasks import TaskResultStatus  # noqa: E402

from tests.testapp import djtasks  # noqa: E402
from tests.testapp.models import Delivery  # noqa: E402

pytestmark = pytest.mark.django_db


def test_enqueued_tasks_run_once_with_their_outcome_recorded():
    with transaction.atomic():
        added = djtasks.add.enqueue(2, 3)
        exploded = djtasks.explode.enqueue("no stock")
    results = run_tasks()
    assert [r.id for r in results] == [added.id, exploded.id]
    assert (results[0].status, results[0].return_value) == (TaskResultStatus.SUCCESSFUL, 5)
    assert results[1].status == TaskResultStatus.FAILED
    assert results[1].errors[0].exception_class_path == "builtins.ValueError"
    # The failed task's write is rolled back; nothing runs twice.
    assert list(Delivery.objects.values_list("consumer", "n")) == [("add", 5)]
    assert run_tasks() == []
    assert drain() == []  # the task messages were relayed: nothing left due


def test_tasks_enqueued_by_tasks_run_too():
    with transaction.atomic():
        djtasks.chain.enqueue(2)
    results = run_tasks()
    assert [r.return_value for r in results] == [2, 1, 0]
    assert [n for (n,) in Delivery.objects.values_list("n").order_by("id")] == [2, 1, 0]


def test_a_task_that_enqueues_itself_without_end_is_stopped_with_one_line():
    with transaction.atomic():
        djtasks.chain.enqueue(-1)
    with pytest.raises(OutboxError, match=rf"kept enqueuing tasks for {MAX_TASK_ROUNDS} rounds"):
        run_tasks()


def test_run_tasks_honours_a_required_transaction_in_the_tasks_code():
    """The runner's own transaction is the caller's: a task that enqueues with
    REQUIRE_TRANSACTION on runs, as it would on a worker."""
    from tests.support import TASKS_REQUIRING_TRANSACTION

    with override_settings(TASKS=TASKS_REQUIRING_TRANSACTION):
        with transaction.atomic():
            djtasks.chain.enqueue(1)
        assert [r.status for r in run_tasks()] == [TaskResultStatus.SUCCESSFUL] * 2


def test_the_outbox_fixture_runs_tasks_too(outbox):
    with transaction.atomic():
        added = djtasks.add.enqueue(1, 1)
    assert [(r.id, r.return_value) for r in outbox.run_tasks()] == [(added.id, 2)]
