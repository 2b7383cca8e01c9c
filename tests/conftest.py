from __future__ import annotations

import pytest

from django_outbox.conf import outbox_settings


@pytest.fixture(autouse=True)
def _fresh_outbox_settings():
    """Each test reads OUTBOX afresh (override_settings also reloads through setting_changed)."""
    outbox_settings.reload()
    yield
    outbox_settings.reload()


@pytest.fixture(autouse=True)
def _settings_celery_app():
    """Every test starts with the test settings' Celery app current (as a project's own
    app is), whatever app an earlier test made current: the system checks and the relay
    read the current app."""
    from tests.settings import CELERY_APP

    CELERY_APP.set_current()
    yield
