"""The relay against real PostgreSQL and real RabbitMQ/Redis; the tests read from the broker."""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import threading
import time
import uuid
from collections import Counter

import kombu
import pytest
from django.conf import settings
from django.db import transaction
from django.test.utils import override_settings
from django.utils import timezone

from django_outbox import db, stage
from django_outbox.conf import outbox_settings
from django_outbox.db import postgresql
from django_outbox.models import OutboxMessage
from django_outbox.relay.loop import Batch, Relay
from django_outbox.signals import event_abandoned, event_failed, event_published
from django_outbox.transports.base import NACKED, Failure
from django_outbox.transports.kombu import AmqpTransport
from tests.factories import OutboxMessageFactory
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    REPO,
    as_on_the_table,
    consume,
    delete_queue,
    manage,
    relay_command,
    relay_env,
    row_retention,
    run_relay,
    running,
    stage_events,
    start_relay,
    status_counts,
    unique_destination,
    wait_until,
)

pytestmark = [
    pytest.mark.django_db(transaction=True, databases=["default", "other"]),
    pytest.mark.disrupts,
]

Status = OutboxMessage.Status


@pytest.fixture
def destination():
    name = unique_destination()
    yield name
    delete_queue(name)


def ids_of(messages) -> list[str]:
    return [m.headers["event_id"] for m in messages]


@pytest.mark.slow
def test_drain_relays_ten_thousand_events_to_rabbitmq_with_the_wire_format(destination):
    staged = stage_events(10_000, destination, keys=10)
    rows = {str(r.event_id): r for r in OutboxMessage.objects.all()}

    started = time.monotonic()
    result = run_relay("--drain")
    elapsed = time.monotonic() - started
    print(f"\nrelay --drain: 10000 events to RabbitMQ in {elapsed:.2f}s: {result.stdout.strip()}")

    messages = consume(destination, 10_000)
    assert sorted(ids_of(messages)) == sorted(staged)  # every event, none twice
    assert status_counts()["published"] == 10_000
    message = messages[0]
    row = rows[message.headers["event_id"]]
    assert json.loads(message.body) == row.payload
    assert message.content_type == "application/json"
    assert message.content_encoding == "utf-8"
    assert message.properties["message_id"] == str(row.event_id)
    assert message.properties["delivery_mode"] == 2
    assert message.headers == {
        "event_id": str(row.event_id),
        "event_type": "test.event",
        "occurred_at": row.created_at.isoformat(),
        "ordering_key": row.ordering_key,
        "correlation_id": str(row.event_id),
        "causation_id": None,
    }
    assert all(json.loads(m.body) == rows[m.headers["event_id"]].payload for m in messages)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_parallel_relays_share_the_work_and_publish_nothing_twice(destination, processes):
    staged = stage_events(4000, destination)
    relays = [start_relay("--drain", "--batch-size", "50") for _ in range(processes)]
    outputs = [relay.communicate(timeout=300) for relay in relays]
    assert [relay.returncode for relay in relays] == [0] * processes, outputs

    received = ids_of(consume(destination, 4000))
    assert Counter(received).most_common(1)[0][1] == 1  # none twice
    assert sorted(received) == sorted(staged)
    claimed_by = [int(out.split("claimed ")[1].split(",")[0]) for out, _ in outputs]
    assert sum(claimed_by) == 4000
    assert sum(1 for n in claimed_by if n > 0) >= 2, claimed_by  # the work was shared


@pytest.mark.slow
def test_sigkill_mid_drain_then_restart_after_the_lease_loses_nothing(destination):
    staged = stage_events(5000, destination)
    lease = {"LEASE_SECONDS": 2}
    relay = start_relay("--batch-size", "200", **lease)
    wait_until(lambda: status_counts()["published"] >= 1000, timeout=120, what="1000 published")
    relay.kill()  # SIGKILL: no chance to finish the batch in hand
    relay.communicate(timeout=30)  # reap it and close its pipes
    assert relay.returncode == -signal.SIGKILL
    left = status_counts()
    assert left["published"] < 5000

    time.sleep(lease["LEASE_SECONDS"] + 0.5)  # the dead relay's lease expires
    run_relay("--drain", "--batch-size", "200", **lease)

    received = ids_of(consume(destination, 5000))
    assert set(received) == set(staged)  # every event arrived
    duplicates = len(received) - len(set(received))
    print(f"\nSIGKILL after {left['published']} published: {duplicates} duplicates")
    # At most what was in flight: with the claim-ahead pipeline (docs/relay.md) that is
    # the batch being finalized (confirmed, not yet marked) and the one being published.
    assert duplicates <= 2 * 200
    assert status_counts()["published"] == 5000


@pytest.mark.slow
def test_broker_outage_mid_relay_fails_rows_with_backoff_and_delivers_all(destination):
    from tests.support import services

    relay = start_relay(
        "--batch-size", "100", RETRY_BASE_DELAY=0.5, RETRY_MAX_DELAY=2, POLL_INTERVAL=0.2
    )
    with running(relay) as ended:
        staged = stage_events(300, destination)
        wait_until(lambda: status_counts()["published"] == 300, timeout=60, what="300 published")
        services("stop", "rabbitmq")
        try:
            # Staged while the broker is down: the relay wakes, the batch fails, the relay stays up.
            staged += stage_events(3000, destination)
            wait_until(
                lambda: OutboxMessage.objects.filter(attempts__gte=1).exists(),
                timeout=60,
                what="a failed attempt",
            )
            time.sleep(2)
            assert relay.poll() is None, "the relay exited during the outage"
            assert status_counts()["failed"] >= 1
        finally:
            services("start", "rabbitmq")
        wait_until(lambda: status_counts()["published"] == 3300, timeout=180, what="all published")
    assert ended.err.count("broker unreachable") == 1, ended.err  # logged once per outage
    assert ended.err.count("broker reachable again") == 1, ended.err
    received = ids_of(consume(destination, 3300))
    assert set(received) == set(staged)


@pytest.mark.slow
def test_sigterm_finishes_the_batch_in_hand_and_exits_zero(destination):
    stage_events(20_000, destination)
    relay = start_relay("--batch-size", "500")
    with running(relay) as ended:
        wait_until(lambda: status_counts()["published"] >= 500, timeout=60, what="a first batch")
    counts = status_counts()
    assert counts["processing"] == 0  # the batch in hand was finished, not abandoned
    assert counts["published"] + counts["pending"] == 20_000
    assert "published" in ended.out


@pytest.mark.slow
def test_redis_drain(destination):
    staged = stage_events(3000, destination)
    started = time.monotonic()
    result = run_relay("--drain", BROKER_URL=REDIS_URL)
    elapsed = time.monotonic() - started
    print(f"\nrelay --drain: 3000 events to Redis in {elapsed:.2f}s: {result.stdout.strip()}")
    messages = consume(destination, 3000, url=REDIS_URL)
    assert sorted(ids_of(messages)) == sorted(staged)
    assert json.loads(messages[0].body) == {"n": int(json.loads(messages[0].body)["n"])}


def test_poison_row_is_abandoned_and_the_rest_of_its_batch_publishes(destination):
    routes = {"ROUTES": {destination: {"queue": destination}}, "DEFAULT_ROUTE": False}
    staged = stage_events(20, destination)
    # A row for a destination that lost its route after it was staged.
    poison = OutboxMessageFactory(destination="retired-destination", event_type="old.event")

    once = manage("run_outbox_relay", "--once", **routes)
    assert once.returncode == 1  # a row was abandoned
    assert once.stdout.startswith("claimed 21, published 20, failed 0, abandoned 1, lease lost 0")

    poison.refresh_from_db()
    assert poison.status == Status.ABANDONED
    assert poison.attempts == 1
    assert poison.last_error == (
        "destination 'retired-destination' has no route: it is not in OUTBOX['ROUTES'] "
        "and OUTBOX['DEFAULT_ROUTE'] is False"
    )
    assert sorted(ids_of(consume(destination, 20))) == sorted(staged)

    # Requeue refuses rows in other states, then brings the poison row back.
    published = OutboxMessage.objects.filter(status=Status.PUBLISHED).first()
    refused = manage("outbox_requeue", "--id", str(published.pk), str(poison.event_id))
    assert refused.returncode == 1
    assert f"not {published.pk} (published)" in refused.stderr
    assert OutboxMessage.objects.get(pk=poison.pk).status == Status.ABANDONED

    requeued = manage("outbox_requeue", "--id", str(poison.event_id))
    assert requeued.returncode == 0, requeued.stderr
    assert requeued.stdout.strip() == "requeued 1 row"
    poison.refresh_from_db()
    assert (poison.status, poison.attempts, poison.last_error) == (Status.PENDING, 0, "")


@row_retention
def test_retention_deletes_only_what_is_old_enough():
    now = timezone.now()
    old = OutboxMessageFactory(published=True, published_at=now - dt.timedelta(days=8))
    young = OutboxMessageFactory(published=True, published_at=now - dt.timedelta(days=6))
    old_abandoned = OutboxMessageFactory(
        status=Status.ABANDONED, abandoned_at=now - dt.timedelta(days=31)
    )
    young_abandoned = OutboxMessageFactory(
        status=Status.ABANDONED, abandoned_at=now - dt.timedelta(days=29)
    )
    pending = OutboxMessageFactory(available_at=now - dt.timedelta(days=60))

    dry = manage("outbox_cleanup", "--dry-run")
    counts = (
        "1 published, 1 abandoned, 0 inbox, 0 failures, 0 parked, "
        "0 tasks, 0 samples, 0 workers rows"
    )
    assert dry.stdout.strip() == f"would delete {counts}"
    assert OutboxMessage.objects.count() == 5

    done = manage("outbox_cleanup")
    assert done.stdout.strip() == f"deleted {counts}"
    assert set(OutboxMessage.objects.values_list("pk", flat=True)) == {
        young.pk,
        young_abandoned.pk,
        pending.pk,
    }
    assert not OutboxMessage.objects.filter(pk__in=[old.pk, old_abandoned.pk]).exists()


@row_retention
def test_a_running_relay_cleans_up_between_batches_while_it_still_has_work(destination):
    now = timezone.now()
    old = OutboxMessageFactory(published=True, published_at=now - dt.timedelta(days=8))
    young = OutboxMessageFactory(published=True, published_at=now - dt.timedelta(days=6))
    stage_events(300, destination)
    stop = threading.Event()
    seen: list[bool] = []  # per batch: was the old row still there?

    def on_batch(stats):
        seen.append(OutboxMessage.objects.filter(pk=old.pk).exists())
        if not OutboxMessage.objects.due().exists():
            stop.set()

    with override_settings(OUTBOX={**settings.OUTBOX, "CLEANUP_INTERVAL": 0.001}):
        Relay(batch_size=20).run(stop, on_batch=on_batch)
    assert not OutboxMessage.objects.filter(pk=old.pk).exists()
    assert OutboxMessage.objects.filter(pk=young.pk).exists()
    # It was gone before the last batch: cleanup did not wait for an idle moment.
    assert len(seen) >= 10 and seen[-1] is False


def test_a_relay_whose_lease_was_taken_over_changes_nothing(destination, caplog):
    stage_events(3, destination)
    relay = Relay(worker="zombie")
    token = uuid.uuid4()
    claimed = db.claim("default", limit=10, lease_seconds=60, worker="zombie", token=token)
    # Another relay takes the rows over (as after the zombie's lease expired).
    OutboxMessage.objects.update(lease_token=uuid.uuid4(), locked_by="rescuer")
    batch = Batch(claimed, [None, None, None], token, frozenset({destination}))
    batches = relay.batches()
    stats = batches.report(batches.finalize(batch))

    assert (stats.published, stats.lost) == (0, 3)
    assert set(OutboxMessage.objects.values_list("status", "locked_by")) == {
        (Status.PROCESSING, "rescuer")
    }
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "outbox.lease_lost"]
    assert record.levelname == "WARNING"
    assert sorted(record.ids) == sorted(m.id for m in claimed)


def test_transient_failures_back_off_then_abandon_and_signals_fire():
    with transaction.atomic():
        stage("a.b", {"n": 1}, destination="nowhere")
    seen = []

    def collect(signal_name):
        return lambda sender, messages, using, **kw: seen.append(
            (signal_name, len(messages), kw.get("errors"))
        )

    receivers = {event_failed: collect("failed"), event_abandoned: collect("abandoned")}
    for sig, receiver in receivers.items():
        sig.connect(receiver)
    # Nothing listens on port 9: every publish fails with a connection error.
    down = {"BROKER_URL": "amqp://guest:guest@127.0.0.1:9//", "MAX_ATTEMPTS": 2}
    try:
        with override_settings(OUTBOX=down):
            relay = Relay()
            first = relay.run_once()
            row = OutboxMessage.objects.get()
            assert (first.failed, row.status, row.attempts) == (1, Status.FAILED, 1)
            assert (
                "ConnectionRefusedError" in row.last_error or "OperationalError" in row.last_error
            )
            delay = (row.available_at - timezone.now()).total_seconds()
            assert 0 < delay <= 1.0  # RETRY_BASE_DELAY (1s) minus jitter
            assert relay.run_once().claimed == 0  # not due yet
            OutboxMessage.objects.update(available_at=timezone.now())
            second = relay.run_once()
            relay.close()
    finally:
        for sig, receiver in receivers.items():
            sig.disconnect(receiver)
    row.refresh_from_db()
    assert (second.abandoned, row.status, row.attempts) == (1, Status.ABANDONED, 2)
    assert row.abandoned_at is not None
    assert [(name, n) for name, n, _ in seen] == [("failed", 1), ("abandoned", 1)]
    assert seen[1][2] == [row.last_error]


def test_published_signal_carries_the_batch(destination):
    stage_events(5, destination)
    got = []

    def receiver(sender, messages, using, **kwargs):
        got.append((using, sorted(m.id for m in messages)))

    event_published.connect(receiver)
    try:
        with Relay() as relay:
            stats = relay.run_once()
    finally:
        event_published.disconnect(receiver)
    assert stats.published == 5
    assert got == [("default", sorted(OutboxMessage.objects.values_list("id", flat=True)))]
    consume(destination, 5)


def test_relay_per_database_alias(destination):
    staged = stage_events(50, destination, using="other")
    stage_events(5, destination, using="default")
    run_relay("--drain", "--database", "other")
    assert status_counts("other")["published"] == 50
    assert status_counts("default")["pending"] == 5
    assert sorted(ids_of(consume(destination, 50))) == sorted(staged)


def test_listen_wakes_the_relay_on_commit(destination):
    # With a 30s poll, only the NOTIFY from the staging commit can wake the relay quickly.
    relay = start_relay(POLL_INTERVAL=30)
    with running(relay):
        time.sleep(1.5)  # the relay is idle and listening
        with transaction.atomic():
            stage("a.b", {"n": 1}, destination=destination)
        committed = time.monotonic()
        messages = consume(destination, 1, timeout=20, idle=0.2)
        waited = time.monotonic() - committed
    assert len(messages) == 1
    assert waited < 15  # far below the 30s poll: the NOTIFY woke it


def test_celery_route_sends_a_task_with_the_event_id_as_task_id(destination):
    from celery import Celery

    app = Celery("outbox-tests", broker=AMQP_URL, set_as_current=True)
    app.conf.task_default_queue = destination
    with transaction.atomic():
        row = stage("mail.send", {"to": "ada@example.com"}, destination="mail")
    with override_settings(
        OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": {"mail": {"celery_task": "mail.send_receipt"}}}
    ):
        with Relay() as relay:
            stats = relay.run_once()
    assert stats.published == 1, OutboxMessage.objects.get(pk=row.pk).last_error
    (message,) = consume(destination, 1)
    assert message.headers["task"] == "mail.send_receipt"
    assert message.headers["id"] == str(row.event_id)
    assert message.headers["event_type"] == "mail.send"
    args, kwargs, _ = json.loads(message.body)
    assert (args, kwargs) == ([], {"to": "ada@example.com"})
    app.close()


#: The claim's own condition (the named query claim_due), unordered rows, oldest first.
DUE_SQL = (
    "SELECT id FROM django_outbox_outboxmessage "
    f"WHERE {postgresql._due_sql('now()')} AND sequence IS NULL "
    "ORDER BY available_at, id LIMIT 100"
)


def test_claim_uses_the_partial_index_and_skips_locked_rows(destination):
    from django.db import connection

    stage_events(10, destination)
    token = uuid.uuid4()
    with transaction.atomic():
        # This transaction holds the first 4 rows locked, as a relay mid-claim would.
        locked = list(
            OutboxMessage.objects.order_by("id")
            .select_for_update()
            .values_list("id", flat=True)[:4]
        )
        import psycopg  # a second, independent session

        params = connection.get_connection_params()
        for key in ("cursor_factory", "context", "server_side_binding"):
            params.pop(key, None)
        with psycopg.connect(**params, autocommit=True) as other:
            rows = other.execute(f"{DUE_SQL} FOR UPDATE SKIP LOCKED").fetchall()
    assert not set(locked) & {r[0] for r in rows}
    assert len(rows) == 6
    claimed = db.claim("default", limit=100, lease_seconds=30, worker="w", token=token)
    assert len(claimed) == 10
    with connection.cursor() as cursor:
        cursor.execute("SET enable_seqscan = off")
        cursor.execute(f"EXPLAIN {DUE_SQL}")
        plan = as_on_the_table("\n".join(row[0] for row in cursor.fetchall()))
        cursor.execute("RESET enable_seqscan")
    assert "outbox_due_idx" in plan


def test_status_command_reports_counts_age_attempts_and_keys():
    now = timezone.now()
    OutboxMessageFactory.create_batch(
        3, ordering_key="order-1", available_at=now - dt.timedelta(seconds=90)
    )
    OutboxMessageFactory(
        status=Status.FAILED,
        attempts=2,
        ordering_key="order-2",
        available_at=now - dt.timedelta(seconds=5),
    )
    OutboxMessageFactory(published=True)
    out = manage("outbox_status").stdout
    assert "pending      3" in out
    assert "failed       1" in out
    assert "published    1" in out
    age = float(out.split("oldest due row: ")[1].split("s old")[0])
    assert 90 <= age < 600
    assert "    2 attempts: 1" in out
    assert "        3  order-1" in out


def test_ordering_key_goes_in_the_header_and_into_the_routing_key_where_a_route_asks(destination):
    routes = {
        destination: {
            "exchange": f"{destination}-x",
            "routing_key": "order.{key}",
            "queue": destination,
        }
    }
    with transaction.atomic():
        stage("order.placed", {"n": 1}, destination=destination, key="customer-7")
        stage("order.placed", {"n": 2}, destination=destination)
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        with Relay() as relay:
            assert relay.run_once().published == 2
    by_n = {json.loads(m.body)["n"]: m for m in consume(destination, 2)}
    assert by_n[1].headers["ordering_key"] == "customer-7"
    assert by_n[1].delivery_info["routing_key"] == "order.customer-7"
    assert by_n[2].headers["ordering_key"] is None
    assert by_n[2].delivery_info["routing_key"] == "order."


def test_drain_shows_progress_with_rate_and_remaining_on_a_terminal(destination):
    import os
    import pty
    import subprocess

    from tests.support import relay_command, relay_env

    stage_events(1000, destination)
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [*relay_command("--drain", "--batch-size", "100")],
        env=relay_env(),
        stdout=terminal,
        stderr=subprocess.DEVNULL,
    )
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the relay exited and closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(controller)
    assert process.wait(timeout=60) == 0
    text = output.decode()
    assert "1000/1000" in text
    assert "events/s" in text
    assert "0 remaining" in text
    assert "\r[" in text  # redrawn in place
    consume(destination, 1000)


def test_a_header_the_broker_cannot_encode_abandons_only_its_row(destination):
    """The bad row sits between two good ones in the batch: the confirms of the rows
    after it still find their rows (it takes no delivery tag)."""
    with transaction.atomic():
        good = [stage("a.b", {"n": 0}, destination=destination)]
        # stage() refuses such a header now; a row staged before it did still goes out.
        bad = OutboxMessageFactory(destination=destination, headers={"huge": 10**19})
        good.append(stage("a.b", {"n": 1}, destination=destination))
    with Relay() as relay:
        stats = relay.run_once()
    assert (stats.published, stats.abandoned, stats.transport_failed) == (2, 1, False)
    bad.refresh_from_db()
    assert bad.status == Status.ABANDONED
    assert bad.last_error.startswith("error: ")  # struct.error: the int does not fit AMQP's 64 bits
    assert sorted(ids_of(consume(destination, 2))) == sorted(str(r.event_id) for r in good)


def test_an_unroutable_message_is_not_marked_published(destination):
    routes = {destination: {"exchange": f"{destination}-x"}}  # an exchange, no queue bound
    with transaction.atomic():
        stage("a.b", {"n": 1}, destination=destination)
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        with Relay() as relay:
            stats = relay.run_once()
    row = OutboxMessage.objects.get()
    assert (stats.published, stats.failed, row.status) == (0, 1, Status.FAILED)
    assert row.last_error.startswith(f"unroutable: no queue is bound to exchange '{destination}-x'")


def test_a_batch_the_broker_nacks_whole_is_retried_on_a_new_connection(destination):
    """RabbitMQ 3.10 can leave a channel opened while a quorum queue elects a new leader
    nacking every publish to that queue for minutes (test_cluster.py's relay, failing over
    to another node, saw it): a batch nacked whole closes the connection, so that the
    retry opens a new one. Here a queue that holds one message nacks the rest."""
    limit = {"x-max-length": 1, "x-overflow": "reject-publish"}
    routes = {destination: {"queue": destination, "queue_arguments": limit}}
    stage_events(3, destination)
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        route = outbox_settings.route_for(destination)
        assert route is not None
        messages = db.claim("default", limit=3, lease_seconds=60, worker="t", token=uuid.uuid4())
        transport = AmqpTransport(AMQP_URL)
        try:
            assert transport.publish(route, messages[:1]) == [None]
            connection = transport._connection
            assert transport.publish(route, messages[1:]) == [Failure(NACKED)] * 2
            assert transport._connection is None  # closed: the next publish reconnects
            assert transport.publish(route, messages[2:]) == [Failure(NACKED)]
            assert transport._connection is None
            assert connection is not None
        finally:
            transport.close()
    queue = kombu.Queue(destination, routing_key=destination, queue_arguments=limit)
    assert ids_of(consume(queue, 1)) == [str(messages[0].event_id)]


def test_confirm_publish_in_transport_options_does_not_break_the_confirm_pipeline(destination):
    stage_events(50, destination)
    options = {"BROKER_URL": AMQP_URL, "BROKER_TRANSPORT_OPTIONS": {"confirm_publish": True}}
    with override_settings(OUTBOX=options):
        with Relay() as relay:
            assert relay.run_once().published == 50
    assert len(consume(destination, 50)) == 50


@pytest.mark.slow
def test_the_relay_rides_out_a_postgresql_restart(destination):
    """With persistent connections, as a daemon runs: each of the relay's threads loses
    its own. Regression (found by the chaos suite): the database thread kept its dead
    connection, so the first batch after the outage failed to finalize; it was
    published again when its lease expired and the outage was logged twice."""
    from django.db import connections

    from tests.support import services

    env = relay_env(POLL_INTERVAL=0.2)
    env["DATABASE_URL"] += "?conn_max_age=3600"
    relay = subprocess.Popen(
        relay_command(),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with running(relay) as ended:
        first = stage_events(100, destination)
        wait_until(lambda: status_counts()["published"] == 100, timeout=60, what="100 published")
        services("restart", "postgres")  # fast shutdown: every connection is cut
        connections.close_all()  # this test's own connection died too
        time.sleep(1)
        second = stage_events(100, destination)
        wait_until(lambda: status_counts()["published"] == 200, timeout=90, what="200 published")
        assert relay.poll() is None, "the relay exited"
    assert sorted(ids_of(consume(destination, 200))) == sorted(first + second)
    assert ended.err.count("unreachable (") == ended.err.count("reachable again") == 1, ended.err
