"""The suite's fixtures and its ``--partitioned-outbox`` option.

``--partitioned-outbox`` runs the tests unchanged on a partitioned outbox (issue 44):
once the test databases are created and migrated, the outbox table of each PostgreSQL
one is converted by :func:`django_outbox.db.partitions.convert` into small ranges
(``PARTITIONED_ROWS`` ids each, ``PARTITIONED_AHEAD`` made ahead), so a test that stages
a few thousand rows also fills the default partition. A transactional test's flush
(TRUNCATE, with ``RESTART IDENTITY`` when it resets sequences) empties every partition
and keeps them. A test that needs the plain table carries
``@pytest.mark.plain_outbox("why")`` and is skipped under the option, with that reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from django_outbox.conf import outbox_settings

OPTION = "--partitioned-outbox"
#: Ids per range and ranges made ahead: small, so that tests cross range bounds.
PARTITIONED_ROWS = 1000
PARTITIONED_AHEAD = 2


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        help="convert the outbox table of each test database into a partitioned one "
        "(django_outbox.db.partitions.convert) before the first test; tests marked "
        "plain_outbox are skipped",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "plain_outbox(reason): a test that needs the outbox table not partitioned "
        f"(skipped under {OPTION}, with the reason)",
    )


def pytest_report_header(config: pytest.Config) -> str | None:
    if not config.getoption(OPTION):
        return None
    return (
        f"outbox: partitioned ({OPTION}): ranges of {PARTITIONED_ROWS} ids, "
        f"{PARTITIONED_AHEAD} ahead; plain_outbox tests skipped"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("plain_outbox")
        if marker is None:
            continue
        if len(marker.args) != 1 or not marker.args[0]:
            raise pytest.UsageError(f"{item.nodeid}: plain_outbox takes one reason")
        if config.getoption(OPTION):
            item.add_marker(pytest.mark.skip(reason=f"plain outbox table: {marker.args[0]}"))


@pytest.fixture(scope="session")
def django_db_setup(
    django_db_setup: None, django_db_blocker: Any, request: pytest.FixtureRequest
) -> Iterator[None]:
    """pytest-django's databases; under ``--partitioned-outbox`` the outbox table of each
    PostgreSQL one set up for this run is partitioned (kept as it is when a kept
    database's already is)."""
    if request.config.getoption(OPTION):
        with django_db_blocker.unblock():
            _partition_outboxes(request.session.items)
    yield


def _partition_outboxes(items: list[pytest.Item]) -> None:
    from django.db import connections
    from pytest_django.fixtures import _get_databases_for_setup

    from django_outbox.db import partitions

    aliases, _ = _get_databases_for_setup(items)
    for alias in sorted(aliases):
        connection = connections[alias]
        if connection.vendor == "postgresql" and not partitions.is_partitioned(connection):
            partitions.convert(connection, rows=PARTITIONED_ROWS, ahead=PARTITIONED_AHEAD)


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
