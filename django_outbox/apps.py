from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class OutboxConfig(AppConfig):
    name = "django_outbox"
    label = "django_outbox"
    verbose_name = _("Transactional outbox")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  (registers the system checks)
        from .conf import sets_tasks

        if sets_tasks():
            # Django registers its check of the TASKS backends (OutboxTaskBackend.check:
            # E019, W006, W007 ...) when django.tasks is imported, which a project's
            # check run need not do.
            import django.tasks  # noqa: F401
