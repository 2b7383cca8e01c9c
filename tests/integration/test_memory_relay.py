"""The relay publishing through the in-memory transport, against the real database."""

from __future__ import annotations

import sys
import threading

import pytest
from django.test import override_settings

from django_outbox.models import OutboxMessage
from django_outbox.relay.loop import SWITCH_INTERVAL, Relay
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
