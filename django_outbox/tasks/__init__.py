"""Django tasks (``django.tasks``, Django 6.0+) through the outbox.

``TASKS = {"default": {"BACKEND": "django_outbox.tasks.OutboxTaskBackend"}}`` makes
``task.enqueue()`` stage the task in the caller's transaction; see docs/tasks.md.

This is also the module Celery's ``app.autodiscover_tasks()`` imports from each
installed app: importing it registers the Celery task that runs Django tasks
(:func:`django_outbox.tasks.worker.run_django_task`) when celery is installed. It imports
on Django 5.2 too; only :class:`OutboxTaskBackend` needs Django 6.

:mod:`.backend` stages a task in the caller's transaction, :mod:`.runner` runs it once
in a worker and records its result, and :mod:`.worker` is the Celery task that calls
the runner. The package may import the inbox, staging, the row's life, the transports
(Celery's), the models, the settings and the leaves; never the relay, the consumer or
what operates them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

if importlib.util.find_spec("celery") is not None:
    from . import worker  # noqa: F401  (registers the runner with every Celery app)

__all__ = ["OutboxTaskBackend"]


def __getattr__(name: str) -> Any:
    if name == "OutboxTaskBackend":
        if importlib.util.find_spec("django.tasks") is None:
            import django

            raise ImportError(
                "django_outbox.tasks.OutboxTaskBackend is a backend of django.tasks, which "
                f"Django 6.0 added; this is Django {django.get_version()}"
            )
        from .backend import OutboxTaskBackend

        return OutboxTaskBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
