"""The app's config, and the one check that runs without it: ``django_outbox.E050``.

Importing ``django_outbox`` imports this module (see ``__init__``), so a project that
uses the package but left it out of ``INSTALLED_APPS``, where ``ready()`` (and with it
every other check) never runs, still hears of it from ``manage.py check``.
"""

from __future__ import annotations

from typing import Any

from django.apps import AppConfig, apps
from django.core import checks
from django.utils.translation import gettext_lazy as _

from .conf import MISSING_APP


class OutboxConfig(AppConfig):
    name = "django_outbox"
    label = "django_outbox"
    verbose_name = _("Transactional outbox")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from .conf import sets_tasks
        from .ops import checks  # noqa: F401  (registers the system checks)

        if sets_tasks():
            # Django registers its check of the TASKS backends (OutboxTaskBackend.check:
            # E019, W006, W007 ...) when django.tasks is imported, which a project's
            # check run need not do.
            import django.tasks  # noqa: F401


@checks.register(checks.Tags.compatibility)
def check_installed(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E050 when ``django_outbox`` is imported but not in ``INSTALLED_APPS``."""
    if apps.is_installed(OutboxConfig.name):
        return []
    return [checks.Error(MISSING_APP.msg, hint=MISSING_APP.hint, id=MISSING_APP.id)]
