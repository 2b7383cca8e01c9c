"""Partition queues of an ordered route (issue 14): the route option, the consumer's
--partitions option and which queues a consumer takes. No services."""

from __future__ import annotations

import argparse

import pytest

from django_outbox.conf.routes import Route, parse_routes
from django_outbox.consumer.loop import _queues_to_take
from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.ops.cli import partition_numbers


def route(**spec) -> Route:
    return parse_routes({"orders": {"queue": "orders", **spec}}, "outbox")["orders"]


def test_a_partitioned_route_names_its_exchange_and_queues():
    orders = route(ordered=True, partitions=3)
    assert orders.partitions == 3
    assert orders.partition_exchange == "orders.partitions"
    assert orders.partition_queues == ("orders.0", "orders.1", "orders.2")
    assert route(ordered=True).partition_queues == ()


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ({"partitions": 4}, "route 'orders' has partitions but is not ordered"),
        ({"ordered": True, "partitions": 0}, "route 'orders' partitions must be 1-1024; got 0"),
        ({"ordered": True, "partitions": 2000}, "partitions must be 1-1024; got 2000"),
        ({"ordered": True, "partitions": "4"}, "key 'partitions' must be a whole number; got str"),
        ({"ordered": True, "partitions": True}, "must be a whole number; got bool"),
        (
            {"ordered": True, "partitions": 4, "exchange": ""},
            """route 'orders' has partitions on the default exchange "": name an exchange""",
        ),
        (
            {"ordered": True, "partitions": 4, "queue": None},
            "route 'orders' has partitions but no queue: name the queue",
        ),
    ],
)
def test_bad_partitions_are_one_line_errors(spec, error):
    with pytest.raises(ValueError, match="^" + "[^\n]*" + error.replace("(", r"\(")) as caught:
        route(**spec)
    assert "\n" not in str(caught.value)


def test_partitions_on_a_celery_route_say_so_rather_than_ask_for_ordered():
    spec = {"celery_task": "billing.charge", "partitions": 4}
    with pytest.raises(ValueError, match=r"^route 'charges' has partitions but sends Celery tasks"):
        parse_routes({"charges": spec}, "outbox")


@pytest.mark.parametrize(
    ("text", "numbers"),
    [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0-1,8", (0, 1, 8)), (" 2 , 5-6", (2, 5, 6))],
)
def test_partition_numbers_are_read_with_ranges(text, numbers):
    assert partition_numbers(text) == numbers


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "1-", "1,,2", "1.5"])
def test_bad_partition_numbers_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="partition numbers such as 0-3,8"):
        partition_numbers(text)


def test_a_consumer_takes_the_partitions_it_is_given_or_all_of_them():
    orders = route(ordered=True, partitions=4)
    assert _queues_to_take(orders, "orders", None) == orders.partition_queues
    assert _queues_to_take(orders, "orders", [3, 1, 3]) == ("orders.1", "orders.3")
    assert _queues_to_take(orders, "orders.2", None) == ("orders.2",)
    assert _queues_to_take(route(), "orders", None) == ("orders",)


@pytest.mark.parametrize(
    ("spec", "queue", "partitions", "error"),
    [
        ({"ordered": True, "partitions": 4}, "orders", [4, 7], "has partitions 0-3; got 4, 7"),
        ({"ordered": True, "partitions": 4}, "orders", [], "has partitions 0-3; got none"),
        ({"ordered": True}, "orders", [0], "is not the queue of a route with partitions"),
        ({"ordered": True, "partitions": 4}, "orders.1", [0], "is not the queue of a route"),
    ],
)
def test_partitions_a_route_does_not_have_are_refused(spec, queue, partitions, error):
    with pytest.raises(OutboxConfigurationError, match=error):
        _queues_to_take(route(**spec), queue, partitions)
