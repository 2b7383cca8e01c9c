"""Where each transport says a route's messages go (``Transport.target``): the relay's
warning about a destination on the default route names a queue, a topic or a subject."""

from __future__ import annotations

import pytest

from django_outbox.conf.routes import JetStream, Route
from django_outbox.transports import transport_class


@pytest.mark.parametrize(
    ("url", "route", "target"),
    [
        (
            "amqp://127.0.0.1//",
            Route("orders", exchange="outbox", queue="orders"),
            "queue 'orders' (exchange 'outbox')",
        ),
        ("kafka://127.0.0.1:9092", Route("orders"), "topic 'orders'"),
        ("kafka://127.0.0.1:9092", Route("orders", topic="sales"), "topic 'sales'"),
        ("nats://127.0.0.1:4222", Route("orders.eu"), "subject 'orders.eu' (stream 'orders_eu')"),
        (
            "nats://127.0.0.1:4222",
            Route("orders", jetstream=JetStream(subject="shop.orders", stream="SHOP")),
            "subject 'shop.orders' (stream 'SHOP')",
        ),
    ],
    ids=["rabbitmq", "kafka", "kafka-topic", "nats", "nats-stream"],
)
def test_each_transport_names_where_a_route_goes(url, route, target):
    transport = transport_class(url.partition(":")[0])(url)
    try:
        assert transport.target(route) == target
    finally:
        transport.close()
