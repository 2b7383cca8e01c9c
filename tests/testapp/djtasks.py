"""Django tasks (``django.tasks``, Django 6 only) run through the outbox by a real Celery
worker in tests/integration/test_tasks.py. Each leaves a Delivery row per run that
commits, so a second row for one task means its effects happened twice."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from django.db import connection
from django.tasks import TaskContext, task
from django.utils.module_loading import import_string

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


@task(takes_context=True)
def interrupted_on_first_attempt(context: TaskContext, exception_path: str) -> int:
    """Writes, then (on its first attempt only) raises the exception at ``exception_path``,
    as a worker's signal handler raises its stop in the frame of the task it runs."""
    Delivery.objects.create(consumer="interrupted", n=context.attempt)
    if context.attempt == 1:
        raise import_string(exception_path)()
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


@task
def fails_with_unstorable_text() -> None:
    """A message as form input makes one: a NUL and half of a surrogate pair, which
    PostgreSQL can store in neither text nor jsonb."""
    raise ValueError("bad name a\x00b \ud800")


@task
def returns_unstorable_values() -> dict[str, object]:
    Delivery.objects.create(consumer="returns_unstorable_values")
    return {"name": "a\x00b", "half": "\udc80", "ratio": float("nan")}


@task
def exits(code: int) -> None:
    Delivery.objects.create(consumer="exits")  # rolled back with the failure
    sys.exit(code)


class HeldOpen(ValueError):
    """The error of :func:`fails_held_open`: formatting it (as the runner does to record
    it) holds the failing delivery there until the test lets it go, once per barrier."""

    def __str__(self) -> str:
        barrier = Path(self.args[0])
        try:
            os.close(os.open(barrier / "claimed", os.O_CREAT | os.O_EXCL))
        except FileExistsError:  # not the first delivery to fail: no hold
            return "failed"
        (barrier / "holding").touch()
        with (barrier / "go").open() as fifo:  # a FIFO: blocks until the test writes
            fifo.read()
        return "failed"


@task
def fails_held_open(barrier: str) -> None:
    """Counts each run in a file (an effect outside the transaction, as an e-mail
    would be), then fails with :class:`HeldOpen`."""
    with (Path(barrier) / "runs").open("a") as runs:
        runs.write("run\n")
    raise HeldOpen(barrier)


@task
def chain(remaining: int) -> int:
    """Enqueues itself ``remaining`` more times (-1: without end): tasks enqueued by
    tasks, for ``django_outbox.testing.run_tasks``."""
    Delivery.objects.create(consumer="chain", n=remaining)
    if remaining:
        chain.enqueue(remaining - 1)
    return remaining


class Unprintable(Exception):
    """A library's exception whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")


@task
def fails_unprintably() -> None:
    Delivery.objects.create(consumer="fails_unprintably")
    raise Unprintable()


@task
def times_out() -> None:
    """Its own query is cancelled by the statement timeout it sets (QueryCanceled, an
    OperationalError of the task, not the database going away)."""
    Delivery.objects.create(consumer="times_out")
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL statement_timeout = '50ms'")
        cursor.execute("SELECT pg_sleep(1)")
