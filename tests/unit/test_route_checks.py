"""Route checks and route parsing (issue 12, items 2 and 7): route shapes that cannot deliver
are system check errors or warnings, and malformed queue/exchange arguments are E004. No
services: the checks read settings only."""

from __future__ import annotations

import dataclasses

import pytest
from django.core import checks
from django.test.utils import override_settings

import django_outbox.conf.settings as conf_settings
from django_outbox.conf import outbox_settings
from django_outbox.ops.checks import check_routes, check_settings
from tests.support import AMQP_URL, REDIS_URL

BROKER = {"BROKER_URL": AMQP_URL}


def route_checks(routes, url=AMQP_URL):
    with override_settings(OUTBOX={"BROKER_URL": url, "ROUTES": routes}):
        return check_routes()


def test_a_direct_route_with_key_in_its_routing_key_can_never_reach_its_queue():
    routes = {"orders": {"exchange": "shop", "exchange_type": "direct", "routing_key": "o.{key}"}}
    routes["orders"]["queue"] = "orders"
    assert route_checks(routes) == [
        checks.Error(
            "Route 'orders' binds queue 'orders' to direct exchange 'shop' with 'o.', so an "
            "event staged with a key (routing key 'o.{key}') never reaches it.",
            hint='Use exchange_type "topic" (the queue is then bound with # in place of {key}), '
            "or take {key} out of routing_key.",
            id="django_outbox.E008",
        )
    ]


def test_the_default_exchange_delivers_only_to_the_queue_named_by_the_routing_key():
    routes = {"orders": {"exchange": "", "routing_key": "orders.placed", "queue": "orders"}}
    assert route_checks(routes) == [
        checks.Error(
            "Route 'orders' publishes to the default exchange \"\" with routing key "
            "'orders.placed', which delivers to the queue of that name, never to its queue "
            "'orders'.",
            hint="On the default exchange the routing key is the queue name: set routing_key to "
            "'orders', or name an exchange.",
            id="django_outbox.E009",
        )
    ]


def test_a_route_without_a_queue_is_a_warning():
    assert route_checks({"audit": {"exchange": "events"}}) == [
        checks.Warning(
            "Route 'audit' declares no queue: its events reach only queues that others bind to "
            "exchange 'events'; until one is bound they fail and are retried.",
            hint="Give the route a queue, or make sure consumers bind theirs before events are "
            'staged (then silence this with SILENCED_SYSTEM_CHECKS = ["django_outbox.W002"]).',
            id="django_outbox.W002",
        )
    ]


def test_a_fanout_route_on_redis_is_a_warning_not_on_rabbitmq():
    routes = {"news": {"exchange": "news", "exchange_type": "fanout", "queue": "news"}}
    assert route_checks(routes) == []
    assert route_checks(routes, url=REDIS_URL) == [
        checks.Warning(
            "Route 'news' uses fanout exchange 'news' on Redis, where kombu delivers fanout by "
            "PUB/SUB: an event reaches only the consumers connected at that moment and is "
            "lost, though PUBLISHED, when none is.",
            hint='Use a "topic" or "direct" exchange with a queue per consumer group, or RabbitMQ.',
            id="django_outbox.W003",
        )
    ]


def test_partitions_on_a_broker_other_than_rabbitmq_are_an_error():
    routes = {"orders": {"queue": "orders", "ordered": True, "partitions": 4}}
    assert route_checks(routes) == []
    for url, scheme in ((REDIS_URL, "redis"), ("memory://", "memory")):
        [error] = route_checks(routes, url)
        assert error.id == "django_outbox.E017"
        assert error.msg == (
            f"Route 'orders' has partitions, but its broker is {scheme}://, which has no "
            "consistent-hash exchange: neither the relay nor run_outbox_consumer can declare them."
        )
        assert "\n" not in error.msg


@pytest.mark.parametrize(
    "route",
    [
        {},  # the exchange DEFAULT_EXCHANGE, routing key = destination, no queue: see W002
        {"exchange": "shop", "routing_key": "order.{key}", "queue": "orders"},  # topic: # bound
        {"exchange": "shop", "exchange_type": "direct", "routing_key": "o.placed", "queue": "o"},
        {"exchange": "", "routing_key": "orders", "queue": "orders"},
        {"exchange": "", "routing_key": "somebody-elses-queue"},
        {
            "exchange": "h",
            "exchange_type": "x-consistent-hash",
            "routing_key": "{key}",
            "queue": "q",
        },
        {"celery_task": "mail.tasks.send"},
    ],
)
def test_routes_that_can_deliver_pass(route):
    found = route_checks({"orders": route})
    assert [c.id for c in found] == (["django_outbox.W002"] if route == {} else [])


def test_an_invalid_routes_setting_is_reported_once_by_the_settings_check():
    assert route_checks({"orders": {"queue_arguments": "x"}}) == []


def test_route_arguments_are_parsed_sorted_and_hashable():
    spec = {
        "queue": "orders",
        "queue_arguments": {"x-queue-type": "quorum", "x-max-length": 10},
        "exchange_arguments": {"alternate-exchange": "lost"},
    }
    with override_settings(OUTBOX={**BROKER, "ROUTES": {"orders": spec}}):
        route = outbox_settings.route_for("orders")
    assert route.queue_arguments == (("x-max-length", 10), ("x-queue-type", "quorum"))
    assert route.exchange_arguments == (("alternate-exchange", "lost"),)
    assert {route, dataclasses.replace(route)} == {route}


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (
            {"queue_arguments": ["x-max-length", 10]},
            "route 'orders' queue_arguments must be a dict such as {'x-max-length': 10000}; "
            "got list",
        ),
        (
            {"exchange_arguments": {"x-args": {"nested": 1}}},
            "route 'orders' exchange_arguments['x-args'] must be a string, number or boolean; "
            "got dict",
        ),
        (
            {"queue_arguments": {3: "x"}},
            "route 'orders' queue_arguments has a name that is not a string: 3",
        ),
        # py-amqp cannot frame a name over 255 bytes: the relay failed every batch with
        # "error: ubyte format requires 0 <= number <= 255" until the rows were abandoned.
        (
            {"exchange": "é" * 128},
            "route 'orders' exchange is 256 bytes long; AMQP takes at most 255",
        ),
        (
            {"queue": "q" * 256},
            "route 'orders' queue is 256 bytes long; AMQP takes at most 255",
        ),
    ],
)
def test_malformed_route_arguments_are_e004(spec, reason):
    with override_settings(OUTBOX={**BROKER, "ROUTES": {"orders": spec}}):
        (error,) = check_settings()
    assert error == checks.Error(
        f'OUTBOX["ROUTES"] is invalid: {reason}.',
        hint="See the ROUTES entry of the settings reference in docs/reference/settings.md.",
        id="django_outbox.E004",
    )


def test_a_setting_read_is_kept_until_the_settings_change():
    """A setting read once is an attribute of the instance (staging reads the routes
    per event); a change of OUTBOX, as override_settings makes, is read afresh."""
    with override_settings(OUTBOX={**BROKER, "BATCH_SIZE": 7}):
        assert outbox_settings.BATCH_SIZE == 7
        assert vars(outbox_settings)["BATCH_SIZE"] == 7
        with override_settings(OUTBOX={**BROKER, "BATCH_SIZE": 9}):
            assert "BATCH_SIZE" not in vars(outbox_settings)
            assert outbox_settings.BATCH_SIZE == 9
        assert outbox_settings.BATCH_SIZE == 7


def test_the_route_of_an_unnamed_destination_is_built_once_and_follows_the_settings():
    destination = "orders.unnamed"
    with override_settings(OUTBOX={**BROKER, "DEFAULT_EXCHANGE": "first"}):
        route = outbox_settings.route_for(destination)
        assert route is not None and route.exchange == "first"
        assert outbox_settings.route_for(destination) is route
        with override_settings(OUTBOX={**BROKER, "DEFAULT_EXCHANGE": "second"}):
            assert outbox_settings.route_for(destination).exchange == "second"  # type: ignore[union-attr]
        with override_settings(OUTBOX={**BROKER, "DEFAULT_ROUTE": False}):
            assert outbox_settings.route_for(destination) is None
            assert outbox_settings.route_for("django.tasks:default").celery_task  # type: ignore[union-attr]


def test_the_routes_of_unnamed_destinations_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(conf_settings, "MAX_UNNAMED_ROUTES", 3)
    with override_settings(OUTBOX=BROKER):
        for n in range(10):
            assert outbox_settings.route_for(f"d{n}").queue == f"d{n}"  # type: ignore[union-attr]
        assert len(outbox_settings._cache["unnamed_routes"]) <= 3
