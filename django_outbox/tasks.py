"""Django tasks (``django.tasks``, Django 6.0+) through the outbox.

``TASKS = {"default": {"BACKEND": "django_outbox.tasks.OutboxTaskBackend"}}`` makes
``task.enqueue()`` stage the task in the caller's transaction; see docs/tasks.md.

This is also the module Celery's ``app.autodiscover_tasks()`` imports from each
installed app: importing it registers the Celery task that runs Django tasks
(:func:`django_outbox.celery.run_django_task`) when celery is installed. It imports
on Django 5.2 too; only :class:`OutboxTaskBackend` needs Django 6.
"""

from __future__ import annotations

import importlib.util
from typing import Any

if importlib.util.find_spec("celery") is not None:
    from . import celery  # noqa: F401  (registers the runner with every Celery app)

__all__ = ["OutboxTaskBackend"]  # noqa: F822  (given by __getattr__)


def __getattr__(name: str) -> Any:
    if name == "OutboxTaskBackend":
        if importlib.util.find_spec("django.tasks") is None:
            import django

            raise ImportError(
                "django_outbox.tasks.OutboxTaskBackend is a backend of django.tasks, which "
                f"Django 6.0 added; this is Django {django.get_version()}"
            )
        from .taskbackend import OutboxTaskBackend

        return OutboxTaskBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
