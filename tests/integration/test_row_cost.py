"""What relaying a row writes on PostgreSQL: two row versions per event after staging
(the claim's, a HOT update, and the finalize's), each on the page its row was staged on, which the
outbox table's fillfactor (migration 0007) leaves room for. docs/relay.md, "What a
row costs PostgreSQL"."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from django_outbox import stage_many
from django_outbox.models import OutboxMessage, OutboxStatus
from django_outbox.testing import drain

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = OutboxMessage._meta.db_table
#: A backlog that fills several pages, staged at once (the densest the pages get).
EVENTS = 300


def _fillfactor() -> str | None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [TABLE])
        (options,) = cursor.fetchone()
    found = [option for option in options or () if option.startswith("fillfactor=")]
    return found[0].partition("=")[2] if found else None


def _pages() -> dict[int, int]:
    """Each row's id -> the heap page its current version is on."""
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT id, (ctid::text::point)[0]::bigint FROM "{TABLE}"')
        return dict(cursor.fetchall())


def _updates() -> tuple[int, int]:
    """The outbox table's updates so far and how many of them were HOT, this
    connection's flushed first (a backend flushes its counters when it goes idle after
    ``pg_stat_force_next_flush()``)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = %s::regclass",
            [TABLE],
        )
        updated, hot = cursor.fetchone()
    return int(updated), int(hot)


def _stage_backlog(dedup: bool = False) -> None:
    with transaction.atomic():
        stage_many(
            {
                "event_type": "cost.tested",
                "payload": {"n": n, "pad": "x" * 200},
                "destination": "costs",
                **({"dedup_key": f"d{n}"} if dedup else {}),
            }
            for n in range(EVENTS)
        )


def test_the_outbox_table_leaves_half_of_each_page_to_updates_and_migrating_back_resets_it():
    assert _fillfactor() == "50"
    call_command("migrate", "django_outbox", "0006", verbosity=0)
    try:
        assert _fillfactor() is None
    finally:
        call_command("migrate", "django_outbox", verbosity=0)
    assert _fillfactor() == "50"


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup-keys"])
def test_relaying_writes_two_row_versions_per_event_on_the_page_it_was_staged_on(dedup):
    """With dedup keys too: ``outbox_dedup_unfinished_idx`` names no column the claim
    writes, so the claim stays HOT."""
    if connection.pg_version < 150000:
        pytest.skip("pg_stat_force_next_flush() is PostgreSQL 15+")
    _stage_backlog(dedup)
    staged_on, (updated_before, hot_before) = _pages(), _updates()
    assert len(drain()) == EVENTS
    updated, hot = _updates()
    assert updated - updated_before == 2 * EVENTS  # the claim's version, the finalize's
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {OutboxStatus.PUBLISHED}
    published_on = _pages()
    kept = sum(published_on[pk] == page for pk, page in staged_on.items())
    # The claim grows a row by its lease (locked_by, lease_token, locked_until), so a few
    # rows of a page staged to half may not fit; with no fillfactor (pages staged full)
    # none does, and every version goes to a new page at the table's end.
    assert kept >= 0.8 * EVENTS, f"{kept} of {EVENTS} rows kept their page"
    # The claim writes no column an index names, so each claim that found room on its
    # row's page wrote no index entry (HOT); the finalize sets published_at, which the
    # partial indexes name, so it never is.
    assert 0.8 * EVENTS <= hot - hot_before <= EVENTS, f"{hot - hot_before} HOT updates"
