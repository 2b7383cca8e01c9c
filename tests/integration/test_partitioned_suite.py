"""The suite's ``--partitioned-outbox`` option (tests/conftest.py): the outbox of each
test database is partitioned before the first test, and a transactional test's flush
(TRUNCATE, restarting the ids when it resets sequences) keeps its partitions."""

from __future__ import annotations

import pytest
from django.db import connections

from django_outbox.db import partitions
from tests.conftest import OPTION, PARTITIONED_ROWS
from tests.factories import OutboxMessageFactory

pytestmark = pytest.mark.django_db(databases=["default", "other"], transaction=True)


@pytest.fixture
def partitioned(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption(OPTION):
        pytest.skip(f"runs under {OPTION} only")


@pytest.mark.parametrize("alias", ["default", "other"])
def test_every_test_database_has_its_outbox_partitioned(partitioned, alias):
    ranges = [p for p in partitions.partitions(connections[alias]) if not p.default]
    assert partitions.is_partitioned(connections[alias])
    assert {p.upper - p.lower for p in ranges if p.lower is not None} == {PARTITIONED_ROWS}


@pytest.mark.parametrize("attempt", [1, 2])
@pytest.mark.django_db(databases=["default"], transaction=True, reset_sequences=True)
def test_a_flush_that_resets_sequences_keeps_the_partitions(partitioned, attempt):
    before = partitions.partitions(connections["default"])
    row = OutboxMessageFactory()
    assert row.pk == 1  # the flush after the other attempt restarted the ids
    assert partitions.partitions(connections["default"]) == before
