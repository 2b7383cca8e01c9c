"""The in-memory transport on its own: no database, no broker."""

from __future__ import annotations

import uuid

import pytest

from django_outbox.conf.routes import Route
from django_outbox.transports import Transport, transport_class
from django_outbox.transports.memory import MemoryTransport, clear, sent
from tests.support import claimed_message

ORDERS = Route("orders", "outbox", "topic", "orders", "orders")
EMAILS = Route("emails", celery_task="shop.tasks.send_receipt")
FANOUT = Route("audit", "audit", "fanout", "audit", None)


@pytest.fixture(autouse=True)
def _empty_store():
    clear()
    yield
    clear()


def test_every_message_is_kept_in_publish_order_and_confirmed():
    transport = MemoryTransport(alias="events")
    first, second = [claimed_message(1), claimed_message(2)], [claimed_message(3, "emails")]
    assert transport.publish(ORDERS, first) == [None, None]
    assert transport.publish(EMAILS, second) == [None]
    events = sent("events")
    assert [e.event_id for e in events] == [m.event_id for m in first + second]
    assert [e.payload for e in events] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert events[0].headers["tenant"] == "t1"
    assert events[0].headers["ordering_key"] == "order-1"
    assert [e.destination for e in events] == ["orders", "orders", "emails"]


def test_messages_are_kept_per_alias_and_queue():
    MemoryTransport(alias="default").publish(ORDERS, [claimed_message(1)])
    MemoryTransport(alias="events").publish(FANOUT, [claimed_message(2, "audit")])
    MemoryTransport(alias="events").publish(ORDERS, [claimed_message(3)])
    assert [e.payload["n"] for e in sent("default")] == [1]
    assert [e.payload["n"] for e in sent("events", queue="orders")] == [3]
    # A route that declares no queue keeps its events under its destination.
    assert [e.payload["n"] for e in sent("events", queue="audit")] == [2]
    assert sent("nowhere") == []


def test_clear_forgets_one_alias_or_all_and_transports_keep_working():
    default, events = MemoryTransport(), MemoryTransport(alias="events")
    default.publish(ORDERS, [claimed_message(1)])
    events.publish(ORDERS, [claimed_message(2)])
    clear("events")
    assert ([len(sent()), len(sent("events"))]) == [1, 0]
    clear()
    default.publish(ORDERS, [claimed_message(3)])  # built before clear(): still seen
    assert [e.payload["n"] for e in sent()] == [3]


def test_a_store_of_its_own_leaves_the_process_wide_one_alone():
    mine: list = []
    MemoryTransport(store=mine).publish(ORDERS, [claimed_message(1)])
    assert [event.payload for _, event in mine] == [{"n": 1}]
    assert sent() == []


def test_the_flags_say_what_it_does():
    assert issubclass(MemoryTransport, Transport)
    assert MemoryTransport.supports_confirms is True
    assert MemoryTransport.supports_batch is False
    assert MemoryTransport.reports_unroutable is True
    assert transport_class("memory") is MemoryTransport


def test_with_a_memory_url_an_unroutable_message_fails_and_is_not_kept():
    """Through kombu's in-process memory broker: a fanout exchange nothing is bound to
    reaches no queue, as on RabbitMQ or Redis."""
    transport = MemoryTransport("memory://", alias="mem")
    exchange = f"x-{uuid.uuid4().hex}"
    route = Route("lonely", exchange, "topic", "lonely", None)
    (outcome,) = transport.publish(route, [claimed_message(1, "lonely")])
    assert outcome is not None and outcome.error.startswith("unroutable: no queue is bound")
    assert sent("mem") == []
    transport.check()  # this process: always reachable
    transport.close()
