"""The relay's side of the transport seam, without services: which transport a route
gets, and a missing broker refused as OutboxConfigurationError before any batch."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
from django.test import override_settings

from django_outbox.conf.routes import Route
from django_outbox.consumer import InboxConsumer
from django_outbox.exceptions import BrokerUnreachable, OutboxConfigurationError
from django_outbox.relay import Relay
from django_outbox.transports.kombu import AmqpTransport, RedisTransport
from django_outbox.transports.memory import MemoryTransport

RABBIT = "amqp://guest:s3cret@rabbit:5672//"
REDIS = "redis://:s3cret@redis:6379/0"
TWO = {
    "BROKERS": {"default": {"URL": RABBIT}, "events": {"URL": REDIS}},
    "ROUTES": {"orders": {"queue": "orders"}, "clicks": {"queue": "clicks", "broker": "events"}},
}


@override_settings(OUTBOX=TWO)
def test_each_route_gets_the_transport_of_its_brokers_scheme():
    with Relay() as relay:
        orders = relay.transport(Route("orders", "outbox", queue="orders"))
        clicks = relay.transport(Route("clicks", "outbox", queue="clicks", broker="events"))
        assert isinstance(orders, AmqpTransport) and isinstance(clicks, RedisTransport)
        assert relay.transport(Route("x", "outbox")) is orders  # one per alias
        assert set(relay.publisher.transports) == {"default", "events"}


@override_settings(OUTBOX=TWO)
def test_the_drain_that_gives_up_names_the_broker_masked():
    with Relay() as relay:
        cause = ConnectionRefusedError(111, "Connection refused")
        named = BrokerUnreachable("broker 'events' (...): ...")
        named.__cause__ = cause
        assert relay.publisher.unreachable("events", named) == (
            "the broker 'events' (redis://:***@redis:6379/0) is unreachable "
            "(ConnectionRefusedError: [Errno 111] Connection refused)"
        )
        unreachable = relay.publisher.unreachable("celery", cause)
        assert unreachable.startswith("Celery's broker is unreachable")


@override_settings(OUTBOX={"BROKER_URL": RABBIT})
def test_the_short_form_keeps_its_text():
    with Relay() as relay:
        error = ConnectionRefusedError(111, "Connection refused")
        assert relay.publisher.unreachable("default", error) == (
            "the broker amqp://guest:***@rabbit:5672// is unreachable "
            "(ConnectionRefusedError: [Errno 111] Connection refused)"
        )


@override_settings(OUTBOX={}, CELERY_BROKER_URL=None)
def test_no_broker_at_all_is_refused_by_the_relay_and_the_consumer():
    with pytest.raises(OutboxConfigurationError, match=r"^django_outbox\.E006: No broker URL"):
        Relay()
    with pytest.raises(OutboxConfigurationError, match=r"^django_outbox\.E006: No broker URL"):
        InboxConsumer("orders", print, "c")


@override_settings(OUTBOX={"BROKER_URL": RABBIT, "ROUTES": {"c": {"broker": "events"}}})
def test_a_route_naming_no_broker_is_refused_at_start():
    with pytest.raises(OutboxConfigurationError) as raised:
        Relay()
    assert str(raised.value).startswith(
        "django_outbox.E015: No broker 'events' in OUTBOX[\"BROKERS\"]; the only broker "
        "configured is 'default'."
    )


@override_settings(OUTBOX={"BROKER_URL": RABBIT, "ROUTES": {"emails": {"celery_task": "t"}}})
def test_celery_routes_without_celery_are_refused_at_start_naming_the_extra():
    with mock.patch.dict(sys.modules, {"celery": None}):
        with pytest.raises(OutboxConfigurationError) as raised:
            Relay()
        # Given a transport for the Celery routes (drain() does), nothing needs celery.
        Relay(transports={"celery": MemoryTransport(store=[])}).close()
    assert str(raised.value) == (
        "django_outbox.E016: Routes ['emails'] send Celery tasks (celery_task), which requires "
        'the celery package: pip install "django-transactional-outbox[celery]"'
    )


@override_settings(OUTBOX=TWO)
def test_a_consumer_reads_from_the_broker_of_its_queue_or_the_one_it_names():
    assert InboxConsumer("clicks", print, "c").url == REDIS
    assert InboxConsumer("orders", print, "c").url == RABBIT
    assert InboxConsumer("orders", print, "c", broker="events").url == REDIS
    with pytest.raises(OutboxConfigurationError, match=r"^django_outbox\.E015: "):
        InboxConsumer("orders", print, "c", broker="nope")


@override_settings(OUTBOX={"BROKER_URL": RABBIT})
def test_a_transport_given_under_a_key_that_is_no_broker_is_refused():
    # Under "broker" (the key before OUTBOX["BROKERS"]) the relay would ignore it and
    # publish through a transport built from BROKER_URL instead.
    with pytest.raises(OutboxConfigurationError) as raised:
        Relay(transports={"broker": MemoryTransport(store=[])})
    assert str(raised.value) == (
        "Relay(transports=...) has no broker 'broker': its keys are broker aliases "
        "(default) or 'celery'"
    )
    Relay(transports={"default": MemoryTransport(store=[])}).close()
