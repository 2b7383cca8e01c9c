"""Blocked keys on real PostgreSQL: an ABANDONED head holds back its ordered key; the
operator sees it (``outbox_status``, ``status.blocked_keys``) and releases it with
"requeue head" or "skip head" (``store.requeue_heads``, ``store.skip``, ``outbox_skip``);
retention never deletes it. Ordered rows are made directly with the ORM (``sequence``
set), as staging on an ordered route writes them."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import threading
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, connections, transaction
from django.utils import timezone

from django_outbox import stage
from django_outbox.exceptions import RequeueRefused, SkipRefused
from django_outbox.models import OutboxMessage
from django_outbox.ops.reporting import run_result
from django_outbox.relay import RunStats, retention
from django_outbox.state import store
from django_outbox.state.status import blocked_keys
from django_outbox.testing import drain
from tests.integration import test_sqlite_claim as sqlite_script
from tests.support import (
    as_on_the_table,
    consume,
    delete_queue,
    manage,
    row_retention,
    run_relay,
    unique_destination,
    wait_until,
)

pytestmark = pytest.mark.django_db

Status = OutboxMessage.Status
POISON = "struct.error: 'q' format requires -2**63 <= number <= 2**63-1"


def key_rows(key: str, *statuses: str, destination: str = "orders") -> list[OutboxMessage]:
    """Rows 1, 2, 3, ... of ``key`` in these states; an ABANDONED or FAILED one has an
    error, and an ABANDONED one was abandoned three hours ago."""
    hours_ago = timezone.now() - dt.timedelta(hours=3)
    return [
        OutboxMessage.objects.create(
            event_type="order.changed",
            destination=destination,
            payload={"key": key, "n": n},
            ordering_key=key,
            sequence=n,
            status=status,
            last_error=POISON if status in (Status.ABANDONED, Status.FAILED) else "",
            abandoned_at=hours_ago if status == Status.ABANDONED else None,
            published_at=timezone.now() if status == Status.PUBLISHED else None,
        )
        for n, status in enumerate(statuses, start=1)
    ]


@pytest.fixture
def keys() -> dict[str, list[OutboxMessage]]:
    """``poisoned``: 1 published, 2 abandoned (the head), 3 and 4 waiting. ``flowing``:
    nothing wrong. ``failing``: its head is FAILED (retried, not blocked) and an
    abandoned row waits behind it (not the head: not blocked yet). ``unordered``: an
    abandoned row without a sequence."""
    return {
        "poisoned": key_rows("order-1", Status.PUBLISHED, Status.ABANDONED, *[Status.PENDING] * 2),
        "flowing": key_rows("order-2", Status.PUBLISHED, Status.PENDING),
        "failing": key_rows("order-3", Status.FAILED, Status.ABANDONED),
        "unordered": [
            OutboxMessage.objects.create(
                event_type="order.changed",
                destination="orders",
                payload={},
                ordering_key="order-4",
                status=Status.ABANDONED,
                abandoned_at=timezone.now(),
            )
        ],
    }


def test_heads_are_the_lowest_unpublished_row_of_each_ordered_key(keys):
    heads = set(store.heads(OutboxMessage.objects.all()).values_list("id", flat=True))
    assert heads == {keys["poisoned"][1].pk, keys["flowing"][1].pk, keys["failing"][0].pk}


def test_a_poisoned_head_blocks_only_its_key_and_is_listed_with_error_age_and_waiting(keys):
    blocked = blocked_keys("default")
    head = keys["poisoned"][1]
    assert blocked.count.value == 1
    [key] = blocked.keys
    assert (key.destination, key.ordering_key, key.head_id, key.event_id, key.sequence) == (
        "orders",
        "order-1",
        head.pk,
        head.event_id,
        2,
    )
    assert key.error == POISON
    assert key.waiting == 2
    assert key.blocked_for is not None
    assert dt.timedelta(minutes=179) < key.blocked_for < dt.timedelta(minutes=181)


def test_the_same_key_of_another_destination_is_another_scope(keys):
    key_rows("order-1", Status.PENDING, destination="invoices")
    assert [k.destination for k in blocked_keys("default").keys] == ["orders"]


def test_blocked_keys_are_listed_longest_blocked_first_up_to_top():
    for n in range(3):
        [row] = key_rows(f"k{n}", Status.ABANDONED)
        OutboxMessage.objects.filter(pk=row.pk).update(
            abandoned_at=timezone.now() - dt.timedelta(hours=n)
        )
    blocked = blocked_keys("default", top=2)
    assert blocked.count.value == 3
    assert [k.ordering_key for k in blocked.keys] == ["k2", "k1"]


def test_outbox_status_prints_blocked_keys_and_the_commands_that_release_them(keys):
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    text = out.getvalue()
    head = keys["poisoned"][1]
    assert "Blocked keys (their head is abandoned; nothing behind it is published): 1" in text
    assert (
        f"  orders 'order-1': head {head.pk} (event {head.event_id}, sequence 2), "
        f"blocked 3.0 h, 2 waiting: {POISON}"
    ) in text
    assert f"publish the heads again: manage.py outbox_requeue --id {head.pk}\n" in text
    assert f"(consumers get skip markers): manage.py outbox_skip --id {head.pk}\n" in text


def test_outbox_status_says_a_head_abandoned_in_the_admin_has_no_error():
    """The admin's *Abandon* of a pending head leaves last_error empty: both sections say so."""
    [head, _] = key_rows("order-1", Status.ABANDONED, Status.PENDING)
    OutboxMessage.objects.filter(pk=head.pk).update(last_error="")
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    lines = out.getvalue().splitlines()
    assert "        1  abandoned  no error recorded" in lines
    assert any(line.endswith("1 waiting: no error recorded") for line in lines)


def test_outbox_status_has_no_blocked_section_when_no_key_is_blocked():
    key_rows("order-1", Status.FAILED, Status.PENDING)
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    assert "Blocked keys" not in out.getvalue()


def test_skip_makes_the_head_a_pending_skip_marker_and_unblocks_the_key(keys, caplog):
    head = keys["poisoned"][1]
    OutboxMessage.objects.filter(pk=head.pk).update(attempts=7, locked_by="host:1")
    with caplog.at_level(logging.WARNING, logger="django_outbox.store"):
        assert store.skip("default", [head.pk]) == 1
    row = OutboxMessage.objects.get(pk=head.pk)
    assert row.skipped_at is not None
    assert (row.status, row.attempts, row.abandoned_at, row.locked_by, row.lease_token) == (
        Status.PENDING,
        0,
        None,
        "",
        None,
    )
    assert row.available_at <= timezone.now()
    assert blocked_keys("default").count.value == 0
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "outbox.skipped"]
    assert record.levelno == logging.WARNING
    assert (record.id, record.event_id, record.ordering_key, record.sequence) == (
        head.pk,
        str(head.event_id),
        "order-1",
        2,
    )
    # Nothing else moved.
    assert [r.status for r in OutboxMessage.objects.filter(ordering_key="order-1")] == [
        Status.PUBLISHED,
        Status.PENDING,
        Status.PENDING,
        Status.PENDING,
    ]


def test_skip_takes_event_ids_and_a_failed_head(keys):
    failing = keys["failing"][0]
    assert store.skip("default", [failing.event_id]) == 1
    assert OutboxMessage.objects.get(pk=failing.pk).skipped_at is not None


def test_skip_refuses_every_row_that_is_not_a_blocked_head_and_changes_nothing(keys):
    missing = uuid.uuid4()
    named = [
        keys["poisoned"][1].pk,  # fine, but the rest refuses the whole skip
        keys["poisoned"][2].pk,  # pending, behind the head
        keys["failing"][1].pk,  # abandoned, but not the head
        keys["flowing"][0].pk,  # published
        keys["unordered"][0].pk,  # no sequence
        missing,
        987654321,
    ]
    with pytest.raises(SkipRefused) as refused:
        store.skip("default", named)
    assert str(refused.value) == (
        "refused: only the failed or abandoned head of an ordered key can be skipped; not "
        f"{keys['poisoned'][2].pk} (pending, not failed or abandoned), "
        f"{keys['failing'][1].pk} (not its key's head: an earlier event is unpublished), "
        f"{keys['flowing'][0].pk} (published, not failed or abandoned), "
        f"{keys['unordered'][0].pk} (not ordered: its route has no sequence), "
        f"{missing} (not found), 987654321 (not found); nothing skipped"
    )
    assert isinstance(refused.value, RequeueRefused)
    assert not OutboxMessage.objects.filter(skipped_at__isnull=False).exists()
    assert OutboxMessage.objects.get(pk=keys["poisoned"][1].pk).status == Status.ABANDONED


def test_skip_refuses_a_head_under_a_live_lease(keys):
    head = keys["flowing"][1]
    OutboxMessage.objects.filter(pk=head.pk).update(
        status=Status.PROCESSING, locked_until=timezone.now() + dt.timedelta(minutes=5)
    )
    with pytest.raises(SkipRefused, match=rf"{head.pk} \(processing, not failed or abandoned\)"):
        store.skip("default", [head.pk])


def test_requeue_heads_requeues_only_heads(keys):
    head = keys["poisoned"][1]
    with pytest.raises(SkipRefused, match=r"can be requeued; not .* nothing requeued"):
        store.requeue_heads("default", [head.pk, keys["failing"][1].pk])
    assert OutboxMessage.objects.get(pk=head.pk).status == Status.ABANDONED
    assert store.requeue_heads("default", [head.pk]) == 1
    row = OutboxMessage.objects.get(pk=head.pk)
    assert (row.status, row.attempts, row.last_error, row.skipped_at) == (
        Status.PENDING,
        0,
        "",
        None,
    )
    assert blocked_keys("default").count.value == 0


def test_outbox_skip_command_skips_and_reports(keys):
    out = io.StringIO()
    call_command("outbox_skip", "--id", str(keys["poisoned"][1].event_id), stdout=out)
    assert out.getvalue() == ("skipped 1 row: the relay publishes a skip marker in place of each\n")


def test_outbox_skip_command_exits_1_naming_the_refused_rows(keys):
    pending = keys["flowing"][1].pk
    with pytest.raises(CommandError, match=rf"not {pending} \(pending, not failed or abandoned\)"):
        call_command("outbox_skip", "--id", str(pending), str(keys["poisoned"][1].pk))
    assert not OutboxMessage.objects.filter(skipped_at__isnull=False).exists()


def test_outbox_skip_command_needs_an_id():
    with pytest.raises(CommandError, match="--id"):
        call_command("outbox_skip")


@row_retention
def test_retention_never_deletes_an_abandoned_ordered_row(keys):
    """Neither the blocked head nor an abandoned row behind a head: each would leave a
    gap no consumer hears of. Only the unordered row goes."""
    OutboxMessage.objects.filter(status=Status.ABANDONED).update(
        abandoned_at=timezone.now() - dt.timedelta(days=3650)
    )
    counts = retention.cleanup("default")
    assert counts["abandoned"] == 1  # the unordered one
    kept = set(OutboxMessage.objects.abandoned().values_list("id", flat=True))
    assert kept == {keys["poisoned"][1].pk, keys["failing"][1].pk}
    assert blocked_keys("default").count.value == 1


def _waiting_for_a_lock() -> int:
    """Backends of this database waiting for a lock. Activity is read once per
    transaction unless the snapshot is cleared, and the caller polls inside one."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND datname = current_database()"
        )
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_skip_waits_for_a_claim_holding_the_head_and_then_refuses_it():
    """A relay claims a FAILED head (its row locked, made PROCESSING) while the operator
    skips it: the skip waits for the claim's transaction, reads the row again and refuses
    it, so the event is never both published and skipped."""
    [head] = key_rows("order-1", Status.FAILED)
    claimed = threading.Event()
    refused: list[BaseException] = []

    def operator() -> None:
        try:
            claimed.wait(30)
            store.skip("default", [head.pk])
        except SkipRefused as exc:
            refused.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=operator)
    thread.start()
    with transaction.atomic():
        OutboxMessage.objects.select_for_update().get(pk=head.pk)
        claimed.set()
        wait_until(_waiting_for_a_lock, timeout=30, what="the skip to wait for the row lock")
        OutboxMessage.objects.filter(pk=head.pk).update(
            status=Status.PROCESSING, locked_until=timezone.now() + dt.timedelta(minutes=5)
        )
    thread.join(30)
    assert not thread.is_alive()
    [exc] = refused
    assert f"{head.pk} (processing, not failed or abandoned)" in str(exc)
    row = OutboxMessage.objects.get(pk=head.pk)
    assert (row.status, row.skipped_at) == (Status.PROCESSING, None)


def _explain(queryset) -> str:
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN {sql}", params)
        return as_on_the_table("\n".join(row[0] for row in cursor.fetchall()))


@pytest.mark.django_db(transaction=True)
def test_blocked_keys_read_the_partial_indexes_on_a_large_table():
    """About 200,000 published ordered rows over 2,000 keys, a pending tail and three
    blocked keys with one event behind each: the listing and the count read the
    abandoned rows through their partial index and probe each key through
    outbox_key_unfinished_idx; no sequential scan."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            INSERT INTO django_outbox_outboxmessage (event_id, event_type, destination,
                payload, headers, ordering_key, sequence, status, attempts, locked_by,
                last_error, published_at, abandoned_at)
            SELECT gen_random_uuid(), 'e', 'orders', '{}', '{}', 'k' || (n % 2000),
                n / 2000 + 1,
                CASE WHEN n BETWEEN 200000 AND 200002 THEN 'abandoned'
                     WHEN n >= 199000 THEN 'pending' ELSE 'published' END,
                0, '', CASE WHEN n >= 199000 THEN 'poison' ELSE '' END,
                CASE WHEN n < 199000 THEN now() END,
                CASE WHEN n BETWEEN 200000 AND 200002 THEN now() END
            FROM generate_series(0, 203999) AS n
            """
        )
        cursor.execute("ANALYZE django_outbox_outboxmessage")
    blocked = blocked_keys("default")
    assert blocked.count.value == 3
    assert [key.waiting for key in blocked.keys] == [1, 1, 1]
    heads = store.heads(OutboxMessage.objects.abandoned())
    for plan in (_explain(heads), _explain(heads.order_by("abandoned_at")[:20])):
        assert "Seq Scan" not in plan, plan
        assert "outbox_key_unfinished_idx" in plan, plan


# ---------------------------------------------------------------- through the relay


def test_the_relay_holds_back_only_the_blocked_key():
    """drain() relays every due row: the blocked key's events behind its head stay
    pending, the other key's are published in sequence order."""
    poisoned = key_rows("order-1", Status.PUBLISHED, Status.ABANDONED, Status.PENDING)
    flowing = key_rows("order-2", Status.PENDING, Status.PENDING)
    events = drain()
    assert [(e.ordering_key, e.sequence) for e in events] == [("order-2", 1), ("order-2", 2)]
    statuses = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert [statuses[row.pk] for row in poisoned] == [
        Status.PUBLISHED,
        Status.ABANDONED,
        Status.PENDING,
    ]
    assert {statuses[row.pk] for row in flowing} == {Status.PUBLISHED}


def test_a_skipped_head_is_published_as_a_marker_and_its_key_flows_in_order():
    rows = key_rows("order-1", Status.PUBLISHED, Status.ABANDONED, Status.PENDING, Status.PENDING)
    head = rows[1]
    assert drain() == []
    store.skip("default", [head.pk])
    events = drain()
    assert [(e.event_id, e.sequence, e.skipped) for e in events] == [
        (head.event_id, 2, True),
        (rows[2].event_id, 3, False),
        (rows[3].event_id, 4, False),
    ]
    marker = events[0]
    assert marker.payload is None
    assert (marker.headers["skipped"], marker.headers["sequence"]) == (True, 2)
    assert (marker.destination_header, marker.ordering_key) == ("orders", "order-1")
    assert events[1].payload == {"key": "order-1", "n": 3}
    row = OutboxMessage.objects.get(pk=head.pk)
    assert (row.status, row.skipped_at is not None, row.last_error) == (
        Status.PUBLISHED,
        True,
        "",
    )
    assert blocked_keys("default").count.value == 0


def test_a_requeued_head_is_published_with_its_payload_then_its_key():
    rows = key_rows("order-1", Status.ABANDONED, Status.PENDING)
    store.requeue_heads("default", [rows[0].pk])
    events = drain()
    assert [(e.sequence, e.skipped, e.payload) for e in events] == [
        (1, False, {"key": "order-1", "n": 1}),
        (2, False, {"key": "order-1", "n": 2}),
    ]


def _stage_ordered(destination: str, key: str, n: int) -> OutboxMessage:
    with transaction.atomic():
        return stage("order.changed", {"key": key, "n": n}, destination=destination, key=key)


@pytest.mark.slow  # relays and a consumer as processes, through RabbitMQ
@pytest.mark.django_db(transaction=True)
def test_an_operator_releases_a_blocked_key_through_rabbitmq(settings):
    """Real processes and the real broker, events staged on an ordered route: event 2 of
    a key is abandoned (as the admin's Abandon does), so a relay drain publishes the
    other key but nothing more of this one; outbox_status names the head, outbox_skip
    skips it, and the next drain puts the marker (body null, headers skipped and
    sequence) and then the key's next event on the queue, in that order."""
    destination = unique_destination("blocked")
    routes = {"ROUTES": {destination: {"ordered": True, "queue": destination}}}
    settings.OUTBOX = {**settings.OUTBOX, **routes}
    try:
        first = _stage_ordered(destination, "order-1", 1)
        run_relay("--drain", **routes)
        head = _stage_ordered(destination, "order-1", 2)
        store.abandon("default", OutboxMessage.objects.filter(pk=head.pk))
        after = _stage_ordered(destination, "order-1", 3)
        other = _stage_ordered(destination, "order-2", 1)
        run_relay("--drain", **routes)
        assert [m.headers["event_id"] for m in consume(destination, 2)] == [
            str(first.event_id),
            str(other.event_id),
        ]
        status = manage("outbox_status", **routes)
        assert f"head {head.pk} (event {head.event_id}, sequence 2)" in status.stdout
        assert "1 waiting" in status.stdout

        skipped = manage("outbox_skip", "--id", str(head.event_id), **routes)
        assert skipped.returncode == 0, skipped.stderr
        run_relay("--drain", **routes)
        marker, next_event = consume(destination, 2)
    finally:
        delete_queue(destination)
    assert (marker.headers["event_id"], marker.headers["sequence"]) == (str(head.event_id), 2)
    assert (marker.headers["skipped"], marker.headers["destination"]) == (True, destination)
    assert json.loads(marker.body) is None
    assert next_event.headers["event_id"] == str(after.event_id)
    assert (next_event.headers["sequence"], "skipped" in next_event.headers) == (3, False)
    assert json.loads(next_event.body) == {"key": "order-1", "n": 3}
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {Status.PUBLISHED}


def test_skip_on_sqlite_waits_for_another_writer_instead_of_failing(tmp_path):
    """The example project's SQLite database: ten blocked heads (each its key's only row)
    are skipped while another connection holds the write lock; the skip waits for it."""
    heads = (
        "for i in range(11, 21):\n"
        "    OutboxMessage.objects.filter(id=i).update(\n"
        '        status="abandoned", abandoned_at=Now(), ordering_key=f"k{i}", sequence=1)\n'
    )
    script = sqlite_script.SCRIPT.replace(
        "# for the requeue\n"
        'OutboxMessage.objects.filter(id__gt=10).update(status="abandoned", abandoned_at=Now())\n',
        heads,
    )
    assert heads in script
    skip = 'store.skip("default", range(11, 21))'
    assert sqlite_script.run_script(tmp_path, script.replace("OPERATION", skip)) == ["10"]


def test_a_drain_says_when_ordered_keys_stay_blocked():
    """A drain that publishes everything it can exits 0, and says that a key is blocked."""
    key_rows("order-1", Status.ABANDONED, Status.PENDING)
    result = run_result(RunStats(), 0.1, "default", drain=True)
    assert result.error == ""
    assert result.lines[-1] == (
        "1 ordered key is blocked: a head is abandoned and nothing behind it is published "
        "until it is requeued or skipped (outbox_status lists them)"
    )
