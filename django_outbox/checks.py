"""System checks: ``django_outbox.E001``-``E007``, ``E010`` and ``E011`` for settings,
``W001`` for databases.

The ids, messages and hints are listed in docs/reference/checks.md.
"""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.db import connections, router

from . import db
from .conf import outbox_settings


@checks.register(checks.Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(problem.msg, hint=problem.hint, id=problem.id)
        for problem in outbox_settings.problems()
    ]


@checks.register(checks.Tags.database)
def check_databases(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn about databases holding the outbox where several relays cannot share the work.

    Needs no query (feature flags only), but like Django's own database checks
    it runs only when ``check --database`` (or ``migrate``) names databases.
    """
    from .models import OutboxMessage

    return [
        checks.Warning(
            f"Database {alias!r} ({connections[alias].vendor}) cannot SELECT ... FOR UPDATE "
            "SKIP LOCKED, so relays cannot share its outbox.",
            hint="Run exactly one run_outbox_relay for this database, or use PostgreSQL.",
            id="django_outbox.W001",
        )
        for alias in databases or ()
        if router.allow_migrate_model(alias, OutboxMessage)
        and not db.supports_skip_locked(connections[alias])
    ]
