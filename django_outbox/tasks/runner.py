"""Running a Django task in a Celery worker, once in effect (Django 6.0+).

The relay sends each task enqueued through
:class:`~django_outbox.tasks.OutboxTaskBackend` as a message of the Celery task
:data:`~django_outbox.conf.routes.TASK_RUNNER`, whose body is :func:`run`:

1. the task's result record is locked (SKIP LOCKED: one held by another delivery
   means that one is running it, and this one runs nothing) and its task imported; a
   worker that cannot import it (the code or the backend is not deployed here) raises
   :class:`TaskUnavailable` and Celery sends the message again later, the record
   untouched;
2. in that same short transaction the record becomes RUNNING (so it is seen while
   the task runs; the worker's id is added), and ``task_started`` is sent;
3. the task runs inside the inbox transaction of consumer ``django.tasks`` on the
   backend's database, holding its record, in a savepoint, and its SUCCESSFUL outcome
   (the return value) is written in that same savepoint: the task's writes, the inbox
   mark and the outcome commit together or not at all. A delivery of a task whose
   mark is there (a relay's second publish, a broker's redelivery) runs nothing;
4. an exception (any ``BaseException`` but ``KeyboardInterrupt`` and the worker's own
   stop, as Django's own backends count them) rolls the task's writes back to the
   savepoint; the FAILED outcome (the exception class and traceback) is then written
   with the inbox mark in the transaction that still holds the record, so no other
   delivery can start the task before the failure is committed, and the failure is
   final, as Django's tasks are never retried by the backend. ``task_finished`` is sent
   once the outcome is committed. Texts PostgreSQL cannot store (a NUL, a lone
   surrogate, in an error or a return value) are stored replaced
   (``inbox.storable``).

A worker killed mid-task commits nothing of step 3: the broker redelivers the
message (the runner acks late) and the task runs again, a second attempt. A task
started :data:`MAX_STARTS` times without an outcome (its worker died each time: out
of memory, a hard time limit) is FAILED with :class:`WorkerLost` instead of a
sixth start. The database failing mid-task (``OperationalError``,
``InterfaceError``: a restart) is not the task's failure: nothing of the attempt
is committed, and the error, as any other of the runner's own, reaches Celery,
which sends the message again: a committed task is never dropped.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from typing import TYPE_CHECKING, Any

from django.db import InterfaceError, OperationalError, connections, transaction
from django.tasks import Task, TaskContext, TaskResult, task_backends
from django.tasks.signals import task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json

from .. import db
from ..conf import outbox_settings
from ..conf.redact import SecretFilter, describe
from ..inbox.records import process_once, storable
from ..models import TASK_FINISHED, TaskResultRecord, TaskStatus

if TYPE_CHECKING:
    from django.dispatch import Signal

    from .backend import OutboxTaskBackend

logger = logging.getLogger("django_outbox.taskrunner")
logger.addFilter(SecretFilter(outbox_settings.redact))  # the tasks' error texts

#: The inbox consumer whose marks say a task's outcome is committed.
CONSUMER = "django.tasks"
#: How many times a task may start without an outcome before it is FAILED: each start
#: is a worker that died running it (Celery requeues the message of a lost worker).
MAX_STARTS = 5


class TaskUnavailable(Exception):
    """This worker cannot run the task now: its backend alias or its code is not
    here (a deploy in progress, settings that differ). Retried later, never lost."""


class WorkerLost(Exception):
    """The outcome of a task whose workers died :data:`MAX_STARTS` times running it."""


def run(
    payload: dict[str, Any],
    result_id: str,
    worker_id: str,
    *,
    interrupts: tuple[type[BaseException], ...] = (),
) -> None:
    """Run the task of ``payload`` (the message the backend staged) whose result id is
    ``result_id``, once in effect; ``worker_id`` joins its ``worker_ids``. ``interrupts``
    are the exceptions with which the worker stops itself (Celery's shutdown), which are
    not the task's failure: like ``KeyboardInterrupt`` they go through, nothing of the
    attempt committed."""
    backend = _backend(payload.get("backend"))
    try:
        started = _start(backend, uuid.UUID(result_id), worker_id)
    except ValueError:  # not an id the backend made: no task to run
        _skipped(result_id, "is not a task's id")
        return
    if started is None:
        return
    record, task = started
    _send(task_started, backend, record, task)
    if _run_once(backend, record, task, (KeyboardInterrupt, *interrupts)):
        _send(task_finished, backend, record, task)


def _run_once(
    backend: OutboxTaskBackend,
    record: TaskResultRecord,
    task: Task,
    interrupts: tuple[type[BaseException], ...],
) -> bool:
    """Run the task in one transaction with its inbox mark and its outcome, holding its
    record from the start to the commit: SUCCESSFUL with the task's writes, or FAILED
    once they are rolled back to a savepoint. False when another delivery holds the
    record or the mark is there (this one ran nothing)."""
    with transaction.atomic(using=backend.using):
        if not _hold(backend.using, record.id):
            return False
        with process_once(CONSUMER, record.id, backend.using) as new:
            if not new:
                logger.info("task %s already ran; skipped", record.id, extra=_extra(record))
                return False
            error = _attempt(backend, record, task, interrupts)
            if error is not None:
                _record_failure(record, backend.using, error)
    if error is not None:
        _log_failure(record, error)
    return True


def _attempt(
    backend: OutboxTaskBackend,
    record: TaskResultRecord,
    task: Task,
    interrupts: tuple[type[BaseException], ...],
) -> BaseException | None:
    """Call the task and write its SUCCESSFUL outcome in a savepoint; or return what it
    raised, any ``BaseException`` (``SystemExit`` included, as Django's own backends
    record it), its writes rolled back to the savepoint. The database failing and
    ``interrupts`` go through: they are not the task's failure."""
    try:
        with transaction.atomic(using=backend.using):
            value = storable(normalize_json(_call(backend.result_of(record, task))))
            _finish(record, backend.using, TaskStatus.SUCCESSFUL, return_value=value)
    except BaseException as exc:
        # The worker stops, or the database failed: nothing committed; the broker
        # redelivers the task, or Celery sends it again.
        if isinstance(exc, interrupts) or _database_failed(backend.using, exc):
            raise
        return exc
    return None


def _database_failed(using: str, exc: BaseException) -> bool:
    """Whether ``exc`` is the database failing (its connection lost), not the task's own
    error: a statement timeout, a deadlock or a lock timeout of the task's query is an
    ``OperationalError`` too, and leaves the connection usable."""
    if not isinstance(exc, OperationalError | InterfaceError):
        return False
    connection = connections[using]
    return connection.connection is None or not connection.is_usable()


def _backend(alias: object) -> OutboxTaskBackend:
    from .backend import OutboxTaskBackend

    try:
        backend = task_backends[str(alias)]
    except Exception as exc:  # InvalidTaskBackend: not in this worker's TASKS
        raise TaskUnavailable(f"no task backend {alias!r} in this worker's TASKS") from exc
    if not isinstance(backend, OutboxTaskBackend):
        raise TaskUnavailable(
            f"TASKS[{alias!r}] is a {type(backend).__name__} in this worker, not the outbox's"
        )
    return backend


def _skipped(result_id: object, why: str) -> None:
    logger.info(
        "task %s %s; not run",
        result_id,
        why,
        extra={"action": "tasks.skipped", "result_id": str(result_id)},
    )


def _locked(using: str, result_id: uuid.UUID) -> TaskResultRecord | None:
    """The record, locked for the transaction in hand; None when another transaction
    holds it (another delivery is running the task), where SKIP LOCKED exists."""
    rows = TaskResultRecord.objects.using(using)
    skip = db.supports_skip_locked(connections[using])
    return rows.select_for_update(skip_locked=skip).filter(id=result_id).first()


def _start(
    backend: OutboxTaskBackend, result_id: uuid.UUID, worker_id: str
) -> tuple[TaskResultRecord, Task] | None:
    """Mark the task RUNNING by ``worker_id``; its record and its task. None when there
    is nothing to run: no committed enqueue made it, another delivery is running it, it
    has an outcome, or it started :data:`MAX_STARTS` times already (then it is FAILED:
    :class:`WorkerLost`). Raises :class:`TaskUnavailable`, the record untouched, when the
    task cannot be imported here."""
    now = timezone.now()
    with transaction.atomic(using=backend.using):
        record = _locked(backend.using, result_id)
        if record is None or record.status in TASK_FINISHED:
            why = "has no result record, or another delivery is running it"
            _skipped(result_id, why if record is None else f"is {record.status}")
            return None
        try:
            task = backend.task_of(record)
        except Exception as exc:  # its module or function is not importable here
            why = describe(exc)
            raise TaskUnavailable(f"task {result_id} cannot run on this worker: {why}") from exc
        if len(record.worker_ids) < MAX_STARTS:
            record.status = TaskStatus.RUNNING
            record.started_at = record.started_at or now
            record.last_attempted_at = now
            record.worker_ids = [*record.worker_ids, worker_id]
            fields = ["status", "started_at", "last_attempted_at", "worker_ids"]
            record.save(using=backend.using, update_fields=fields)
            return record, task
        lost = WorkerLost(f"started {len(record.worker_ids)} times, its worker died each time")
        with process_once(CONSUMER, record.id, backend.using) as new:
            if new:  # in the transaction that holds the record
                _record_failure(record, backend.using, lost)
    if new:
        _log_failure(record, lost)
        _send(task_finished, backend, record, task)
    return None


def _hold(using: str, result_id: uuid.UUID) -> bool:
    """Lock the task's record for the run transaction: False when another delivery
    started it meanwhile and holds it (this one runs nothing)."""
    if _locked(using, result_id) is not None:
        return True
    _skipped(result_id, "is being run by another delivery")
    return False


def _send(signal: Signal, backend: OutboxTaskBackend, record: TaskResultRecord, task: Task) -> None:
    """Send ``signal`` for ``record``'s task; a receiver's error is logged, never raised
    (the outcome is committed: a receiver must not make Celery run the task again)."""
    result = backend.result_of(record, task)
    for receiver, error in signal.send_robust(type(backend), task_result=result):
        if isinstance(error, Exception):
            logger.error(
                "a receiver of %s failed for task %s: %r",
                "task_started" if signal is task_started else "task_finished",
                record.id,
                error,
                extra={"action": "tasks.signal_failed", "receiver": repr(receiver)},
            )


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


def _record_failure(record: TaskResultRecord, using: str, exc: BaseException) -> None:
    """Write the FAILED outcome of ``exc``: its class and its traceback (passwords masked),
    as PostgreSQL can store them (a NUL or a lone surrogate in the message replaced)."""
    kind = type(exc)
    error = {
        "exception_class_path": f"{kind.__module__}.{kind.__qualname__}",
        "traceback": outbox_settings.redact("".join(traceback.format_exception(exc))),
    }
    errors = [*record.errors, storable(error)]
    _finish(record, using, TaskStatus.FAILED, errors=errors, return_value=None)


def _log_failure(record: TaskResultRecord, exc: BaseException) -> None:
    logger.warning(
        "task %s failed: %s.%s: %s",
        record.id,
        type(exc).__module__,
        type(exc).__qualname__,
        exc,
        exc_info=exc,
        extra={"action": "tasks.failed", "result_id": str(record.id)},
    )


def _extra(record: TaskResultRecord) -> dict[str, Any]:
    return {"action": "tasks.duplicate", "result_id": str(record.id), "task": record.task_path}
