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
#: The databases whose outbox this run partitioned.
PARTITIONED_ALIASES: set[str] = set()


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
    database's already is). Without the option, a database kept (``--reuse-db``) from
    a run with it is refused: its tests would run on a partitioned outbox unawares."""
    with django_db_blocker.unblock():
        _partition_outboxes(request.session.items, request.config.getoption(OPTION))
    yield


@pytest.fixture(autouse=True)
def _partitions_kept_ahead(request: pytest.FixtureRequest) -> None:
    """Under ``--partitioned-outbox``, before each transactional test, what a relay's
    retention pass does to the partitions: the closed ranges the last flush emptied are
    dropped and ranges are made ahead of the ids drawn; and the ids go on from the next
    range's start. Each test stages into ranges of its own then (a flush does not restart
    the ids: without this, every row after the first tests' 2,000 would land in the
    default partition)."""
    if not request.config.getoption(OPTION):
        return
    from django.db import connections
    from pytest_django.fixtures import _get_databases_for_test, validate_django_db

    marker = request.node.get_closest_marker("django_db")
    if marker is not None:
        transaction, reset_sequences = validate_django_db(marker)[:2]
        if not transaction or reset_sequences:
            # In the test's transaction, DDL would hold the table until the test ends;
            # a test that resets the sequences expects its ids from 1.
            return
    elif "transactional_db" in request.fixturenames:
        request.getfixturevalue("transactional_db")
    else:
        return
    databases, _ = _get_databases_for_test(request.node)
    for alias in ["default"] if databases is None else sorted(databases):
        if alias in PARTITIONED_ALIASES:
            _maintain_partitions(connections[alias])


def _maintain_partitions(connection: Any) -> None:
    from django_outbox.db import partitions
    from django_outbox.models import OutboxMessage

    settings = outbox_settings
    partitions.drop_expired(connection, settings.PUBLISHED_RETENTION, settings.ABANDONED_RETENTION)
    partitions.ensure_ahead(connection, PARTITIONED_ROWS, PARTITIONED_AHEAD)
    # The ids go on from the start of the next range: a test's rows never share a range
    # with the last test's (a range holding a few rows is read by a Seq Scan, rightly,
    # which the plan tests would take for a missing index); and when the last test's
    # ids ran past the ranges, the next range starts OVERFLOW_GAP above them.
    drawn = partitions.next_id(connection)
    starts = [p.lower for p in partitions.partitions(connection) if p.lower is not None]
    if drawn not in starts and any(start > drawn for start in starts):
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT setval(pg_get_serial_sequence(%s, 'id'), %s, false)",
                [OutboxMessage._meta.db_table, min(start for start in starts if start > drawn)],
            )
        partitions.ensure_ahead(connection, PARTITIONED_ROWS, PARTITIONED_AHEAD)


def _partition_outboxes(items: list[pytest.Item], partitioned: bool) -> None:
    from django.db import connections
    from pytest_django.fixtures import _get_databases_for_setup

    from django_outbox.db import partitions

    aliases, _ = _get_databases_for_setup(items)
    for alias in sorted(aliases):
        connection = connections[alias]
        if connection.vendor != "postgresql":
            continue
        if partitions.is_partitioned(connection) and not partitioned:
            pytest.fail(
                f"the outbox of test database {alias!r} was partitioned by a run with "
                f"{OPTION}: add {OPTION}, or --create-db for a plain one",
                pytrace=False,
            )
        if partitioned and not partitions.is_partitioned(connection):
            partitions.convert(connection, rows=PARTITIONED_ROWS, ahead=PARTITIONED_AHEAD)
        if partitioned:
            PARTITIONED_ALIASES.add(alias)


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
