"""The Celery task that runs Django tasks (``django.tasks``) enqueued through
:class:`django_outbox.tasks.OutboxTaskBackend`: registered with every Celery app that
imports ``django_outbox.tasks`` (``app.autodiscover_tasks()`` does) under the name
the relay sends it by (``TASK_RUNNER``), so moving it moves no message."""

from __future__ import annotations

import logging
import time
from typing import Any, NoReturn

from celery import Task, shared_task  # type: ignore[import-untyped]
from celery.exceptions import (  # type: ignore[import-untyped]
    Reject,
    WorkerShutdown,
    WorkerTerminate,
)

from ..conf import outbox_settings
from ..conf.redact import SecretFilter
from ..conf.routes import TASK_RUNNER

logger = logging.getLogger("django_outbox.celery")
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


@shared_task(
    name=TASK_RUNNER, bind=True, acks_late=True, reject_on_worker_lost=True, max_retries=None
)
def run_django_task(self: Task, **payload: Any) -> None:
    """The Celery task that runs Django tasks (``django.tasks``) enqueued through
    :class:`django_outbox.tasks.OutboxTaskBackend`, once in effect: see
    :mod:`django_outbox.tasks.runner`. Registered with every Celery app that imports
    ``django_outbox.tasks`` (``app.autodiscover_tasks()`` does).

    A task it cannot run yet (:class:`~django_outbox.tasks.runner.TaskUnavailable`) and
    an error of the runner itself (the database gone mid-run) are sent again after
    ``UNAVAILABLE_RETRY_SECONDS``, never acked away: the task's own errors never get
    here (they are its FAILED outcome, ``SystemExit`` included), nor do the worker's own
    stops (``WorkerShutdown``, ``WorkerTerminate``: the attempt commits nothing). A
    retry the broker does not take is not dropped as Celery would drop it
    (``Reject(requeue=False)``): this message goes back to its queue instead
    (``tasks.retry_unsent``)."""
    try:
        from .runner import run  # needs django.tasks: Django 6.0+

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
