from __future__ import annotations

import os

from django.apps import AppConfig


class ChaosConfig(AppConfig):
    name = "chaos"
    label = "chaos"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Only ever set by ``python -m chaos --sabotage``, to show the audit
        # catches a broken guarantee; never in a real run.
        if sabotage := os.environ.get("CHAOS_SABOTAGE"):
            from .sabotage import apply

            apply(sabotage)
