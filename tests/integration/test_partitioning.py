"""A partitioned outbox on real PostgreSQL 15 (django_outbox.db.partitions): the
conversion keeps rows in every state, staging and the relay go on across ranges,
retention drops a range only when every row in it is past retention, and the
partitioned table keeps the guarantees its unique indexes gave (dedup keys).

Each test converts the outbox of the "other" database and puts a plain one back
afterwards (its tables dropped and migrated again), so no other test sees it."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import psycopg
import pytest
from django.apps import apps
from django.core.management import CommandError, call_command
from django.db import connections, transaction
from django.test import override_settings
from django.utils import timezone

from django_outbox import stage
from django_outbox.db import partitions, queries
from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.models import OutboxMessage, OutboxSequence, OutboxStatus
from django_outbox.relay import retention
from django_outbox.testing import drain
from tests.factories import OutboxMessageFactory
from tests.support import (
    consume,
    delete_queue,
    running,
    stage_events,
    start_relay,
    unique_destination,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])

DB = "other"
TABLE = OutboxMessage._meta.db_table
LONG_AGO = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)


def _plain_again(alias: str) -> None:
    """Drop the app's tables on ``alias`` and migrate them again: a plain outbox."""
    connection = connections[alias]
    with connection.cursor() as cursor:
        for model in apps.get_app_config("django_outbox").get_models():
            cursor.execute(
                f"DROP TABLE IF EXISTS {queries.quote_identifier(model._meta.db_table)} CASCADE"
            )
    call_command("migrate", "django_outbox", "zero", fake=True, database=alias, verbosity=0)
    call_command("migrate", "django_outbox", database=alias, verbosity=0)


@pytest.fixture
def restore() -> Iterator[None]:
    """The test may partition the "other" database's outbox; it is plain again after."""
    already = partitions.is_partitioned(connections[DB])
    yield
    if not already and partitions.is_partitioned(connections[DB]):
        _plain_again(DB)


def _sizes(rows: int, ahead: int = 2):
    return override_settings(OUTBOX={**_outbox(), "PARTITIONING": {"rows": rows, "ahead": ahead}})


def _outbox() -> dict:
    from django.conf import settings

    return dict(settings.OUTBOX)


def _stage(count: int, **kwargs) -> list[OutboxMessage]:
    with transaction.atomic(using=DB):
        return [
            stage("order.placed", {"n": n}, destination="orders", using=DB, **kwargs)
            for n in range(count)
        ]


class _OtherOutbox(OutboxMessageFactory):
    """Rows as the relay would find them (the project's factory), in the "other" database."""

    class Meta:
        database = DB


def _row_in_every_state() -> list[int]:
    """One row in each state a table holds, an ordered row and a dedup-keyed one too."""
    Status = OutboxStatus
    made = [
        _OtherOutbox(),
        _OtherOutbox(
            status=Status.PROCESSING,
            locked_until=timezone.now() + dt.timedelta(minutes=5),
            locked_by="relay-1",
        ),
        _OtherOutbox(status=Status.PUBLISHED),
        _OtherOutbox(status=Status.FAILED, attempts=3),
        _OtherOutbox(status=Status.ABANDONED, sequence=1, ordering_key="k1"),
        _OtherOutbox(dedup_key="remind-1"),
    ]
    return [row.pk for row in made]


def _table_rows() -> list[dict]:
    return list(OutboxMessage.objects.using(DB).order_by("id").values())


def _partition_of(pk: int) -> str:
    with connections[DB].cursor() as cursor:
        cursor.execute(f'SELECT tableoid::regclass::text FROM "{TABLE}" WHERE id = %s', [pk])
        return cursor.fetchone()[0]


def _publish_long_ago(ids) -> None:
    OutboxMessage.objects.using(DB).filter(id__in=list(ids)).update(
        status=OutboxStatus.PUBLISHED, published_at=LONG_AGO, lease_token=None
    )


def test_the_conversion_keeps_every_row_as_it_was_and_staging_goes_on_above_it(restore):
    ids = _row_in_every_state()
    before = _table_rows()
    with _sizes(rows=50):
        call_command("outbox_partition", database=DB, verbosity=0)
    assert partitions.is_partitioned(connections[DB])
    assert _table_rows() == before
    names = [p.name for p in partitions.partitions(connections[DB])]
    assert names[0] == f"{TABLE}_p0" and names[-1] == f"{TABLE}_default"
    assert {_partition_of(pk) for pk in ids} == {f"{TABLE}_p0"}
    # Ids go on from the table's sequence into the ranges made ahead, which take the
    # first partition's fillfactor; the NOTIFY trigger and the defaults came along.
    staged = _stage(60)
    assert min(row.pk for row in staged) > max(ids)
    assert f"{TABLE}_p0" not in {_partition_of(row.pk) for row in staged}
    assert all(row.created_at and row.available_at for row in staged)
    assert set(_fillfactors().values()) == {"50"}
    drain(DB)
    done = OutboxMessage.objects.using(DB).filter(id__in=[row.pk for row in staged])
    assert done.published().count() == 60


def _fillfactors() -> dict[str, str]:
    """Each partition's fillfactor (None: the default, 100)."""
    with connections[DB].cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, o.option_value FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "LEFT JOIN pg_options_to_table(c.reloptions) o ON o.option_name = 'fillfactor' "
            "WHERE i.inhparent = %s::regclass",
            [f'"{TABLE}"'],
        )
        return dict(cursor.fetchall())


def _ranges() -> list[partitions.Partition]:
    return [p for p in partitions.partitions(connections[DB]) if not p.default]


def _partitioned(rows: int, ahead: int = 2) -> list[partitions.Partition]:
    """Partition the (empty) outbox; the ranges made ahead. The first range, empty and
    closed, is dropped by the first cleanup."""
    with _sizes(rows, ahead):
        call_command("outbox_partition", database=DB, verbosity=0)
        assert _cleanup()["partitions"] == 1
    return _ranges()


def _cleanup() -> dict[str, int]:
    return retention.cleanup(DB)


def test_retention_drops_a_closed_range_only_once_every_row_in_it_is_past_retention(restore):
    with _sizes(rows=20):
        first = _partitioned(20)[0]
        staged = _stage(20)  # fills the first range made ahead: its ids are all drawn
        assert {_partition_of(row.pk) for row in staged} == {first.name}
        _publish_long_ago(row.pk for row in staged[:-1])
        assert _cleanup()["partitions"] == 0  # one row is still PENDING
        assert first in _ranges()
        # Published a minute ago: kept for PUBLISHED_RETENTION (7 days) after that.
        OutboxMessage.objects.using(DB).filter(pk=staged[-1].pk).update(
            status=OutboxStatus.PUBLISHED, published_at=timezone.now()
        )
        expiry = partitions.expiry(
            connections[DB], first, dt.timedelta(days=7), dt.timedelta(days=30)
        )
        assert not expiry.blocked and expiry.expires_at > expiry.now + dt.timedelta(days=6)
        assert _cleanup()["partitions"] == 0
        _publish_long_ago([staged[-1].pk])
        counts = _cleanup()
    assert counts["partitions"] == 1 and counts["published"] == 0  # dropped whole, not deleted
    assert first not in _ranges()
    assert not OutboxMessage.objects.using(DB).filter(pk__in=[r.pk for r in staged]).exists()
    drawn = partitions.next_id(connections[DB])
    assert sum(p.lower is not None and p.lower >= drawn for p in _ranges()) == 2  # made ahead


def test_an_abandoned_ordered_row_keeps_its_range_however_old(restore):
    with _sizes(rows=5):
        first = _partitioned(5)[0]
        staged = _stage(5)
        _publish_long_ago(row.pk for row in staged[1:])
        OutboxMessage.objects.using(DB).filter(pk=staged[0].pk).update(
            status=OutboxStatus.ABANDONED, abandoned_at=LONG_AGO, sequence=1, ordering_key="k"
        )
        assert _cleanup()["partitions"] == 0
    assert first in _ranges()
    assert partitions.expiry(connections[DB], first, dt.timedelta(0), dt.timedelta(0)).blocked


def _other_session() -> psycopg.Connection:
    params = connections[DB].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params)


def _abandoned_long_ago_range() -> tuple[partitions.Partition, list[OutboxMessage]]:
    first = _partitioned(5)[0]
    staged = _stage(5)
    OutboxMessage.objects.using(DB).filter(pk__in=[r.pk for r in staged]).update(
        status=OutboxStatus.ABANDONED, abandoned_at=LONG_AGO
    )
    return first, staged


RETAINED = (dt.timedelta(days=7), dt.timedelta(days=30))
REQUEUE = f'UPDATE "{TABLE}" SET status = %s, abandoned_at = NULL WHERE id = %s'


def test_a_drop_that_waits_past_its_lock_timeout_leaves_the_range_to_the_next_pass(restore):
    first, staged = _abandoned_long_ago_range()
    assert partitions.droppable(connections[DB], *RETAINED) == [first]
    with _other_session() as operator:  # an operator's requeue, not yet committed
        operator.execute(REQUEUE, [OutboxStatus.PENDING.value, staged[0].pk])
        assert partitions.drop_expired(connections[DB], *RETAINED) == []
        operator.rollback()
    assert partitions.drop_expired(connections[DB], *RETAINED) == [first]


def test_a_row_requeued_between_the_check_and_the_drop_keeps_its_range(restore, monkeypatch):
    first, staged = _abandoned_long_ago_range()
    checked = partitions.expiry

    def check_then_requeue(*args, **kwargs):
        """The first check sees every row expired; the requeue commits right after it,
        before the drop takes its lock."""
        found = checked(*args, **kwargs)
        if not operator.closed:
            operator.execute(REQUEUE, [OutboxStatus.PENDING.value, staged[0].pk])
            operator.commit()
            operator.close()
        return found

    operator = _other_session()
    monkeypatch.setattr(partitions, "expiry", check_then_requeue)
    assert partitions.drop_expired(connections[DB], *RETAINED) == []  # read again, locked
    assert first in _ranges()
    assert OutboxMessage.objects.using(DB).get(pk=staged[0].pk).status == OutboxStatus.PENDING


def test_staging_past_the_ranges_made_ahead_lands_in_the_default_partition(restore):
    with _sizes(rows=10, ahead=1):
        (ahead,) = _partitioned(10, ahead=1)
        staged = _stage(30)  # no relay made ranges meanwhile: 20 go to the default
        places = [_partition_of(row.pk) for row in staged]
        assert places.count(ahead.name) == 10 and places.count(f"{TABLE}_default") == 20
        made = partitions.ensure_ahead(connections[DB], 10, 1)
        assert [p.lower for p in made] == [staged[-1].pk + 1 + partitions.OVERFLOW_GAP]
        later = _stage(1)[0]
        assert _partition_of(later.pk) == f"{TABLE}_default"  # in the gap, still staged
        _publish_long_ago(row.pk for row in staged)
        counts = _cleanup()
    # The range went whole; the default partition's rows one by one.
    assert counts["partitions"] == 1 and counts["published"] == 20
    assert OutboxMessage.objects.using(DB).filter(pk=later.pk).exists()


def test_outbox_partition_says_what_to_set_and_changes_nothing_without_it(restore):
    with pytest.raises(CommandError, match=r'set OUTBOX\["PARTITIONING"\]'):
        call_command("outbox_partition", database=DB)
    assert not partitions.is_partitioned(connections[DB])


def test_outbox_partition_gives_up_on_a_table_a_transaction_holds(restore):
    with _other_session() as business:  # staged an event, not yet committed
        business.execute(
            f'INSERT INTO "{TABLE}" (event_id, event_type, destination, payload, headers, '
            "ordering_key, status, attempts, locked_by, last_error) VALUES "
            "(gen_random_uuid(), 'e', 'd', '{}', '{}', '', 'pending', 0, '', '')"
        )
        with _sizes(rows=100), pytest.raises(CommandError, match="held the outbox table for"):
            call_command("outbox_partition", database=DB)
        business.commit()
    assert not partitions.is_partitioned(connections[DB])
    assert OutboxMessage.objects.using(DB).count() == 1


def test_outbox_partition_on_a_partitioned_table_makes_ranges_ahead_and_describes_them(
    restore, capsys
):
    _partitioned(10, ahead=1)
    _stage(25)
    with _sizes(rows=10, ahead=1):
        call_command("outbox_partition", database=DB)
    out = capsys.readouterr().out
    assert "the outbox table is partitioned; 1 partitions made ahead" in out
    assert "closed, kept whole by rows " in out and "open (ids still to be drawn)" in out


def test_a_dedup_key_staged_by_two_transactions_at_once_is_staged_once(restore):
    _partitioned(100)
    staged_first = threading.Event()
    results: dict[str, object] = {}

    def first() -> None:
        with transaction.atomic(using=DB):
            row = stage("reminder", {"n": 1}, destination="d", dedup_key="r1", using=DB)
            results["first"] = row.staging_outcome
            staged_first.set()
            results["waited"] = _advisory_waiter(timeout=10)  # the second, on the key
        connections[DB].close()

    def second() -> None:
        staged_first.wait(10)
        with transaction.atomic(using=DB):
            row = stage("reminder", {"n": 2}, destination="d", dedup_key="r1", using=DB)
            results["second"] = row.staging_outcome
        connections[DB].close()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {"first": "staged", "waited": True, "second": "deduplicated"}
    rows = OutboxMessage.objects.using(DB).filter(dedup_key="r1")
    assert [row.payload for row in rows] == [{"n": 1}]


def test_dedup_keys_replace_on_a_partitioned_outbox_as_on_a_plain_one(restore):
    _partitioned(100)
    with transaction.atomic(using=DB):
        first = stage("reminder", {"n": 1}, destination="d", dedup_key="r1", using=DB)
    with transaction.atomic(using=DB):
        again = stage(
            "reminder", {"n": 2}, destination="d", dedup_key="r1", on_duplicate="replace", using=DB
        )
    assert (again.staging_outcome, again.pk) == ("replaced", first.pk)
    assert OutboxMessage.objects.using(DB).get(pk=first.pk).payload == {"n": 2}


def test_a_dedup_key_in_a_repeatable_read_transaction_is_refused_with_the_fix(restore):
    _partitioned(100)
    with pytest.raises(OutboxConfigurationError, match="needs READ COMMITTED"):
        with transaction.atomic(using=DB):
            connections[DB].cursor().execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            stage("reminder", {}, destination="d", dedup_key="r1", using=DB)
    assert not OutboxMessage.objects.using(DB).exists()
    assert OutboxSequence.objects.using(DB).count() == 0


def _warnings(sizes) -> list[str]:
    from django_outbox.ops.checks import check_partitioning

    settings = {**_outbox(), "PARTITIONING": sizes}
    with override_settings(OUTBOX=settings):
        return [f"{m.id}: {m.msg} {m.hint}" for m in check_partitioning(databases=[DB])]


def test_the_checks_say_when_the_setting_and_the_table_disagree(restore):
    assert _warnings(None) == []
    (warning,) = _warnings({"rows": 100})
    assert (
        warning.startswith("django_outbox.W008: ")
        and "outbox_partition --database other" in warning
    )
    _partitioned(100)
    assert _warnings({"rows": 100}) == []
    (warning,) = _warnings(None)
    assert warning.startswith("django_outbox.W009: ") and "ranges of 1,000,000 ids" in warning


def test_one_relay_at_a_time_makes_and_drops_partitions(restore):
    """Two relays' retention passes at once would make the same range twice: the one
    that finds another at it leaves partitions alone and deletes rows as usual."""
    with _sizes(rows=5, ahead=1):
        _partitioned(5, ahead=1)
        _publish_long_ago(row.pk for row in _stage(12))  # 7 past the range: the default's
        with _other_session() as relay:
            relay.execute("SELECT pg_advisory_lock(1869968500, 1)")
            before = _ranges()
            assert _cleanup()["partitions"] == 0
            assert _ranges() == before
            # Released before the session ends: its backend exits after close() returns.
            relay.execute("SELECT pg_advisory_unlock(1869968500, 1)")
        counts = _cleanup()
    assert counts["partitions"] == 1  # the full range
    assert [p.lower for p in _ranges()] == [
        partitions.next_id(connections[DB]) + partitions.OVERFLOW_GAP
    ]


@pytest.fixture
def destination() -> Iterator[str]:
    yield (name := unique_destination())
    delete_queue(name)


def _unfinished() -> int:
    return OutboxMessage.objects.using(DB).in_states("pending", "processing", "failed").count()


def test_a_table_partitioned_under_traffic_publishes_every_event_once(restore, destination):
    """A relay publishing and a producer staging all along, the table partitioned between
    them; then the relay itself makes ranges ahead and drops the published ones (each
    range 200 ids, one ahead, rows kept a second), as events keep coming."""
    sizes = {"rows": 200, "ahead": 1}
    staged = stage_events(300, destination, using=DB)
    done = threading.Event()
    failures: list[BaseException] = []

    def produce() -> None:
        try:
            while not done.is_set():
                staged.extend(stage_events(20, destination, using=DB))
                done.wait(0.05)
        except BaseException as error:  # a staging that failed: the test says which
            failures.append(error)
        finally:
            connections[DB].close()

    producer = threading.Thread(target=produce)
    relay = start_relay(
        "--database", DB, PARTITIONING=sizes, CLEANUP_INTERVAL=1, PUBLISHED_RETENTION=1
    )
    with running(relay) as ended:
        producer.start()
        try:
            wait_until(lambda: _unfinished() < len(staged) - 100, timeout=60, process=relay)
            with _sizes(**sizes):
                call_command("outbox_partition", database=DB, verbosity=0)
            made = _ranges()
            assert made[1].lower == made[0].upper  # the range ahead follows on, no gap
            # The relay makes ranges ahead and drops those it published, the first included.
            wait_until(lambda: made[1] not in _ranges(), timeout=90, process=relay, what="a drop")
        finally:
            done.set()
            producer.join(60)
        assert failures == []
        wait_until(lambda: _unfinished() == 0, timeout=120, process=relay, what="the drain")
    received = Counter(m.headers["event_id"] for m in consume(destination, len(staged)))
    assert set(received) == set(staged)
    assert max(received.values()) == 1
    assert "retention made partition" in ended.err and "retention dropped partition" in ended.err


def test_row_by_row_retention_reads_the_default_partition_alone(restore):
    """The ranges are dropped whole: the deletes' selection must not read their rows
    (PostgreSQL prunes every range from the plan)."""
    ranges = _partitioned(50)
    plans = {kind: retention.expired(DB)[kind].explain() for kind in ("published", "abandoned")}
    for plan in plans.values():
        assert f"{TABLE}_default" in plan
        assert not any(p.name in plan for p in ranges)


def _claim(window) -> list[int]:
    from django_outbox.state import store

    batch = store.claim(
        DB, limit=100, lease_seconds=60, worker="t", token=uuid.uuid4(), window=window
    )
    return [message.id for message in batch]


def test_a_claim_plans_and_reads_only_the_ranges_that_may_hold_a_row_to_claim(restore):
    """Ranges whose rows are all finished drop out of the claim's plan (PostgreSQL plans
    every partition a claim may read, a millisecond or so each); a row requeued in one
    comes back into the window when the relay reads it again."""
    from django_outbox.db import postgresql
    from django_outbox.state import store

    finished = _partitioned(10, ahead=1)
    for _ in range(3):  # three ranges filled and published, one row still pending
        _publish_long_ago(row.pk for row in _stage(10))
        partitions.ensure_ahead(connections[DB], 10, 1)
    pending = _stage(1)[0]
    window = store.claim_window(DB)
    assert window == (_range_of(pending).lower, _ranges()[-1].upper)
    with connections[DB].cursor() as cursor:
        params = [100] * 4 + [1 << 20, 60, "t", uuid.uuid4()]
        cursor.execute("EXPLAIN " + postgresql._claim_sql(True, False, False, window), params)
        plan = "\n".join(line for (line,) in cursor.fetchall())
    assert _range_of(pending).name in plan
    assert not any(p.name in plan for p in finished) and f"{TABLE}_default" not in plan
    # An operator requeues a published row of a finished range: outside the window
    # read before, inside the one read after.
    requeued = OutboxMessage.objects.using(DB).filter(pk__lt=window[0]).earliest("pk")
    OutboxMessage.objects.using(DB).filter(pk=requeued.pk).update(
        status=OutboxStatus.PENDING, published_at=None
    )
    assert _claim(window) == [pending.pk]
    assert _claim(store.claim_window(DB)) == [requeued.pk]


def _range_of(row: OutboxMessage) -> partitions.Partition:
    return next(p for p in _ranges() if p.lower <= row.pk < p.upper)


def test_a_deduplicated_staging_locks_the_row_it_meets_until_it_commits(restore):
    """As INSERT ... ON CONFLICT does: a relay cannot finish that row before the staging
    reads it back (it would find no row to return)."""
    _partitioned(100)
    with transaction.atomic(using=DB):
        first = stage("reminder", {"n": 1}, destination="d", dedup_key="r1", using=DB)
    finalize = f'UPDATE "{TABLE}" SET status = %s, published_at = now() WHERE id = %s'
    with transaction.atomic(using=DB):
        again = stage("reminder", {"n": 2}, destination="d", dedup_key="r1", using=DB)
        assert (again.staging_outcome, again.pk) == ("deduplicated", first.pk)
        with _other_session() as relay:
            relay.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                relay.execute(finalize, [OutboxStatus.PUBLISHED.value, first.pk])


def _advisory_waiter(timeout: float) -> bool:
    """Whether a session waits for an advisory lock, asked until ``timeout``."""
    with _other_session() as observer:
        observer.autocommit = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            if observer.execute(waiting).fetchone()[0]:
                return True
            time.sleep(0.05)
    return False


def test_a_requeue_waits_for_a_staging_of_the_same_dedup_key_and_leaves_its_row(restore):
    """The requeue of an ABANDONED row whose dedup key a transaction is staging meanwhile
    would make two unfinished events of one key: it waits for that transaction, then
    sees its row and leaves the ABANDONED one."""
    from django_outbox.state import store

    _partitioned(100)
    old = _OtherOutbox(destination="d", dedup_key="r1", status=OutboxStatus.ABANDONED)
    staged, waited = threading.Event(), []

    def stager() -> None:
        with transaction.atomic(using=DB):
            stage("reminder", {}, destination="d", dedup_key="r1", using=DB)
            staged.set()
            waited.append(_advisory_waiter(timeout=10))  # the requeue, waiting on the key
        connections[DB].close()

    thread = threading.Thread(target=stager)
    thread.start()
    assert staged.wait(30)
    assert store.requeue(DB, OutboxMessage.objects.using(DB).filter(pk=old.pk)) == 0
    thread.join(30)
    assert waited == [True]
    unfinished = (
        OutboxMessage.objects.using(DB)
        .filter(dedup_key="r1")
        .in_states("pending", "processing", "failed")
    )
    assert unfinished.count() == 1


def test_with_no_range_left_the_next_starts_past_the_ids_in_flight(restore):
    (ahead,) = _partitioned(5, ahead=1)
    _publish_long_ago(row.pk for row in _stage(5))
    assert partitions.drop_expired(connections[DB], *RETAINED) == [ahead]
    assert _ranges() == []
    drawn = partitions.next_id(connections[DB])
    (made,) = partitions.ensure_ahead(connections[DB], 5, 1)
    assert made.lower == drawn + partitions.OVERFLOW_GAP


def test_maintenance_waits_for_its_locks_past_deadlock_timeout(restore):
    """An autovacuum in the way is cancelled by PostgreSQL after deadlock_timeout: the
    maintenance waits a little longer than that before it gives up."""
    _partitioned(5)
    seen: list[str] = []

    def show() -> bool:
        with connections[DB].cursor() as cursor:
            cursor.execute(
                "SELECT current_setting('deadlock_timeout'), current_setting('lock_timeout')"
            )
            seen.append(cursor.fetchone())
        return True

    assert partitions._briefly(connections[DB], show) is True
    ((deadlock, lock),) = seen
    assert (deadlock, lock) == ("1s", "1500ms")


def test_a_pass_stops_dropping_at_the_first_range_whose_locks_do_not_come(restore, monkeypatch):
    """Staging waits behind each drop that waits for its locks: one wait a pass."""
    (first,) = _partitioned(5, ahead=1)
    _publish_long_ago(row.pk for row in _stage(5))
    partitions.ensure_ahead(connections[DB], 5, 1)
    _publish_long_ago(row.pk for row in _stage(5))
    assert len(partitions.droppable(connections[DB], *RETAINED)) == 2
    tried = []
    drop = partitions._drop
    monkeypatch.setattr(partitions, "_drop", lambda *args: tried.append(args[1]) or drop(*args))
    with _other_session() as business:  # a transaction that staged and stays open
        business.execute(f'LOCK TABLE "{TABLE}" IN ROW EXCLUSIVE MODE')
        assert partitions.drop_expired(connections[DB], *RETAINED) == []
    assert tried == [first]


def test_the_conversion_runs_past_the_sites_statement_timeout(restore):
    with connections[DB].cursor() as cursor:
        cursor.execute(
            f'INSERT INTO "{TABLE}" (event_id, event_type, destination, payload, headers, '
            "ordering_key, status, attempts, locked_by, last_error) "
            "SELECT gen_random_uuid(), 'e', 'd', '{}', '{}', '', 'pending', 0, '', '' "
            "FROM generate_series(1, 50000)"
        )
        cursor.execute("SET statement_timeout = '20ms'")
    try:
        partitions.convert(connections[DB], 100, 1)
    finally:
        with connections[DB].cursor() as cursor:
            cursor.execute("RESET statement_timeout")
    assert OutboxMessage.objects.using(DB).count() == 50_000


def test_the_conversion_keeps_the_tables_grants_and_refuses_a_publication(restore):
    with connections[DB].cursor() as cursor:
        cursor.execute(
            "DO $$ BEGIN CREATE ROLE outbox_test_app; "
            "EXCEPTION WHEN duplicate_object THEN NULL; END $$"
        )
        cursor.execute(f'GRANT SELECT, INSERT, UPDATE ON "{TABLE}" TO outbox_test_app')
        cursor.execute(f'CREATE PUBLICATION outbox_test_feed FOR TABLE "{TABLE}"')
    try:
        with _sizes(rows=10), pytest.raises(CommandError, match="1 publications, 0 triggers"):
            call_command("outbox_partition", database=DB)
        assert not partitions.is_partitioned(connections[DB])
        with connections[DB].cursor() as cursor:
            cursor.execute("DROP PUBLICATION outbox_test_feed")
        _partitioned(10)
        with connections[DB].cursor() as cursor:
            cursor.execute(
                "SELECT has_table_privilege('outbox_test_app', %s, 'INSERT'), "
                "has_table_privilege('outbox_test_app', %s, 'DELETE')",
                [f'"{TABLE}"'] * 2,
            )
            assert cursor.fetchone() == (True, False)
    finally:
        with connections[DB].cursor() as cursor:
            cursor.execute("DROP PUBLICATION IF EXISTS outbox_test_feed")
            cursor.execute("DROP OWNED BY outbox_test_app")
            cursor.execute("DROP ROLE outbox_test_app")
