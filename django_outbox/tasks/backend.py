"""The ``django.tasks`` backend (Django 6.0+) whose ``enqueue()`` commits with the caller.

``enqueue()`` writes the task as an outbox row, with its result record, in the
caller's transaction on the backend's database: the task exists if and only if
that transaction commits, which ``transaction.on_commit(task.enqueue)`` cannot
promise (a crash after the commit loses it). A relay publishes the row as a
Celery message of :data:`~django_outbox.conf.routes.TASK_RUNNER` to the Celery queue
named like the task's ``queue_name``, and a Celery worker runs the task once in
effect through the inbox (:mod:`django_outbox.tasks.runner`). See docs/tasks.md.

Import it as ``django_outbox.tasks.OutboxTaskBackend``: this module needs
``django.tasks``, which Django 5.2 lacks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from django.conf import settings
from django.core import checks
from django.core.exceptions import ValidationError
from django.db import connections, transaction
from django.tasks import Task, TaskResult, TaskResultStatus
from django.tasks.backends.base import BaseTaskBackend
from django.tasks.base import TaskError
from django.tasks.exceptions import InvalidTask, InvalidTaskBackend, TaskResultDoesNotExist
from django.tasks.signals import task_enqueued
from django.utils.json import normalize_json
from django.utils.module_loading import import_string

from .. import db
from ..conf import CELERY_EXTRA, CHECK_IDS
from ..conf.redact import describe
from ..conf.routes import MAX_NAME_BYTES, TASKS_PREFIX, is_valid_destination
from ..exceptions import NotInTransaction
from ..models import TaskResultRecord
from ..staging.stage import in_user_atomic, stage, to_json
from ..transports.celery import publishes_unconfirmed

#: The backend's ``OPTIONS`` and their defaults.
DEFAULT_OPTIONS: dict[str, Any] = {"DATABASE": "default", "REQUIRE_TRANSACTION": False}


class OutboxTaskBackend(BaseTaskBackend):
    """Django tasks staged in the caller's transaction, run by Celery workers.

    ``OPTIONS``: ``DATABASE``, the alias the tasks' outbox rows and results are
    written to (default ``"default"``); a task's own writes commit with its
    outcome only on that database. ``REQUIRE_TRANSACTION`` (default False): True
    refuses an enqueue outside ``transaction.atomic()``, which otherwise commits on
    its own at once. ``QUEUES``: the task queues, each a Celery queue
    (``queue_name`` is the queue the task is sent to).

    ``aenqueue()`` is Django's: ``enqueue()`` through ``sync_to_async`` in the thread
    where Django runs sync code, so it joins the transaction open there (async code
    that code under ``atomic()`` called through ``async_to_sync``), else commits at once.
    """

    supports_defer = True  # run_after: the row's available_at
    supports_priority = True  # the broker's message priority: see docs/tasks.md
    supports_get_result = True  # the TaskResultRecord table
    supports_async_task = True  # the runner calls coroutines through async_to_sync

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        options = self.options if isinstance(self.options, dict) else {}
        self.using: str = options.get("DATABASE", DEFAULT_OPTIONS["DATABASE"])
        self.require_transaction = options.get(
            "REQUIRE_TRANSACTION", DEFAULT_OPTIONS["REQUIRE_TRANSACTION"]
        )

    def enqueue(self, task: Task, args: Sequence[Any], kwargs: dict[str, Any]) -> TaskResult:
        """Stage ``task`` in the transaction in hand on the backend's database, or, in
        autocommit, in a transaction of its own, committed before it returns; with
        ``REQUIRE_TRANSACTION`` it raises :class:`~django_outbox.NotInTransaction` there."""
        self.validate_task(task)
        # Django's own normalization (TypeError for what JSON cannot hold), then the
        # outbox's: no NaN, nothing PostgreSQL cannot store, within MAX_PAYLOAD_BYTES.
        arguments = {"args": normalize_json(args), "kwargs": normalize_json(kwargs)}
        arguments = to_json(arguments, "arguments", task.module_path)
        # A test case's own atomic blocks do not count: in production there are none.
        if self.require_transaction and not in_user_atomic(transaction.get_connection(self.using)):
            raise NotInTransaction(
                f"{task.name}.enqueue() on the outbox task backend must run inside "
                f"transaction.atomic(using={self.using!r}), with the writes the task belongs "
                f'to (TASKS["{self.alias}"]["OPTIONS"]["REQUIRE_TRANSACTION"] is True)'
            )
        with transaction.atomic(using=self.using, savepoint=False):
            return self._stage(task, arguments)

    def _stage(self, task: Task, arguments: dict[str, Any]) -> TaskResult:
        """Write ``task``'s outbox row and result record in the transaction in hand;
        ``task_enqueued`` is sent once it commits."""
        row = stage(
            task.module_path,
            {"backend": self.alias, "task": task.module_path, "priority": task.priority},
            destination=TASKS_PREFIX + task.queue_name,
            using=self.using,
            available_at=task.run_after,
        )
        record = TaskResultRecord.objects.using(self.using).create(
            id=row.event_id,
            task_path=task.module_path,
            backend=self.alias,
            queue_name=task.queue_name,
            priority=task.priority,
            run_after=task.run_after,
            args=arguments["args"],
            kwargs=arguments["kwargs"],
        )
        result = self.result_of(record, task)
        send = functools.partial(task_enqueued.send, type(self), task_result=result)
        transaction.on_commit(send, using=self.using, robust=True)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        """The task's result as last written; :class:`TaskResultDoesNotExist` for an id
        that is not a committed task of this database."""
        try:
            record = TaskResultRecord.objects.using(self.using).get(id=result_id)
        except (TaskResultRecord.DoesNotExist, ValidationError, ValueError):
            raise TaskResultDoesNotExist(result_id) from None
        return self.result_of(record)

    def task_of(self, record: TaskResultRecord) -> Task:
        """The task of ``record``: imported by its path, with the options it was enqueued
        with; :class:`InvalidTask` when the path imports no task, or the options are not
        valid here (its backend alias is not in this process's ``TASKS``)."""
        task = load_task(record.task_path)
        try:
            return task.using(
                priority=record.priority,
                queue_name=record.queue_name,
                run_after=record.run_after,
                backend=record.backend,
            )
        except InvalidTaskBackend as exc:
            raise InvalidTask(f"task {record.task_path!r}: {describe(exc)}") from exc

    def result_of(self, record: TaskResultRecord, task: Task | None = None) -> TaskResult:
        """``record`` as Django's :class:`TaskResult`; ``task`` is its task when the
        caller has it already (else :meth:`task_of`, or an :class:`UnavailableTask` where
        this process cannot import it: the result is read all the same)."""
        if task is None:
            try:
                task = self.task_of(record)
            except InvalidTask as exc:
                task = UnavailableTask.of(record, str(exc))
        result: TaskResult = TaskResult(
            task=task,
            id=str(record.id),
            status=TaskResultStatus(record.status),
            enqueued_at=record.enqueued_at,
            started_at=record.started_at,
            finished_at=record.finished_at,
            last_attempted_at=record.last_attempted_at,
            args=record.args,
            kwargs=record.kwargs,
            backend=record.backend,
            errors=[TaskError(**error) for error in record.errors],
            worker_ids=list(record.worker_ids),
        )
        object.__setattr__(result, "_return_value", record.return_value)
        return result

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        """What the backend needs: its options right, queue names that can be Celery
        queues, the celery package and a Celery app with a broker, and a database where
        relays can share the rows."""
        found = _option_problems(self.alias, self.options)
        found += [_bad_queue(self.alias, q) for q in sorted(self.queues) if not is_task_queue(q)]
        found += _celery_problems(self.alias)
        if self.using in settings.DATABASES and not db.supports_skip_locked(
            connections[self.using]
        ):
            found.append(_no_skip_locked(self.alias, self.using))
        return found


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UnavailableTask(Task):
    """The task of a stored result that this process cannot import (its code is deployed
    with the workers only, or no longer exists): named by the stored path, with the
    options it was enqueued with; calling it raises :class:`InvalidTask` saying why."""

    def __post_init__(self) -> None:
        """Nothing to validate: it never runs here."""

    @classmethod
    def of(cls, record: TaskResultRecord, why: str) -> UnavailableTask:
        return cls(
            func=_unavailable(record.task_path, why),
            priority=record.priority,
            backend=record.backend,
            queue_name=record.queue_name,
            run_after=record.run_after,
        )


def _unavailable(path: str, why: str) -> Callable[..., NoReturn]:
    """A stand-in function named like the task at ``path``, which raises ``why``."""

    def unavailable(*args: Any, **kwargs: Any) -> NoReturn:
        raise InvalidTask(why)

    module, _, name = path.rpartition(".")
    unavailable.__module__, unavailable.__qualname__, unavailable.__name__ = module, name, name
    return unavailable


def load_task(path: str) -> Task:
    """The task (a :func:`django.tasks.task`-decorated function) at ``path``; raises
    :class:`InvalidTask` if ``path`` imports no task."""
    try:
        task = import_string(path)
    except Exception as exc:  # any error of its module: ImproperlyConfigured, SyntaxError ...
        raise InvalidTask(f"cannot import the task {path!r}: {describe(exc)}") from exc
    if not isinstance(task, Task):
        raise InvalidTask(f"{path!r} is a {type(task).__name__}, not a task (use @task)")
    return task


def is_task_queue(queue: object) -> bool:
    """Whether ``queue`` can be a task queue: its destination ``django.tasks:<queue>``
    and its Celery queue must be valid names."""
    return (
        isinstance(queue, str)
        and is_valid_destination(TASKS_PREFIX + queue)
        and queue[:1].isalnum()
        and len(queue.encode()) <= MAX_NAME_BYTES
    )


def _option_problems(alias: str, options: object) -> list[checks.CheckMessage]:
    where = f'TASKS["{alias}"]["OPTIONS"]'
    hint = (
        'OPTIONS takes "DATABASE": a database alias (default "default"), and '
        '"REQUIRE_TRANSACTION": True or False (default False); see docs/tasks.md.'
    )
    if not isinstance(options, dict):
        return [checks.Error(f"{where} must be a dict.", hint=hint, id=CHECK_IDS["bad_tasks"])]
    found: list[checks.CheckMessage] = [
        checks.Error(f"{where} has no option {key!r}.", hint=hint, id=CHECK_IDS["bad_tasks"])
        for key in sorted(map(str, set(options) - set(DEFAULT_OPTIONS)))
    ]
    required = options.get("REQUIRE_TRANSACTION", DEFAULT_OPTIONS["REQUIRE_TRANSACTION"])
    if not isinstance(required, bool):
        found.append(
            checks.Error(
                f'{where}["REQUIRE_TRANSACTION"] must be True or False; got {required!r}.',
                hint=hint,
                id=CHECK_IDS["bad_tasks"],
            )
        )
    database = options.get("DATABASE", DEFAULT_OPTIONS["DATABASE"])
    if database not in settings.DATABASES:
        found.append(
            checks.Error(
                f'{where}["DATABASE"] is {database!r}, which is not in DATABASES.',
                hint=f"Name one of: {', '.join(map(repr, settings.DATABASES))}.",
                id=CHECK_IDS["bad_tasks"],
            )
        )
    return found


def _bad_queue(alias: str, queue: object) -> checks.CheckMessage:
    return checks.Error(
        f'TASKS["{alias}"]["QUEUES"] has {queue!r}, which cannot name a Celery queue here.',
        hint=f"A queue name is 1-{255 - len(TASKS_PREFIX)} characters of letters, digits and "
        "._:/-, starting with a letter or digit.",
        id=CHECK_IDS["bad_tasks"],
    )


def _celery_problems(alias: str) -> list[checks.CheckMessage]:
    """What the relay needs to send the tasks through the current Celery app: celery
    installed (E016), a broker URL (W007), publisher confirms on RabbitMQ (W004).
    Connects nowhere."""
    where = f'TASKS["{alias}"]'
    if importlib.util.find_spec("celery") is None:
        return [
            checks.Error(
                f"{where} runs its tasks with Celery workers, which requires the celery "
                f"package: pip install {CELERY_EXTRA}",
                hint="Install it where the relay and the workers run.",
                id=CHECK_IDS["missing_celery"],
            )
        ]
    from celery import current_app  # type: ignore[import-untyped]

    if not (current_app.conf.broker_write_url or current_app.conf.broker_url):
        return [
            checks.Warning(
                f"{where} is sent through the current Celery app, which has no broker URL: "
                "the relay would send the tasks to Celery's default, amqp://guest@localhost//.",
                hint="Create the Celery app in your project's package (mysite/__init__.py "
                "imports mysite/celery.py) with its broker (CELERY_BROKER_URL); see docs/tasks.md.",
                id=CHECK_IDS["tasks_no_celery_app"],
            )
        ]
    if publishes_unconfirmed():
        return [
            checks.Warning(
                f"{where} is sent to RabbitMQ without publisher confirms: a task the broker "
                "refuses or loses is marked PUBLISHED all the same.",
                hint='Set CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True} (the '
                "Celery app's broker_transport_options); see docs/tasks.md.",
                id=CHECK_IDS["celery_no_confirms"],
            )
        ]
    return []


def _no_skip_locked(alias: str, using: str) -> checks.CheckMessage:
    vendor = connections[using].vendor
    return checks.Warning(
        f'TASKS["{alias}"] writes its tasks to database {using!r} ({vendor}), which cannot '
        "SELECT ... FOR UPDATE SKIP LOCKED: one relay only, and concurrent workers wait on it.",
        hint="Run one run_outbox_relay and few workers, or use PostgreSQL.",
        id=CHECK_IDS["tasks_no_skip_locked"],
    )
