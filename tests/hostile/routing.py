"""Triggers for the sections "Messages no queue would receive" and "Queues the broker
refuses to declare" of docs/hostile-input.md."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kombu
from django.db import transaction
from django.test import override_settings

from django_outbox import stage
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    broker_connection,
    delete_queue,
    manage,
    unique_destination,
)

from . import case
from .settings import check_lines, only
from .staging import _staged


def _shape(**route: Any) -> str:
    """The one check line ``manage.py check`` gives for ROUTES = {"orders": route}."""
    url = route.pop("url", AMQP_URL)
    return only(check_lines(BROKER_URL=url, ROUTES={"orders": route}))


@case("route-direct-with-key")
def route_direct_with_key(request: object) -> str:
    return _shape(exchange="shop", exchange_type="direct", routing_key="order.{key}", queue="o")


@case("route-default-exchange-key")
def route_default_exchange_key(request: object) -> str:
    return _shape(exchange="", routing_key="order.placed", queue="orders")


@case("route-without-queue")
def route_without_queue(request: object) -> str:
    return _shape(exchange="shop", routing_key="order.placed")


@case("route-fanout-on-redis")
def route_fanout_on_redis(request: object) -> str:
    return _shape(url=REDIS_URL, exchange="news", exchange_type="fanout", queue="news")


def _relayed(url: str, route: dict[str, Any]) -> OutboxMessage:
    """Stage one event to a fresh destination of ``route``, relay it once; the row."""
    destination = unique_destination()
    with transaction.atomic():
        row = stage("order.placed", {"id": 1}, destination=destination)
    with override_settings(OUTBOX={"BROKER_URL": url, "ROUTES": {destination: route}}):
        with Relay() as relay:
            relay.run_once()
    row.refresh_from_db()
    return row


@case("unroutable-rabbitmq")
def unroutable_rabbitmq(request: object) -> str:
    row = _relayed(AMQP_URL, {"exchange": unique_destination(), "routing_key": "order.placed"})
    assert (row.status, row.attempts) == (OutboxMessage.Status.FAILED, 1)
    return row.last_error


@case("unroutable-redis")
def unroutable_redis(request: object) -> str:
    row = _relayed(REDIS_URL, {"exchange": unique_destination(), "routing_key": "order.placed"})
    assert (row.status, row.attempts) == (OutboxMessage.Status.FAILED, 1)
    return row.last_error


@contextmanager
def _existing_queue(**arguments: Any) -> Iterator[str]:
    """A queue that already exists on RabbitMQ with ``arguments``."""
    queue = unique_destination()
    with broker_connection() as connection:
        kombu.Queue(queue, durable=True, queue_arguments=arguments)(connection.channel()).declare()
    try:
        yield queue
    finally:
        delete_queue(queue)


@case("queue-refused-relay")
def queue_refused_relay(request: Any) -> str:
    caplog = request.getfixturevalue("caplog")
    with _existing_queue(**{"x-max-length": 5}) as queue:
        route = {"exchange": "", "routing_key": queue, "queue": queue}
        with caplog.at_level(logging.ERROR, logger="django_outbox"):
            row = _relayed(AMQP_URL, route)
    assert (row.status, row.attempts) == (OutboxMessage.Status.FAILED, 0)
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "outbox.declare_refused"]
    return record.getMessage()


@case("queue-refused-consumer")
def queue_refused_consumer(request: object) -> str:
    with _existing_queue(**{"x-max-length": 5}) as queue:
        result = manage(
            "run_outbox_consumer",
            *("--queue", queue, "--handler", "tests.testapp.handlers.record", "--consumer", "c"),
        )
    assert result.returncode == 1
    return result.stderr.strip()


@case("exchange-refused")
def exchange_refused(request: object) -> str:
    exchange = unique_destination()
    with broker_connection() as connection:
        kombu.Exchange(exchange, "fanout", durable=True)(connection.channel()).declare()
    try:
        row = _relayed(AMQP_URL, {"exchange": exchange, "routing_key": "order.placed"})
    finally:
        with broker_connection() as connection:
            kombu.Exchange(exchange)(connection.channel()).delete()
    assert (row.status, row.attempts) == (OutboxMessage.Status.FAILED, 0)
    return row.last_error


@case("exchange-type-not-on-redis")
def exchange_type_not_on_redis(request: object) -> str:
    exchange = unique_destination()
    route = {"exchange": exchange, "exchange_type": "headers", "queue": exchange}
    try:
        return _relayed(REDIS_URL, route).last_error
    finally:
        delete_queue(exchange, url=REDIS_URL)


@case("route-arguments-not-a-dict")
def route_arguments_not_a_dict(request: object) -> str:
    return _shape(queue="orders", queue_arguments=["x-max-length", 10])


@case("routing-key-too-long")
def routing_key_too_long(request: object) -> str:
    route = {"exchange": "shop", "routing_key": "order.{key}", "queue": "orders"}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": {"orders": route}}):
        return _staged(key="é" * 125)
