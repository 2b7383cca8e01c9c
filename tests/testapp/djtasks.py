"""Django tasks (``django.tasks``, Django 6 only) run through the outbox by a real Celery
worker in tests/integration/test_tasks.py. Each leaves a Delivery row per run that
commits, so a second row for one task means its effects happened twice."""

from __future__ import annotations

import time

from django.tasks import TaskContext, task

from .models import Delivery


@task
def add(a: int, b: int) -> int:
    Delivery.objects.create(consumer="add", n=a + b)
    return a + b


@task
def explode(reason: str) -> None:
    Delivery.objects.create(consumer="explode")  # rolled back with the failure
    raise ValueError(reason)


@task(takes_context=True)
def stalls_on_first_attempt(context: TaskContext, seconds: float) -> int:
    """Writes, then (on its first attempt only) sleeps: a worker killed meanwhile has
    committed nothing, and the next attempt runs it to the end."""
    Delivery.objects.create(consumer="stalls", n=context.attempt)
    if context.attempt == 1:
        time.sleep(seconds)
    return context.attempt


@task
def label(name: str) -> str:
    """Records the order in which tasks ran (the Delivery ids grow)."""
    Delivery.objects.create(consumer=f"label:{name}")
    return name


@task
async def add_async(a: int, b: int) -> int:
    await Delivery.objects.acreate(consumer="add_async", n=a + b)
    return a + b


def not_a_task() -> None:
    """A plain function: a message naming it must not run it."""
    Delivery.objects.create(consumer="not_a_task")
