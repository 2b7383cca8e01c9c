"""The suite's Django task (Django 6 only): enqueued by the producers in their order's
transaction, run by the task worker through the outbox's backend.

Each run writes one ``TaskEffect`` in the task's transaction, keyed by its result id,
with no unique constraint: a second run of one task shows up in the audit instead of
being stopped by an index."""

from __future__ import annotations

import os
import time

from django.tasks import TaskContext, task

from .destinations import TASK_QUEUE
from .models import TaskEffect

#: Seconds the task holds its transaction open after writing, so that a worker kill
#: lands mid-task often enough to be aimed at.
HOLD = 0.02


@task(takes_context=True, queue_name=TASK_QUEUE)
def ship(context: TaskContext, order: str) -> int:
    """One ``TaskEffect`` per run, committed with the task's outcome; its attempt."""
    TaskEffect.objects.create(
        result_id=context.task_result.id, order=order, attempt=context.attempt, pid=os.getpid()
    )
    time.sleep(HOLD)
    return context.attempt


def enqueue(order: str) -> str:
    """Enqueue :func:`ship` for the order of event ``order`` in the transaction in hand;
    the task's id. (The producer calls it here, where ``--sabotage staging`` wraps it.)"""
    return ship.enqueue(order).id
