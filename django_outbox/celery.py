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
from collections.abc import Collection
from typing import Any

try:
    from celery import Task  # type: ignore[import-untyped]
except ImportError as exc:  # the [celery] extra is not installed
    raise ImportError(
        "django_outbox.celery requires the celery package: "
        'pip install "django-transactional-outbox[celery]"'
    ) from exc

from .conf import outbox_settings
from .conf.redact import SecretFilter
from .inbox.records import handled_types, handles, run_once
from .tasks.worker import run_django_task  # noqa: F401  (its documented path)

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # the runner's error texts


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
