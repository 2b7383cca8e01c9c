"""The consuming side of Celery routes: a task base class that runs once per event.

A route ``{"celery_task": "billing.tasks.charge"}`` makes the relay send the
event as that task, with the event id as the task id. Declare the task with
:class:`InboxTask` as its base and a second delivery of the same event (a relay
retry, a broker redelivery) finds the inbox mark and returns None without
running the body::

    from celery import shared_task
    from django_outbox.celery import InboxTask

    @shared_task(base=InboxTask, name="billing.tasks.charge")
    def charge(order_id, total):
        Charge.objects.create(order_id=order_id, amount=total)

The body runs inside the inbox transaction, so its database writes commit with
the mark or not at all. An exception (``self.retry()`` included: it raises
``Retry``) rolls the mark back, so a retry of the task runs the body again.

``inbox_event_types`` (``@shared_task(base=InboxTask,
inbox_event_types=["order.placed"])``) limits the body to those event types: a
task for another event returns None at once, without an inbox row.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Collection
from typing import Any, NoReturn

try:
    from celery import Task, shared_task  # type: ignore[import-untyped]
    from celery.exceptions import (  # type: ignore[import-untyped]
        Reject,
        WorkerShutdown,
        WorkerTerminate,
    )
except ImportError as exc:  # the [celery] extra is not installed
    raise ImportError(
        "django_outbox.celery requires the celery package: "
        'pip install "django-transactional-outbox[celery]"'
    ) from exc

from .conf import outbox_settings
from .conf.redact import SecretFilter
from .conf.routes import TASK_RUNNER
from .inbox import handled_types, handles, run_once

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # the runner's error texts

#: What a Celery worker raises, from its signal handlers, in the frame of the task it runs
#: when it is made to stop at once (a solo pool's hard shutdown): not the task's failure.
WORKER_STOPS = (WorkerShutdown, WorkerTerminate)
#: How long a worker that cannot run a Django task yet (its code or its TASKS backend
#: is not deployed here) waits before the task's message is tried again.
UNAVAILABLE_RETRY_SECONDS = 30
#: How long a worker waits before it puts back on its queue a task's message whose retry
#: the broker did not take: while the cause lasts, the message comes straight back, and
#: each return counts against a quorum queue's delivery limit.
UNSENT_RETRY_PAUSE_SECONDS = 5


class InboxTask(Task):
    """A Celery task whose body runs at most once per task id (the event id).

    ``inbox_consumer`` names the consumer in the inbox (default: the task
    name); ``inbox_using`` is the database alias of the inbox and of the body's
    writes; ``inbox_event_types``, when set, are the event types (the
    ``event_type`` header) the body handles: any other returns None without an
    inbox row (checked when the task class is made, like
    ``@inbox_handler(event_types=...)``). Late acks are on by default: a worker
    killed mid-task leaves the message unacked, the broker redelivers it, and
    the inbox tells whether the body had committed.
    """

    inbox_consumer: str | None = None
    inbox_using: str = "default"
    inbox_event_types: Collection[str] | None = None
    acks_late = True
    reject_on_worker_lost = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.inbox_event_types = handled_types(cls.inbox_event_types)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id is None:  # called as a plain function: not a delivery, nothing to dedupe
            return super().__call__(*args, **kwargs)
        consumer = self.inbox_consumer or self.name
        if self.inbox_event_types is not None:
            event_type = str((self.request.headers or {}).get("event_type") or "")
            if not handles(consumer, self.inbox_event_types, event_type, task_id):
                return None
        call = functools.partial(self.run, *args, **kwargs)
        return run_once(
            consumer,
            task_id,
            self.inbox_using,
            call,
            log_level=logging.INFO,
        )


@shared_task(
    name=TASK_RUNNER, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None
)
def run_django_task(self: Task, **payload: Any) -> None:
    """The Celery task that runs Django tasks (``django.tasks``) enqueued through
    :class:`django_outbox.tasks.OutboxTaskBackend`, once in effect: see
    :mod:`django_outbox.taskrunner`. Registered with every Celery app that imports
    ``django_outbox.tasks`` (``app.autodiscover_tasks()`` does).

    A task it cannot run yet (:class:`~django_outbox.taskrunner.TaskUnavailable`) and
    an error of the runner itself (the database gone mid-run) are sent again after
    ``UNAVAILABLE_RETRY_SECONDS``, never acked away: the task's own errors never get
    here (they are its FAILED outcome, ``SystemExit`` included), nor do the worker's own
    stops (``WorkerShutdown``, ``WorkerTerminate``: the attempt commits nothing). A
    retry the broker does not take is not dropped as Celery would drop it
    (``Reject(requeue=False)``): this message goes back to its queue instead
    (``tasks.retry_unsent``)."""
    try:
        from .taskrunner import run  # needs django.tasks: Django 6.0+

        run(
            payload,
            str(self.request.id),
            str(self.request.hostname),
            interrupts=WORKER_STOPS,
        )
    except Exception as exc:
        logger.error(
            "task %s: %s: %s; sent again in %ds",
            self.request.id,
            type(exc).__name__,
            exc,
            UNAVAILABLE_RETRY_SECONDS,
            extra={"action": "tasks.unavailable", "result_id": str(self.request.id)},
        )
        _retry(self, exc)


def _retry(task: Task, exc: Exception) -> NoReturn:
    """Have Celery send ``task``'s message again later; when that send fails (the
    broker refused it, a shutdown interrupted it), requeue this delivery after
    ``UNSENT_RETRY_PAUSE_SECONDS``."""
    try:
        raise task.retry(exc=exc, countdown=UNAVAILABLE_RETRY_SECONDS) from exc
    except Reject as rejected:  # Celery's answer to a retry it could not send
        logger.error(
            "task %s: its retry was not sent (%s); requeued in %ds",
            task.request.id,
            rejected.reason,
            UNSENT_RETRY_PAUSE_SECONDS,
            extra={"action": "tasks.retry_unsent", "result_id": str(task.request.id)},
        )
        time.sleep(UNSENT_RETRY_PAUSE_SECONDS)
        raise Reject(rejected.reason, requeue=True) from exc
