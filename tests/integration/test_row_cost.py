"""What relaying a row writes on PostgreSQL: two row versions per event after staging
(the claim's, a HOT update, and the finalize's), each on the page its row was staged on, which the
outbox table's fillfactor (migration 0007) leaves room for. docs/relay.md, "What a
row costs PostgreSQL"."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import psycopg
import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction

from django_outbox import stage_many
from django_outbox.models import OutboxMessage, OutboxStatus
from django_outbox.testing import drain

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = OutboxMessage._meta.db_table
#: A backlog that fills several pages, staged at once (the densest the pages get).
EVENTS = 300
#: How long a measurement waits for the server's other transactions to end before it stages.
HORIZON_WAIT = 30.0
#: Measurements a test makes before it fails: a transaction another test opens anywhere on the
#: server during the drain stops the pruning the finalize needs (see _horizon_holders).
ATTEMPTS = 3


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
    """The outbox table's updates so far (its partitions' on a partitioned outbox) and
    how many of them were HOT, this connection's flushed first (a backend flushes its
    counters when it goes idle after ``pg_stat_force_next_flush()``)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT sum(n_tup_upd), sum(n_tup_hot_upd) FROM pg_stat_user_tables"
            " WHERE relid = %s::regclass"
            " OR relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = %s::regclass)",
            [TABLE, TABLE],
        )
        updated, hot = cursor.fetchone()
    return int(updated), int(hot)


def _horizon_holders() -> list[tuple]:
    """The server's other client sessions (a lazy VACUUM holds back nothing) that hold
    back the horizon page pruning needs: a
    snapshot in this database, or a transaction that has written, in any database (its
    xid pins the relay's snapshot xmin, and PostgreSQL recomputes its per-database
    horizon only when that moves). While one does, no version that died after it began
    is pruned: the finalize finds its row's page full of the staged and the claimed
    versions and writes its own on another page."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, datname, backend_type, state, left(query, 120)"
            " FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            " AND backend_type = 'client backend' AND (backend_xid IS NOT NULL"
            " OR (datname = current_database() AND backend_xmin IS NOT NULL))"
        )
        return cursor.fetchall()


def _wait_for_the_horizon() -> None:
    deadline = time.monotonic() + HORIZON_WAIT
    while _horizon_holders() and time.monotonic() < deadline:
        time.sleep(0.05)


def _kept(staged_on: dict[int, int]) -> int:
    published_on = _pages()
    return sum(published_on[pk] == page for pk, page in staged_on.items())


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


@pytest.mark.plain_outbox(
    "migrates back to 0006 and reads the table's own fillfactor: a partitioned table has"
    " none (each partition has the first one's)"
)
def test_the_outbox_table_leaves_half_of_each_page_to_updates_and_migrating_back_resets_it():
    assert _fillfactor() == "50"
    call_command("migrate", "django_outbox", "0006", verbosity=0)
    try:
        assert _fillfactor() is None
    finally:
        call_command("migrate", "django_outbox", verbosity=0)
    assert _fillfactor() == "50"


def _measure(
    dedup: bool = False, during: Callable[[], AbstractContextManager] = nullcontext
) -> tuple[int, int, list[tuple]]:
    """Stage the backlog on an empty table and drain it, both ``during`` what it opens;
    return how many rows kept their page, how many of the updates were HOT, and the
    horizon's holders after the drain."""
    with connection.cursor() as cursor:
        cursor.execute(f'TRUNCATE "{TABLE}"')
    _wait_for_the_horizon()
    with during():
        _stage_backlog(dedup)
        staged_on, (updated_before, hot_before) = _pages(), _updates()
        assert len(drain()) == EVENTS
        held_by = _horizon_holders()
    updated, hot = _updates()
    assert updated - updated_before == 2 * EVENTS  # the claim's version, the finalize's
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {OutboxStatus.PUBLISHED}
    return _kept(staged_on), hot - hot_before, held_by


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup-keys"])
def test_relaying_writes_two_row_versions_per_event_on_the_page_it_was_staged_on(dedup):
    """With dedup keys too: ``outbox_dedup_unfinished_idx`` names no column the claim
    writes, so the claim stays HOT. Other tests run on the same server at once; a
    measurement one of their transactions spoiled is made again (see ATTEMPTS)."""
    if connection.pg_version < 150000:
        pytest.skip("pg_stat_force_next_flush() is PostgreSQL 15+")
    attempts = []
    while len(attempts) < ATTEMPTS:
        kept, hot, held_by = _measure(dedup)
        attempts.append(f"{kept} of {EVENTS} rows kept their page ({hot} HOT; held by {held_by})")
        # The claim grows a row by its lease (locked_by, lease_token, locked_until), so a
        # few rows of a page staged to half may not fit; with no fillfactor (pages staged
        # full) none does, and every version goes to a new page at the table's end.
        if kept >= 0.8 * EVENTS:
            break
    assert kept >= 0.8 * EVENTS, "; ".join(attempts)
    # The claim writes no column an index names, so each claim that found room on its
    # row's page wrote no index entry (HOT); the finalize sets published_at, which the
    # partial indexes name, so it never is.
    assert 0.8 * EVENTS <= hot <= EVENTS, f"{hot} HOT updates"


@contextmanager
def _a_write_open_in_the_other_database() -> Iterator[None]:
    with psycopg.connect(**connections["other"].get_connection_params()) as other:
        other.execute("SELECT txid_current()")  # gives the open transaction an xid
        yield


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
def test_a_transaction_open_in_another_database_sends_every_finalize_to_another_page():
    """Why the test above measures again, and what docs/relay.md warns of: a transaction
    that has written, open in another database of the server during the drain, keeps
    every staged version from being pruned, so each finalize finds its row's page full.
    The claims are still HOT: the page staged to half has room for them."""
    if connection.pg_version < 150000:
        pytest.skip("pg_stat_force_next_flush() is PostgreSQL 15+")
    kept, hot, held_by = _measure(during=_a_write_open_in_the_other_database)
    assert kept <= 0.1 * EVENTS, f"{kept} of {EVENTS} rows kept their page"
    assert hot >= 0.8 * EVENTS, f"{hot} HOT updates"
    other_name = connections["other"].settings_dict["NAME"]
    assert any(row[1] == other_name for row in held_by), held_by
