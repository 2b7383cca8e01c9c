from __future__ import annotations

import pytest

from django_outbox.conf import outbox_settings


@pytest.fixture(autouse=True)
def _fresh_outbox_settings():
    """Each test reads OUTBOX afresh (override_settings also reloads through setting_changed)."""
    outbox_settings.reload()
    yield
    outbox_settings.reload()
