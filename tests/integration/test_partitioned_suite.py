"""The suite's ``--partitioned-outbox`` option (tests/conftest.py): the outbox of each
test database is partitioned before the first test, a transactional test's flush
(TRUNCATE, restarting the ids when it resets sequences) keeps its partitions, and each
transactional test stages into a range, whatever the tests before it staged."""

from __future__ import annotations

import pytest
from django.db import connections

from django_outbox.db import partitions
from django_outbox.models import OutboxMessage
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


def _partition_of(pk: int) -> str:
    with connections["default"].cursor() as cursor:
        table = OutboxMessage._meta.db_table
        cursor.execute(f'SELECT tableoid::regclass::text FROM "{table}" WHERE id = %s', [pk])
        return cursor.fetchone()[0]


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_each_transactional_test_stages_into_a_range(partitioned, attempt):
    """Each attempt draws more ids than the ranges made ahead hold: its last row lands
    in the default partition, and the next attempt's first row in a range again."""
    rows = OutboxMessage.objects.bulk_create(
        OutboxMessage(event_type="e", destination="d", payload={})
        for _ in range(PARTITIONED_ROWS * 3)
    )
    assert _partition_of(rows[0].pk) != _partition_of(rows[PARTITIONED_ROWS].pk)
    assert not _partition_of(rows[0].pk).endswith("_default")
    assert _partition_of(rows[-1].pk).endswith("_default")
