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
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import Task  # type: ignore[import-untyped]

from .inbox import run_once


class InboxTask(Task):
    """A Celery task whose body runs at most once per task id (the event id).

    ``inbox_consumer`` names the consumer in the inbox (default: the task
    name); ``inbox_using`` is the database alias of the inbox and of the body's
    writes. Late acks are on by default: a worker killed mid-task leaves the
    message unacked, the broker redelivers it, and the inbox tells whether the
    body had committed.
    """

    inbox_consumer: str | None = None
    inbox_using: str = "default"
    acks_late = True
    reject_on_worker_lost = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id is None:  # called as a plain function: not a delivery, nothing to dedupe
            return super().__call__(*args, **kwargs)
        call = functools.partial(self.run, *args, **kwargs)
        return run_once(
            self.inbox_consumer or self.name,
            task_id,
            self.inbox_using,
            call,
            log_level=logging.INFO,
        )
