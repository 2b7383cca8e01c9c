from __future__ import annotations

import os

from django.apps import AppConfig

from .destinations import TASKS_UNAVAILABLE


class ChaosConfig(AppConfig):
    name = "chaos"
    label = "chaos"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        if TASKS_UNAVAILABLE is None:
            # The current Celery app of every chaos process, as a project's package
            # imports its own: the relays send the Django tasks through it.
            from . import celery_app  # noqa: F401

        # Only ever set by ``python -m chaos --sabotage``, to show the audit
        # catches a broken guarantee; never in a real run.
        if sabotage := os.environ.get("CHAOS_SABOTAGE"):
            from .sabotage import apply

            apply(sabotage)
