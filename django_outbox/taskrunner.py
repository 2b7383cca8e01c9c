"""Running a Django task in a Celery worker, once in effect (Django 6.0+).

The relay sends each task enqueued through
:class:`~django_outbox.tasks.OutboxTaskBackend` as a message of the Celery task
:data:`~django_outbox.routes.TASK_RUNNER`, whose body is :func:`run`:

1. the task's result record becomes RUNNING (its own short transaction, so it is
   seen while the task runs; the worker's id is added), and ``task_started`` is sent;
2. the task runs inside the inbox transaction of consumer ``django.tasks`` on the
   backend's database, and its SUCCESSFUL outcome (the return value) is written in
   that same transaction: the task's writes, the inbox mark and the outcome commit
   together or not at all. A delivery of a task whose mark is there (a relay's
   second publish, a broker's redelivery) finds it and runs nothing;
3. an exception rolls all of that back; the FAILED outcome (the exception class
   and traceback) is then written with the inbox mark in a transaction of its
   own, so the failure is final, as Django's tasks are never retried by the
   backend. ``task_finished`` is sent once the outcome is committed.

A worker killed mid-task commits nothing of step 2: the broker redelivers the
message (the runner acks late) and the task runs again, a second attempt.
"""

from __future__ import annotations

import logging
import traceback
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.tasks import TaskContext, TaskResult, task_backends
from django.tasks.signals import task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json

from .conf import outbox_settings
from .inbox import process_once
from .models import TASK_FINISHED, TaskResultRecord, TaskStatus
from .redact import SecretFilter

if TYPE_CHECKING:
    from .taskbackend import OutboxTaskBackend

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # the tasks' error texts

#: The inbox consumer whose marks say a task's outcome is committed.
CONSUMER = "django.tasks"


class TaskUnavailable(Exception):
    """This worker cannot run the task now: its backend alias or its code is not
    here (a deploy in progress, settings that differ). Retried later, never lost."""


def run(payload: dict[str, Any], result_id: str, worker_id: str) -> None:
    """Run the task of ``payload`` (the message the backend staged) whose result id is
    ``result_id``, once in effect; ``worker_id`` joins its ``worker_ids``."""
    backend = _backend(payload.get("backend"))
    try:
        record = _start(backend.using, result_id, worker_id)
        if record is None:
            return
        result = backend.result_of(record)
    except Exception as exc:  # the task's module or function is not importable here
        raise TaskUnavailable(f"task {result_id} cannot run on this worker: {exc}") from exc
    task_started.send(type(backend), task_result=result)
    try:
        with process_once(CONSUMER, result_id, backend.using) as new:
            if not new:
                logger.info("task %s already ran; skipped", result_id, extra=_extra(result))
                return
            value = normalize_json(_call(result))
            _finish(record, backend.using, TaskStatus.SUCCESSFUL, return_value=value)
    except Exception as exc:
        if _fail(record, backend.using, exc):
            task_finished.send(type(backend), task_result=backend.result_of(record))
        return
    task_finished.send(type(backend), task_result=backend.result_of(record))


def _backend(alias: object) -> OutboxTaskBackend:
    from .taskbackend import OutboxTaskBackend

    try:
        backend = task_backends[str(alias)]
    except Exception as exc:  # InvalidTaskBackend: not in this worker's TASKS
        raise TaskUnavailable(f"no task backend {alias!r} in this worker's TASKS") from exc
    if not isinstance(backend, OutboxTaskBackend):
        raise TaskUnavailable(
            f"TASKS[{alias!r}] is a {type(backend).__name__} in this worker, not the outbox's"
        )
    return backend


def _start(using: str, result_id: str, worker_id: str) -> TaskResultRecord | None:
    """Mark the task RUNNING by ``worker_id`` and return its record; None when it has
    finished already, or was never committed (nothing to run)."""
    now = timezone.now()
    with transaction.atomic(using=using):
        record = (
            TaskResultRecord.objects.using(using).select_for_update().filter(id=result_id).first()
        )
        if record is None or record.status in TASK_FINISHED:
            why = "has no result record" if record is None else f"is {record.status}"
            logger.info(
                "task %s %s; not run",
                result_id,
                why,
                extra={"action": "tasks.skipped", "result_id": result_id},
            )
            return None
        record.status = TaskStatus.RUNNING
        record.started_at = record.started_at or now
        record.last_attempted_at = now
        record.worker_ids = [*record.worker_ids, worker_id]
        record.save(update_fields=["status", "started_at", "last_attempted_at", "worker_ids"])
    return record


def _call(result: TaskResult) -> Any:
    task = result.task
    if task.takes_context:
        return task.call(TaskContext(task_result=result), *result.args, **result.kwargs)
    return task.call(*result.args, **result.kwargs)


def _finish(record: TaskResultRecord, using: str, status: TaskStatus, **values: Any) -> None:
    """Write the outcome ``status`` (and ``values``) of ``record``'s task."""
    record.status, record.finished_at = status, timezone.now()
    for name, value in values.items():
        setattr(record, name, value)
    record.save(using=using, update_fields=["status", "finished_at", *values])


def _fail(record: TaskResultRecord, using: str, exc: Exception) -> bool:
    """Commit the FAILED outcome of ``exc`` with the inbox mark; False when another
    delivery committed an outcome first (this one's failure is then not recorded)."""
    kind = type(exc)
    error = {
        "exception_class_path": f"{kind.__module__}.{kind.__qualname__}",
        "traceback": outbox_settings.redact("".join(traceback.format_exception(exc))),
    }
    with process_once(CONSUMER, record.id, using) as new:
        if new:
            _finish(record, using, TaskStatus.FAILED, errors=[*record.errors, error])
    logger.log(
        logging.WARNING if new else logging.INFO,
        "task %s failed: %s: %s%s",
        record.id,
        error["exception_class_path"],
        exc,
        "" if new else " (another delivery had committed its outcome)",
        extra={"action": "tasks.failed", "result_id": str(record.id)},
    )
    return new


def _extra(result: TaskResult) -> dict[str, Any]:
    return {"action": "tasks.duplicate", "result_id": result.id, "task": result.task.module_path}
