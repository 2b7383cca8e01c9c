"""The pytest plugin of django_outbox (entry point ``pytest11``): the ``outbox`` fixture.

pytest loads plugins before Django is set up, so this module imports nothing of
Django or of the app's models until a test asks for the fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from django_outbox.testing import Outbox


@pytest.fixture
def outbox() -> Iterator[Outbox]:
    """``outbox.captured``: the events committed during the test so far;
    ``outbox.drain(using="default")``: relay every due row in-process and return the
    published events. See :mod:`django_outbox.testing`."""
    from django.apps import apps

    if not apps.ready:
        pytest.fail(
            "the outbox fixture needs Django set up: run the tests with pytest-django and "
            "its DJANGO_SETTINGS_MODULE (docs/testing.md, With pytest)",
            pytrace=False,
        )
    from django_outbox.testing import Outbox

    capture = Outbox()
    capture.start()
    try:
        yield capture
    finally:
        capture.stop()
