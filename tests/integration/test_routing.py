"""Routes that reach no queue, and queues the broker refuses to declare (issue 12, items 2
and 7): no row PUBLISHED that no queue received on any transport, and a refused declaration
that costs no attempt. The route checks, which need no broker, are in
tests/unit/test_route_checks.py."""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import kombu
import pytest
from django.db import transaction
from django.test.utils import override_settings
from django.utils import timezone

from django_outbox import stage
from django_outbox.exceptions import InvalidEvent
from django_outbox.models import OutboxMessage
from django_outbox.ops.checks import check_routes
from django_outbox.relay import Relay
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    broker_connection,
    consume,
    delete_queue,
    unique_destination,
)

Status = OutboxMessage.Status
BROKER = {"BROKER_URL": AMQP_URL}


@pytest.mark.django_db
def test_a_key_that_makes_the_routing_key_too_long_for_amqp_is_refused_by_stage():
    """The key is at most 255 characters, but the routing key it makes (with the route's
    own text, in UTF-8) must fit AMQP's 255 bytes; the relay abandoned such an event with
    "error: ubyte format requires 0 <= number <= 255"."""
    routes = {
        "orders": {"exchange": "shop", "routing_key": "order.{key}", "queue": "orders"},
        "tasks": {"celery_task": "tasks.handle"},
    }
    with override_settings(OUTBOX={**BROKER, "ROUTES": routes}):
        with pytest.raises(InvalidEvent) as raised:
            stage("order.placed", {}, destination="orders", key="é" * 125)
        assert str(raised.value) == (
            "event 'order.placed': its key makes the routing key of route 'orders' 256 bytes "
            "long, over AMQP's 255; use a shorter key"
        )
        # Nothing was written (no SQL ran), and these keys fit:
        routes_ok = [("orders", "é" * 124), ("tasks", "é" * 255), ("other", "é" * 255)]
        for destination, key in routes_ok:
            with transaction.atomic():
                stage("order.placed", {}, destination=destination, key=key)


# -- nothing PUBLISHED that no queue received ------------------------------------------------

pytestmark_db = pytest.mark.django_db(transaction=True, databases=["default", "other"])


@pytest.fixture(params=["amqp", "redis", "filesystem", "memory"])
def broker(request, tmp_path):
    """A broker URL and transport options of each kind the relay publishes to."""
    if request.param == "filesystem":
        folder = str(tmp_path / "data")
        options = {
            "data_folder_in": folder,
            "data_folder_out": folder,
            "control_folder": str(tmp_path / "control"),
        }
        (tmp_path / "data").mkdir()
        return "filesystem://", options
    url = {"amqp": AMQP_URL, "redis": REDIS_URL, "memory": "memory://"}[request.param]
    return url, {}


def bind_queue(url, options, queue, exchange, exchange_type, binding):
    with kombu.Connection(url, transport_options=options) as connection:
        kombu.Queue(
            queue, kombu.Exchange(exchange, exchange_type, durable=True), binding, durable=True
        )(connection.channel()).declare()


def read(url, options, queue, expected):
    if url.startswith(("amqp", "redis")):
        return consume(queue, expected, url=url, timeout=30)
    with kombu.Connection(url, transport_options=options) as connection:
        simple = connection.SimpleQueue(queue)
        messages = []
        while True:
            try:
                messages.append(simple.get(block=False))
            except simple.Empty:
                return messages


def all_due():
    OutboxMessage.objects.update(available_at=timezone.now())


@pytestmark_db
def test_a_message_no_queue_receives_fails_until_a_queue_is_bound(broker):
    url, options = broker
    destination = unique_destination()
    exchange = f"{destination}-x"
    routes = {destination: {"exchange": exchange, "routing_key": "order.placed"}}
    with transaction.atomic():
        for n in range(3):
            stage("order.placed", {"n": n}, destination=destination)
    outbox = {"BROKER_URL": url, "BROKER_TRANSPORT_OPTIONS": options, "ROUTES": routes}
    try:
        with override_settings(OUTBOX=outbox), Relay() as relay:
            stats = relay.run_once()
            assert (stats.published, stats.failed) == (0, 3)
            assert set(OutboxMessage.objects.values_list("status", "attempts", "last_error")) == {
                (
                    Status.FAILED,
                    1,
                    f"unroutable: no queue is bound to exchange {exchange!r} for routing key "
                    "'order.placed'",
                )
            }
            bind_queue(url, options, destination, exchange, "topic", "order.#")
            all_due()
            assert relay.run_once().published == 3
        assert len(read(url, options, destination, 3)) == 3
    finally:
        if url.startswith(("amqp", "redis")):
            delete_queue(destination, url=url)


@pytestmark_db
def test_a_direct_route_with_key_reaches_its_queue_only_without_a_key_on_redis():
    """The shape django_outbox.E008 reports, on Redis, where kombu dropped the message
    while the row was marked PUBLISHED."""
    destination = unique_destination()
    exchange = f"{destination}-x"
    spec = {"exchange": exchange, "exchange_type": "direct", "routing_key": "o.{key}"}
    routes = {destination: {**spec, "queue": destination}}
    with transaction.atomic():
        keyed = stage("order.placed", {"n": 1}, destination=destination, key="customer-7")
        plain = stage("order.placed", {"n": 2}, destination=destination)
    try:
        with override_settings(OUTBOX={"BROKER_URL": REDIS_URL, "ROUTES": routes}):
            with Relay() as relay:
                stats = relay.run_once()
        assert (stats.published, stats.failed) == (1, 1)
        keyed.refresh_from_db()
        plain.refresh_from_db()
        assert (plain.status, keyed.status) == (Status.PUBLISHED, Status.FAILED)
        assert keyed.last_error == (
            f"unroutable: no queue is bound to exchange {exchange!r} for routing key 'o.customer-7'"
        )
        assert len(consume(destination, 1, url=REDIS_URL, timeout=30)) == 1
    finally:
        delete_queue(destination, url=REDIS_URL)


# -- a queue the broker refuses to declare ---------------------------------------------------


@pytestmark_db
def test_a_queue_the_broker_refuses_costs_no_attempt_and_other_destinations_flow(caplog):
    refused, fine = unique_destination(), unique_destination()
    with broker_connection() as connection:
        kombu.Queue(refused, durable=True, queue_arguments={"x-max-length": 5})(
            connection.channel()
        ).declare()
    routes = {refused: {"exchange": "", "routing_key": refused, "queue": refused}}
    with transaction.atomic():
        for n in range(3):
            stage("a.b", {"n": n}, destination=refused)
            stage("a.b", {"n": n}, destination=fine)
    try:
        with override_settings(OUTBOX={**BROKER, "ROUTES": routes}):
            with caplog.at_level(logging.ERROR), Relay(batch_size=2) as relay:
                totals = [relay.run_once() for _ in range(3)]
        assert sum(s.published for s in totals) == 3
        assert not any(s.transport_failed for s in totals)
        records = [
            r for r in caplog.records if getattr(r, "action", "") == "outbox.declare_refused"
        ]
        assert len(records) == 1  # one per interval, though three batches were refused
        assert records[0].levelno == logging.ERROR
        assert records[0].queue == refused
        # RabbitMQ names the argument's type after the value ('long' or 'signedint').
        reason = (
            re.escape(
                f"the broker refused to declare queue {refused!r}: Queue.declare: (406) "
                f"PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue {refused!r} "
                "in vhost '/': received none but current is the value '5' of type '"
            )
            + r"\w+"
            + re.escape(
                "'; make the route's queue_arguments in OUTBOX['ROUTES'] match the existing "
                "queue, or delete it"
            )
        )
        assert re.fullmatch(
            re.escape(f"destination {refused!r}: ")
            + reason
            + re.escape(" (its rows wait, attempts unchanged, and are retried every 30s)"),
            records[0].getMessage(),
        )
        rows = OutboxMessage.objects.filter(destination=refused)
        assert {(row.status, row.attempts) for row in rows} == {(Status.FAILED, 0)}
        assert all(re.fullmatch(reason, row.last_error) for row in rows)
        assert all(25 < (row.available_at - timezone.now()).total_seconds() <= 30 for row in rows)
        assert len(consume(fine, 3, timeout=30)) == 3

        # Matching queue_arguments in ROUTES: the rows publish.
        routes[refused]["queue_arguments"] = {"x-max-length": 5}
        all_due()
        with override_settings(OUTBOX={**BROKER, "ROUTES": routes}), Relay() as relay:
            assert relay.run_once().published == 3
        assert set(rows.values_list("status", "attempts")) == {(Status.PUBLISHED, 0)}
        with broker_connection() as connection:  # passive: it exists with its arguments
            assert connection.channel().queue_declare(refused, passive=True).message_count == 3
    finally:
        delete_queue(refused)
        delete_queue(fine)


@pytestmark_db
def test_an_exchange_declared_with_another_type_is_refused_by_name(caplog):
    destination = unique_destination()
    exchange = f"{destination}-x"
    with broker_connection() as connection:
        kombu.Exchange(exchange, "fanout", durable=True)(connection.channel()).declare()
    routes = {destination: {"exchange": exchange, "queue": destination}}
    with transaction.atomic():
        stage("a.b", {"n": 1}, destination=destination)
    try:
        with override_settings(OUTBOX={**BROKER, "ROUTES": routes}), Relay() as relay:
            relay.run_once()
        row = OutboxMessage.objects.get()
        assert (row.status, row.attempts) == (Status.FAILED, 0)
        assert row.last_error.startswith(
            f"the broker refused to declare exchange {exchange!r}: Exchange.declare: (406) "
            "PRECONDITION_FAILED - inequivalent arg 'type'"
        )
        assert row.last_error.endswith(
            "make the route's exchange_type and exchange_arguments in OUTBOX['ROUTES'] match "
            "the existing exchange, or delete it"
        )
    finally:
        with broker_connection() as connection:
            kombu.Exchange(exchange)(connection.channel()).delete()


@pytestmark_db
@pytest.mark.parametrize("exchange_type", ["headers", "x-consistent-hash"])
def test_an_exchange_type_redis_lacks_is_refused_by_name_without_an_attempt(exchange_type):
    """kombu's virtual transports know direct, topic and fanout only: each batch failed
    with "KeyError: 'headers'", counting attempts until the rows were abandoned."""
    destination = unique_destination()
    exchange = f"{destination}-x"
    route = {"exchange": exchange, "exchange_type": exchange_type, "queue": destination}
    with transaction.atomic():
        stage("a.b", {"n": 1}, destination=destination)
    try:
        with override_settings(OUTBOX={"BROKER_URL": REDIS_URL, "ROUTES": {destination: route}}):
            with Relay() as relay:
                stats = relay.run_once()
        assert not stats.transport_failed
        row = OutboxMessage.objects.get()
        assert (row.status, row.attempts, row.last_error) == (
            Status.FAILED,
            0,
            f"the broker refused to declare exchange {exchange!r}: this kombu transport has "
            f"no exchange type {exchange_type!r}; make the route's exchange_type one of "
            "direct, fanout, topic",
        )
    finally:
        delete_queue(destination, url=REDIS_URL)


@pytestmark_db
def test_an_exchange_type_rabbitmq_does_not_know_is_refused_by_name_without_an_attempt():
    """A plugin's type, the plugin not enabled: RabbitMQ closes the connection (503), which
    counted as an outage, an attempt each batch, until the rows were abandoned."""
    destination = unique_destination()
    exchange = f"{destination}-x"
    route = {"exchange": exchange, "exchange_type": "x-no-such-type", "queue": destination}
    with transaction.atomic():
        stage("a.b", {"n": 1}, destination=destination)
    with override_settings(OUTBOX={**BROKER, "ROUTES": {destination: route}}), Relay() as relay:
        stats = relay.run_once()
    assert not stats.transport_failed
    row = OutboxMessage.objects.get()
    assert (row.status, row.attempts) == (Status.FAILED, 0)
    assert row.last_error.startswith(
        f"the broker refused to declare exchange {exchange!r}: Exchange.declare: (503) "
        "COMMAND_INVALID - unknown exchange type 'x-no-such-type'"
    )


@pytestmark_db
def test_a_destination_left_for_lack_of_lease_time_costs_no_attempt():
    """DESIGN guarantee 8: the relay's own "not attempted" failure counts no attempt."""
    destination = unique_destination()
    with transaction.atomic():
        stage("a.b", {"n": 1}, destination=destination)
    with override_settings(OUTBOX=BROKER), Relay() as relay:
        batches = relay.batches()
        claim = batches.claim()
        late = dataclasses.replace(claim, deadline=time.monotonic() - 1)
        stats = batches.report(batches.finalize(batches.publish(late, relay.outages())))
    row = OutboxMessage.objects.get()
    assert (stats.failed, stats.transport_failed) == (1, False)
    assert (row.status, row.attempts) == (Status.FAILED, 0)
    assert row.last_error.startswith("not attempted: the batch used half its lease")
    assert row.available_at <= timezone.now()


@pytestmark_db
def test_a_fanout_route_on_redis_loses_what_no_subscriber_hears_as_w003_warns():
    """Not a fix: the evidence behind django_outbox.W003. kombu's Redis fanout is PUB/SUB,
    so with its queue bound and no consumer connected the row is PUBLISHED and the queue
    (a Redis list) stays empty."""
    import redis

    destination = unique_destination()
    routes = {
        destination: {
            "exchange": f"{destination}-x",
            "exchange_type": "fanout",
            "queue": destination,
        }
    }
    with transaction.atomic():
        row = stage("a.b", {"n": 1}, destination=destination)
    with override_settings(OUTBOX={"BROKER_URL": REDIS_URL, "ROUTES": routes}):
        with Relay() as relay:
            assert relay.run_once().published == 1
        assert [c.id for c in check_routes()] == ["django_outbox.W003"]
    row.refresh_from_db()
    assert row.status == Status.PUBLISHED
    client = redis.Redis.from_url(REDIS_URL)
    try:
        assert client.llen(destination) == 0
    finally:
        client.close()


# -- a destination only the default route knows (issue 42) -----------------------------------


@pytestmark_db
def test_a_destination_only_the_default_route_knows_is_logged_once_per_process(caplog):
    """A typo of a destination ('order' for 'orders') declares and fills a queue nobody
    reads: the relay says so the first time it publishes it, and only then."""
    typo, named = unique_destination("order"), unique_destination("orders")
    routes = {named: {"queue": named}}
    try:
        with override_settings(OUTBOX={**BROKER, "ROUTES": routes}):
            for _ in range(2):  # two batches, and two relays, of one process
                with transaction.atomic():
                    stage("order.placed", {}, destination=typo)
                    stage("order.placed", {}, destination=named)
                with caplog.at_level(logging.WARNING), Relay() as relay:
                    assert relay.run_once().published == 2
        records = [r for r in caplog.records if getattr(r, "action", "") == "outbox.default_route"]
        assert [(r.levelno, r.destination) for r in records] == [(logging.WARNING, typo)]
        assert records[0].getMessage() == (
            f"destination {typo!r} is not in OUTBOX['ROUTES']: the default route publishes it "
            f"to queue {typo!r} (exchange 'outbox'); if that is a typo, no consumer reads it. "
            "Name your destinations in ROUTES and set OUTBOX['DEFAULT_ROUTE'] = False to "
            "refuse unknown ones at stage time"
        )
    finally:
        delete_queue(typo)
        delete_queue(named)
