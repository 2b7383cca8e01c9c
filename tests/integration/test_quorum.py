"""Quorum queues on the real (single-node) RabbitMQ: the route option ``queue_type``
declared by the relay and the consumer alike, a queue of another type refused with the
route, the queue and the fix, parking by the broker's ``x-delivery-count`` (but not for
an ordered event's held-back requeues), a parked message dead-lettered to the route's
``dead_letter_exchange``, and the jitter before a relay's first claim."""

from __future__ import annotations

import random
import threading
import time

import kombu
import psycopg
import pytest
from django.db import connection
from django.test import override_settings

from django_outbox import ReceivedEvent
from django_outbox.conf import outbox_settings
from django_outbox.consumer import InboxConsumer
from django_outbox.consumer.loop import ConsumerRun
from django_outbox.consumer.replay import replay_parked
from django_outbox.models import InboxFailure, OutboxMessage
from django_outbox.relay import Relay
from django_outbox.transports.declare import DeclareRefused, declare
from tests.integration.test_ordered_consumption import Recorder, publish, publish_raw
from tests.support import (
    AMQP_URL,
    broker_connection,
    delete_queue,
    drain_raw,
    manage,
    rabbitmqctl,
    stage_events,
    unique_destination,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.disrupts]


def queue_types() -> dict[str, str]:
    """Every queue of the broker and its type, as RabbitMQ reports them."""
    out = rabbitmqctl("list_queues", "name", "type", "--no-table-headers", "--quiet")
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.fixture
def quorum_route():
    """A destination whose route declares its queue (of the same name) as a quorum queue."""
    name = unique_destination("q")
    routes = {name: {"queue": name, "queue_type": "quorum"}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        yield name
    delete_queue(name)


def drain_relay() -> None:
    with Relay() as relay:
        totals = relay.run(threading.Event(), drain=True)
    assert totals.failed == totals.abandoned == 0


def test_the_relay_declares_the_route_queue_as_a_quorum_queue_and_the_consumer_reads_it(
    quorum_route,
):
    stage_events(20, quorum_route)
    drain_relay()
    assert queue_types()[quorum_route] == "quorum"
    handler = Recorder()
    stats = InboxConsumer(quorum_route, handler, "quorum").run(idle_timeout=2)
    assert stats.handled == 20
    assert stats.failed == stats.parked == 0


def test_a_consumer_started_first_declares_the_quorum_queue_the_relay_then_fills(
    quorum_route,
):
    InboxConsumer(quorum_route, Recorder(), "quorum").run(idle_timeout=0.5)
    assert queue_types()[quorum_route] == "quorum"
    stage_events(20, quorum_route)
    drain_relay()
    handler = Recorder()
    stats = InboxConsumer(quorum_route, handler, "quorum").run(idle_timeout=2)
    assert stats.handled == 20
    assert stats.failed == stats.parked == 0


def test_the_partition_queues_of_an_ordered_route_are_quorum_queues_too():
    queue = unique_destination("qp")
    routes = {
        queue: {
            "exchange": f"{queue}-x",
            "queue": queue,
            "ordered": True,
            "partitions": 2,
            "queue_type": "quorum",
        }
    }
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        route = outbox_settings.route_for(queue)
        with broker_connection() as connection:
            declare(connection.channel(), route)
        types = queue_types()
        assert types[f"{queue}.0"] == types[f"{queue}.1"] == "quorum"
        assert queue not in types  # a partitioned route's own queue is not declared
        for partition in route.partition_queues:
            delete_queue(partition)


def test_a_queue_that_exists_with_another_type_is_refused_naming_route_queue_and_fix(
    quorum_route,
):
    with broker_connection() as connection:  # the same name, declared classic earlier
        kombu.Queue(quorum_route, durable=True)(connection.channel()).declare()
    stage_events(1, quorum_route)
    with Relay() as relay:
        relay.run(threading.Event(), drain=True)
    row = OutboxMessage.objects.get()
    assert row.attempts == 0  # a configuration error spends no attempt
    for text in (f"route {quorum_route!r}", f"queue {quorum_route!r}", "quorum", "delete_queue"):
        assert text in row.last_error
    assert "\n" not in row.last_error
    with pytest.raises(DeclareRefused, match="a queue's type cannot change"):
        InboxConsumer(quorum_route, Recorder(), "quorum").run(idle_timeout=2)
    result = manage(
        "run_outbox_consumer",
        *("--queue", quorum_route, "--handler", "tests.testapp.handlers.bill"),
        *("--idle-timeout", "3"),
        ROUTES={quorum_route: {"queue": quorum_route, "queue_type": "quorum"}},
    )
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert f"route {quorum_route!r} declares queue {quorum_route!r} as a quorum queue" in line


def test_a_quorum_queue_under_a_route_without_queue_type_is_refused_the_same_way():
    name = unique_destination("qc")
    with broker_connection() as connection:
        arguments = {"x-queue-type": "quorum"}
        kombu.Queue(name, durable=True, queue_arguments=arguments)(connection.channel()).declare()
    routes = {name: {"queue": name}}
    try:
        with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
            with pytest.raises(DeclareRefused) as refused:
                InboxConsumer(name, Recorder(), "quorum").run(idle_timeout=2)
    finally:
        delete_queue(name)
    assert f"route {name!r} declares queue {name!r} as a classic queue" in str(refused.value)


def test_a_quorum_queue_message_redelivered_max_deliveries_times_is_parked_unrun(
    quorum_route,
):
    """Three deliveries the inbox never saw (consumers that died before counting them)
    are in the broker's x-delivery-count: the fourth is parked without running."""
    stage_events(1, quorum_route)
    drain_relay()
    with broker_connection() as connection:
        queue = kombu.Queue(quorum_route, no_declare=True)(connection.channel())
        queue.channel.basic_qos(0, 1, False)
        for _ in range(3):
            message = wait_until(queue.get, timeout=30, what="the event")
            message.requeue()
    handler = Recorder()
    stats = InboxConsumer(quorum_route, handler, "quorum", max_deliveries=3).run(idle_timeout=2)
    assert stats.parked == 1
    assert handler.runs == [] and handler.failures == 0
    assert InboxFailure.objects.parked().get().attempts == 0  # the broker's count parked it


def database_open(allowed: bool) -> None:
    """Let connections to the test database in, or shut them out and end every one:
    to the consumer, an outage of its database. (From the server's maintenance
    database: PostgreSQL will not shut out the database one is connected to.)"""
    params = connection.get_connection_params()
    name = connection.settings_dict["NAME"]
    with psycopg.connect(**{**params, "dbname": "postgres"}, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
        if not allowed:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                [name],
            )


def test_requeues_while_the_database_is_down_do_not_park_a_quorum_queue_message(
    quorum_route,
):
    """The broker's x-delivery-count counts the requeues of a database outage too: the
    consumer leaves its own out, so the message is handled once the database is back."""
    stop = threading.Event()
    handler = Recorder()
    consumer = InboxConsumer(quorum_route, handler, "quorum", max_deliveries=2, stop=stop)
    run = ConsumerRun(consumer)  # its database outage's requeues are read below
    runner = threading.Thread(target=run.run)
    runner.start()
    try:
        database_open(False)
        try:
            publish_raw(quorum_route, n=1)
            wait_until(
                lambda: sum(run.outage.uncounted.values()) >= 3, timeout=60, what="3 requeues"
            )
        finally:
            database_open(True)
            connection.close()  # ended with the others
        wait_until(lambda: consumer.stats.handled == 1, timeout=60, what="the event handled")
    finally:
        stop.set()
        runner.join(timeout=60)
    assert consumer.stats.parked == 0
    assert not InboxFailure.objects.exists()
    assert not run.outage.uncounted  # forgotten once the message was acked


def test_a_parked_message_is_dead_lettered_to_the_route_dead_letter_exchange():
    name, dlx = unique_destination("qd"), unique_destination("dlx")
    routes = {name: {"queue": name, "queue_type": "quorum", "dead_letter_exchange": dlx}}
    with (
        override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}),
        broker_connection() as connection,
    ):
        exchange = kombu.Exchange(dlx, "fanout", durable=True)
        kombu.Queue(dlx, exchange, durable=True)(connection.channel()).declare()
        (event_id,) = stage_events(1, name)
        drain_relay()
        stats = InboxConsumer(
            name, Recorder(fail=lambda event: True), "quorum", max_deliveries=2, retry_delay=0.05
        ).run(idle_timeout=2)
        assert stats.parked == 1
        (dead,) = wait_until(lambda: drain_raw(dlx), timeout=30, what="the dead letter")
        assert dead.headers["event_id"] == event_id
        assert dead.headers["x-death"][0]["reason"] == "rejected"
        assert dead.headers["x-death"][0]["queue"] == name
        delete_queue(name)
        delete_queue(dlx)
        exchange(connection.channel()).delete()


def test_an_ordered_event_held_back_more_than_max_deliveries_times_is_not_parked():
    """a1 fails and is parked; a2, held back for it again and again, gathers an
    x-delivery-count well over max_deliveries. Once a1 is replayed and handled, a2
    runs: its holds were no failed deliveries."""
    name = unique_destination("qo")
    routes = {name: {"queue": name, "queue_type": "quorum", "ordered": True}}
    broken = threading.Event()
    broken.set()
    counts: list[object] = []

    def fail(event: ReceivedEvent) -> bool:
        counts.append(event.headers.get("x-delivery-count"))
        return broken.is_set() and event.sequence == 1

    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        publish(name, [("a", 1), ("a", 2)])
        stop = threading.Event()
        consumer = InboxConsumer(
            name,
            Recorder(fail),
            "quorum",
            max_deliveries=2,
            retry_delay=0.05,
            retry_max_delay=0.2,
            stop=stop,
        )
        runner = threading.Thread(target=consumer.run)
        runner.start()
        try:
            wait_until(lambda: consumer.stats.parked == 1, timeout=60, what="a1 parked")
            wait_until(lambda: consumer.stats.held >= 5, timeout=60, what="a2 held 5 times")
            broken.clear()
            replay_parked(InboxFailure.objects.all())
            wait_until(lambda: consumer.handler.of("a") == [1, 2], timeout=60, what="a1, a2")
        finally:
            stop.set()
            runner.join(timeout=60)
        delete_queue(name)
    assert consumer.stats.parked == 1  # a1 only
    assert not InboxFailure.objects.parked().exists()
    assert max(count for count in counts if isinstance(count, int)) >= 2


def test_a_running_relay_waits_its_start_jitter_before_the_first_claim(quorum_route, monkeypatch):
    """The jitter is drawn from random.uniform(0, START_JITTER); it is made to draw the
    whole START_JITTER here (the one stand-in of this file), so the wait is certain."""
    draws: list[tuple[float, float]] = []

    def uniform(low: float, high: float) -> float:
        draws.append((low, high))
        return high

    monkeypatch.setattr(random, "uniform", uniform)
    stage_events(1, quorum_route)
    stop = threading.Event()
    batches: list[object] = []
    with override_settings(OUTBOX={**outbox_settings.user_settings, "START_JITTER": 600}):
        relay = Relay()
        runner = threading.Thread(
            target=relay.run, args=(stop,), kwargs={"on_batch": batches.append}
        )
        runner.start()
        wait_until(lambda: (0, 600.0) in draws, timeout=30, what="the jitter drawn")
        time.sleep(0.5)  # a window in which a relay without jitter would have claimed
        stop.set()
        runner.join(timeout=30)
    assert not runner.is_alive()  # stop cuts the jitter short
    assert batches == []
    assert OutboxMessage.objects.get().status == OutboxMessage.Status.PENDING
