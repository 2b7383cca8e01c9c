"""The relay publishing through the in-memory transport, against the real database."""

from __future__ import annotations

import sys
import threading

import pytest
from django.test import override_settings

from django_outbox.models import OutboxMessage
from django_outbox.relay.loop import SWITCH_INTERVAL, Relay
from django_outbox.signals import event_published
from django_outbox.transports import memory
from tests.support import stage_events, unique_destination


@pytest.fixture(autouse=True)
def _empty_store():
    memory.clear()
    yield
    memory.clear()


@pytest.mark.django_db(transaction=True)
def test_a_relay_on_memory_brokers_keeps_each_event_by_alias_and_queue():
    orders, audit = unique_destination("orders"), unique_destination("audit")
    outbox = {
        "BROKERS": {"default": {"URL": "memory://"}, "side": {"URL": "memory://"}},
        "ROUTES": {
            orders: {"queue": orders},
            audit: {"queue": audit, "broker": "side"},
        },
    }
    with override_settings(OUTBOX=outbox):
        order_ids = stage_events(3, orders)
        audit_ids = stage_events(2, audit)
        totals = Relay().run(threading.Event(), drain=True)
    assert (totals.published, totals.failed) == (5, 0)
    assert [str(e.event_id) for e in memory.sent("default", queue=orders)] == order_ids
    assert [str(e.event_id) for e in memory.sent("side", queue=audit)] == audit_ids
    assert memory.sent("side", queue=orders) == []
    first = memory.sent("default")[0]
    assert (first.event_type, first.payload, first.destination) == ("test.event", {"n": 0}, orders)
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {"published"}


@pytest.mark.django_db(transaction=True)
def test_an_unroutable_message_fails_on_the_memory_broker_as_on_any_other():
    lonely = unique_destination("lonely")
    outbox = {
        "BROKER_URL": "memory://",
        "ROUTES": {lonely: {"exchange": f"x-{lonely}"}},  # no queue, nothing bound
    }
    with override_settings(OUTBOX=outbox):
        stage_events(2, lonely)
        with Relay() as relay:
            stats = relay.run_once()
    assert (stats.published, stats.failed) == (0, 2)
    assert memory.sent() == []
    (error,) = set(OutboxMessage.objects.values_list("last_error", flat=True))
    assert error.startswith("unroutable: no queue is bound to exchange")


@pytest.mark.django_db(transaction=True)
def test_a_running_relay_switches_threads_quickly_and_sets_the_interval_back():
    """While ``Relay.run`` runs, the interpreter switches threads every millisecond at
    most (its database threads get the GIL back soon after their statement returns);
    the interval before it is set back when it returns."""
    destination = unique_destination("orders")
    seen = []
    before = sys.getswitchinterval()
    assert before > SWITCH_INTERVAL  # CPython's default, 5 ms
    outbox = {"BROKERS": {"default": {"URL": "memory://"}}, "ROUTES": {destination: {}}}
    with override_settings(OUTBOX=outbox):
        stage_events(2, destination)
        Relay().run(
            threading.Event(), drain=True, on_batch=lambda _: seen.append(sys.getswitchinterval())
        )
    assert seen and set(seen) == {SWITCH_INTERVAL}
    assert sys.getswitchinterval() == before


class EncodingAhead(memory.MemoryTransport):
    """Encodes each message (its payload's text) and says on which thread; publishes the
    form it reads back, so a form prepared for another message would show."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []
        self.forms: list[str] = []

    def encoder(self, route):
        def encode(message):
            self.threads.append(threading.current_thread().name)
            return message.payload

        return encode

    def publish(self, route, messages):
        encode = self.encoder(route)
        self.forms += [self.encoded(route, message, encode) for message in messages]
        return super().publish(route, messages)


@pytest.mark.django_db(transaction=True)
def test_a_relay_encodes_each_message_once_ahead_on_its_claim_thread():
    """The claims made ahead prepare their batch's wire forms on the claim thread while the
    relay's thread publishes the batch before; only the first claim is the relay's own."""
    orders = unique_destination("orders")
    transport, kept = EncodingAhead(), []

    def receiver(messages, **_):
        kept.extend(message.encoded for message in messages)

    event_published.connect(receiver)
    try:
        with override_settings(OUTBOX={"BROKER_URL": "memory://", "ROUTES": {orders: {}}}):
            stage_events(1000, orders)
            relay = Relay(batch_size=100, transports={"default": transport})
            totals = relay.run(threading.Event(), drain=True)
    finally:
        event_published.disconnect(receiver)
    assert totals.published == 1000
    assert kept == [None] * 1000  # the forms go no further than the publish
    assert transport.forms == [f'{{"n": {n}}}' for n in range(1000)]
    assert len(transport.threads) == 1000  # once each: none encoded again by the publish
    ahead = sum(name.startswith("outbox-claim") for name in transport.threads)
    assert ahead >= 900, f"{ahead} of 1000 encoded on the claim thread"
