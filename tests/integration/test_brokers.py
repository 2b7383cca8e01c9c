"""Several brokers end to end: RabbitMQ as "default" and Redis as "events", routes split
between them, one relay publishing to both (real PostgreSQL, RabbitMQ and Redis)."""

from __future__ import annotations

import json
import logging
import threading
import uuid
from urllib.parse import urlsplit

import psycopg
import pytest
import redis
from django.db import connections
from django.test import override_settings

from django_outbox.consumer import InboxConsumer
from django_outbox.models import OutboxMessage
from django_outbox.ops.health import check_health
from django_outbox.relay import Relay
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    consume,
    database_url,
    manage,
    redis_maxmemory,
    refused_port,
    stage_events,
    unique_destination,
    wait_until,
)


def two_brokers(orders: str, clicks: str, events_url: str = REDIS_URL) -> dict:
    return {
        "BROKERS": {"default": {"URL": AMQP_URL}, "events": {"URL": events_url}},
        "ROUTES": {
            orders: {"queue": orders},  # the "default" broker
            clicks: {"queue": clicks, "broker": "events"},
        },
    }


def run_in_thread(relay: Relay, stop: threading.Event) -> threading.Thread:
    """Start ``relay.run(stop)`` on a thread of its own (its connections closed at the end)."""

    def run() -> None:
        try:
            relay.run(stop)
        finally:
            connections.close_all()  # this thread's

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def statuses(destination: str) -> set[tuple[str, int]]:
    rows = OutboxMessage.objects.filter(destination=destination)
    return set(rows.values_list("status", "attempts"))


@pytest.mark.django_db(transaction=True)
def test_one_relay_publishes_each_route_to_its_own_broker():
    orders, clicks = unique_destination("orders"), unique_destination("clicks")
    with override_settings(OUTBOX=two_brokers(orders, clicks)):
        order_ids = stage_events(5, orders)
        click_ids = stage_events(7, clicks)
        totals = Relay().run(threading.Event(), drain=True)
        # A consumer of a queue reads from the broker of the queue's route.
        assert InboxConsumer(clicks, print, "c").url == REDIS_URL
        assert InboxConsumer(orders, print, "c").url == AMQP_URL
    assert (totals.published, totals.failed, totals.gave_up) == (12, 0, "")
    from_rabbit = consume(orders, 5, url=AMQP_URL)
    from_redis = consume(clicks, 7, url=REDIS_URL)
    assert [m.headers["event_id"] for m in from_rabbit] == order_ids
    assert [m.headers["event_id"] for m in from_redis] == click_ids
    # Each message went to its own broker only.
    assert consume(clicks, 0, url=AMQP_URL) == []
    assert consume(orders, 0, url=REDIS_URL) == []


@pytest.mark.django_db(transaction=True)
def test_a_broker_down_fails_only_its_routes_rows_and_a_drain_names_it():
    orders, clicks = unique_destination("orders"), unique_destination("clicks")
    events_url = f"redis://127.0.0.1:{refused_port()}/0"  # nothing listens there
    with override_settings(OUTBOX=two_brokers(orders, clicks, events_url)):
        order_ids = stage_events(4, orders)
        stage_events(3, clicks)
        totals = Relay().run(threading.Event(), drain=True)
    assert (totals.published, totals.failed) == (4, 3)
    assert totals.gave_up.startswith(
        f"the broker 'events' ({events_url}) is unreachable (ConnectionError: "
    ), totals.gave_up
    assert statuses(orders) == {("published", 0)}
    assert statuses(clicks) == {("failed", 1)}
    assert [m.headers["event_id"] for m in consume(orders, 4, url=AMQP_URL)] == order_ids


@pytest.mark.django_db(transaction=True)
def test_a_running_relay_names_the_broker_that_is_down(caplog):
    caplog.set_level(logging.INFO, logger="django_outbox")
    orders, clicks = unique_destination("orders"), unique_destination("clicks")
    events_url = f"redis://127.0.0.1:{refused_port()}/0"
    stop = threading.Event()
    with override_settings(OUTBOX=two_brokers(orders, clicks, events_url)):
        stage_events(2, orders)
        stage_events(2, clicks)
        thread = run_in_thread(Relay(), stop)
        try:
            wait_until(
                lambda: any(
                    getattr(r, "action", "") == "outbox.broker_down" for r in caplog.records
                ),
                timeout=60,
                what="the broker_down log line",
            )
        finally:
            stop.set()
            thread.join(60)
    (down,) = [r for r in caplog.records if getattr(r, "action", "") == "outbox.broker_down"]
    assert f"broker 'events' ({events_url}): ConnectionError: " in down.getMessage()
    assert statuses(orders) == {("published", 0)}
    assert statuses(clicks) == {("failed", 1)}


@pytest.mark.django_db(transaction=True)
def test_the_consumer_of_a_queue_routed_to_another_broker_reads_that_broker():
    # run_outbox_consumer --queue clicks, where the route of clicks names "events"
    # (Redis, down here) while "default" (RabbitMQ) is up: it must wait for Redis.
    port = refused_port()
    result = manage(
        "run_outbox_consumer",
        "--queue",
        "clicks",
        "--handler",
        "tests.testapp.handlers.record",
        "--consumer",
        "audit",
        "--idle-timeout",
        "2",
        BROKERS={"events": {"URL": f"redis://:s3cret-pw@127.0.0.1:{port}/0"}},
        ROUTES={"clicks": {"queue": "clicks", "broker": "events"}},
    )
    assert result.returncode == 1, result.stderr
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"CommandError: gave up after 2s without a broker: redis://:***@127.0.0.1:{port}/0 "
        )
    )
    assert "s3cret-pw" not in result.stdout + result.stderr


@pytest.mark.django_db(transaction=True)
def test_parked_messages_are_replayed_to_the_broker_of_their_queue():
    from django.utils import timezone

    from django_outbox.consumer.replay import replay_parked
    from django_outbox.models import InboxFailure

    orders, clicks = unique_destination("orders"), unique_destination("clicks")
    for queue in (clicks, orders):
        InboxFailure.objects.create(
            consumer="audit",
            event_id=uuid.uuid4(),
            queue=queue,
            event_type="t",
            body=json.dumps({"queue": queue}),
            headers={"event_id": queue},
            parked_at=timezone.now(),
        )
    with override_settings(OUTBOX=two_brokers(orders, clicks)):
        replayed = replay_parked(InboxFailure.objects.all())
    assert len(replayed) == 2
    assert InboxFailure.objects.parked().count() == 0
    # Before, both went to the "default" broker (RabbitMQ), clicks to a queue no one reads.
    assert [m.headers["event_id"] for m in consume(clicks, 1, url=REDIS_URL)] == [clicks]
    assert [m.headers["event_id"] for m in consume(orders, 1, url=AMQP_URL)] == [orders]
    assert consume(clicks, 0, url=AMQP_URL) == []


@pytest.mark.django_db(transaction=True)
def test_a_running_relay_keeps_publishing_to_the_broker_that_is_up():
    orders, clicks = unique_destination("orders"), unique_destination("clicks")
    events_url = f"redis://127.0.0.1:{refused_port()}/0"  # nothing listens there
    stop = threading.Event()
    with override_settings(OUTBOX=two_brokers(orders, clicks, events_url)):
        stage_events(3, clicks)
        thread = run_in_thread(Relay(), stop)
        try:
            wait_until(lambda: statuses(clicks) == {("failed", 1)}, timeout=60, what="clicks fail")
            # "events" is down now; events staged for the other broker still go out, and
            # before its next try "events" rows are not attempted (no attempt spent).
            order_ids = stage_events(4, orders)
            wait_until(lambda: statuses(orders) == {("published", 0)}, timeout=30, what="orders")
            stage_events(2, clicks)
            wait_until(
                lambda: (
                    OutboxMessage.objects.filter(destination=clicks, attempts=0)
                    .exclude(status="pending")
                    .count()
                    == 2
                ),
                timeout=30,
                what="the new clicks set aside unattempted",
            )
        finally:
            stop.set()
            thread.join(60)
    assert not thread.is_alive()
    assert statuses(clicks) <= {("failed", 1), ("failed", 0)}
    assert [m.headers["event_id"] for m in consume(orders, 4, url=AMQP_URL)] == order_ids


def _held_due(destination: str) -> list[str]:
    """The health problems once a row of ``destination`` is due, its rows locked by
    another session meanwhile: the relay wakes when a row comes due and claims it at
    once (SKIP LOCKED passes over locked rows), so unlocked a due row lasts only
    milliseconds."""
    with psycopg.connect(database_url()) as locker:
        locker.execute(
            "SELECT id FROM django_outbox_outboxmessage WHERE destination = %s FOR UPDATE",
            [destination],
        )
        return wait_until(
            lambda: check_health(max_due_age=0, require_relay=False).problems,
            timeout=30,
            what="a row due while Redis is full",
        )


@pytest.mark.django_db(transaction=True)
@pytest.mark.disrupts
def test_a_redis_out_of_memory_is_an_outage_that_spends_no_attempt(caplog):
    """Redis at its maxmemory (noeviction): the relay's first batch meets it at the
    queue's declaration, which is no refusal to declare (no advice to delete a queue,
    whose messages that would destroy); its rows spend no attempt and say why, the
    relay logs the outage once as out of memory and backs off, a probe write telling
    when Redis takes pushes again; then every row is published once. (Before: the
    declaration was "refused ... or delete it", every 30 s, and a batch that reached
    the pipeline was charged an attempt.)"""
    caplog.set_level(logging.INFO, logger="django_outbox")
    orders, clicks = unique_destination("orders"), unique_destination("clicks")
    stop = threading.Event()
    with override_settings(OUTBOX=two_brokers(orders, clicks)):
        with redis_maxmemory():
            click_ids = stage_events(3, clicks)
            thread = run_in_thread(Relay(), stop)
            try:
                wait_until(lambda: actions(caplog, "outbox.broker_down"), timeout=60, what="down")
                failed = OutboxMessage.objects.filter(destination=clicks)
                wait_until(  # (claimed again each second meanwhile: not attempted)
                    lambda: set(failed.values_list("status", "attempts")) == {("failed", 0)},
                    timeout=30,
                    what="the rows failed, no attempt spent",
                )
                errors = set(failed.values_list("last_error", flat=True))
                problems = _held_due(clicks)
            except BaseException:
                stop.set()
                raise
        try:  # memory for Redis again
            wait_until(lambda: statuses(clicks) == {("published", 0)}, timeout=60, what="clicks")
        finally:
            stop.set()
            thread.join(60)
    assert errors and all("out of memory" in error for error in errors), errors
    first = actions(caplog, "outbox.publish_deferred")[0].getMessage()
    assert "attempts unchanged: the broker is out of memory (Redis maxmemory reached" in first
    assert "(its last error: " in problems[0] and "out of memory" in problems[0]
    (down,) = actions(caplog, "outbox.broker_down")
    assert "broker 'events' out of memory (" in down.getMessage()
    assert "Redis refuses every write (out of memory, Redis maxmemory" in down.getMessage()
    assert len(actions(caplog, "outbox.broker_up")) == 1
    assert not actions(caplog, "outbox.declare_refused")
    assert not [r for r in caplog.records if "delete" in r.getMessage()]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        pushed = [json.loads(text)["headers"]["event_id"] for text in client.lrange(clicks, 0, -1)]
    finally:
        client.delete(clicks)
        client.close()
    assert pushed[::-1] == click_ids


def actions(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", "") == action]


@pytest.mark.django_db(transaction=True)
def test_a_redis_user_that_may_not_write_the_probes_key_is_published_to_after_an_outage():
    """After an outage the relay asks Redis whether it takes writes again with a probe (an
    LPUSHX to a key of its own, refused while out of memory). Under an ACL that names
    only the queues' keys that probe is refused NOPERM, and the relay took Redis for down
    for good: nothing published after the outage. A refusal is an answer: Redis is up."""
    queue, user = unique_destination("acl"), f"outbox-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(REDIS_URL)
    admin.acl_setuser(
        user, enabled=True, passwords=["+secret"], keys=["_kombu*", f"{queue}*"], commands=["+@all"]
    )
    parts = urlsplit(REDIS_URL)
    limited = parts._replace(netloc=f"{user}:secret@{parts.hostname}:{parts.port}").geturl()
    stop = threading.Event()
    thread = None
    try:
        with override_settings(OUTBOX={"BROKER_URL": limited, "ROUTES": {queue: {"queue": queue}}}):
            with redis_maxmemory():  # the outage
                ids = stage_events(2, queue)
                thread = run_in_thread(Relay(), stop)
                wait_until(lambda: statuses(queue) == {("failed", 0)}, timeout=60, what="down")
            wait_until(lambda: statuses(queue) == {("published", 0)}, timeout=60, what="up")
        pushed = [json.loads(m)["headers"]["event_id"] for m in admin.lrange(queue, 0, -1)]
        assert pushed[::-1] == ids
    finally:
        stop.set()
        if thread is not None:
            thread.join(60)
        admin.delete(queue)
        admin.acl_deluser(user)
        admin.close()
