"""The route options ``queue_type`` and ``dead_letter_exchange`` (issue 15, item 1): what
they declare, what they refuse with one line, and the check E018 for a quorum queue on a
broker without queue types; START_JITTER's values. No services: settings only."""

from __future__ import annotations

import pytest
from django.test.utils import override_settings

from django_outbox.conf import from_env, outbox_settings
from django_outbox.conf.routes import parse_routes
from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.ops.checks import check_routes
from tests.support import AMQP_URL, REDIS_URL


def route(**spec):
    return parse_routes({"orders": spec}, "outbox")["orders"]


def test_queue_type_and_dead_letter_exchange_become_queue_arguments():
    parsed = route(queue="orders", queue_type="quorum", dead_letter_exchange="orders.dead")
    assert dict(parsed.queue_arguments) == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "orders.dead",
    }
    assert parsed.queue_type == "quorum"
    assert parsed.dead_letter_exchange == "orders.dead"


def test_queue_arguments_alone_make_a_quorum_queue_too():
    parsed = route(queue="orders", queue_arguments={"x-queue-type": "quorum"})
    assert parsed.queue_type == "quorum"
    assert parsed.dead_letter_exchange is None
    assert route(queue="orders").queue_type == "classic"
    assert route(queue="orders").queue_arguments == ()  # nothing added by default


def test_the_same_type_in_both_places_is_accepted():
    parsed = route(queue="orders", queue_type="quorum", queue_arguments={"x-queue-type": "quorum"})
    assert dict(parsed.queue_arguments) == {"x-queue-type": "quorum"}


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        (
            {"queue_type": "quorum", "queue_arguments": {"x-queue-type": "classic"}},
            "route 'orders' has queue_type 'quorum' but queue_arguments['x-queue-type'] "
            "'classic': give one of them",
        ),
        (
            {"dead_letter_exchange": "a", "queue_arguments": {"x-dead-letter-exchange": "b"}},
            "route 'orders' has dead_letter_exchange 'a' but "
            "queue_arguments['x-dead-letter-exchange'] 'b': give one of them",
        ),
        ({"queue_type": "stream"}, "route 'orders' queue type 'stream' is not supported"),
        (
            {"queue_arguments": {"x-queue-type": "stream"}},
            "route 'orders' queue type 'stream' is not supported",
        ),
        (
            {"queue_type": "quorom"},
            "route 'orders' queue type must be one of classic, quorum; got 'quorom'",
        ),
        ({"queue_type": ""}, "route 'orders' has an empty queue_type"),
        ({"queue_type": 1}, "route 'orders' key 'queue_type' must be a string; got int"),
    ],
)
def test_a_contradiction_a_stream_or_an_unknown_type_is_refused_in_one_line(spec, error):
    with pytest.raises(ValueError) as refused:
        route(queue="orders", **spec)
    assert str(refused.value).startswith(error)
    assert "\n" not in str(refused.value)


def test_a_queue_option_needs_a_queue_and_a_broker_route():
    with pytest.raises(ValueError, match="has queue_type but no queue"):
        route(exchange="shop", queue_type="quorum")
    with pytest.raises(ValueError, match="mixes celery_task with"):
        route(celery_task="tasks.placed", queue_type="quorum")


def test_the_partition_queues_are_declared_with_the_queue_type():
    parsed = route(exchange="shop", queue="orders", ordered=True, partitions=2, queue_type="quorum")
    assert parsed.queue_type == "quorum"  # _declare_partitions adds single-active-consumer


def test_a_quorum_queue_on_a_broker_without_queue_types_is_e018():
    routes = {"orders": {"queue": "orders", "queue_type": "quorum"}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        assert check_routes() == []
    with override_settings(OUTBOX={"BROKER_URL": REDIS_URL, "ROUTES": routes}):
        [error] = check_routes()
    assert error.id == "django_outbox.E018"
    assert error.msg == (
        "Route 'orders' declares a quorum queue, but its broker is redis://, which "
        "has no queue types: its queue would silently be an ordinary one."
    )
    # memory:// is a test's stand-in for the real broker (docs/testing.md): no error.
    with override_settings(OUTBOX={"BROKER_URL": "memory://", "ROUTES": routes}):
        assert check_routes() == []


def test_a_dead_letter_exchange_on_a_broker_without_queue_arguments_is_e018():
    routes = {"orders": {"queue": "orders", "dead_letter_exchange": "orders.dead"}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        assert check_routes() == []
    with override_settings(OUTBOX={"BROKER_URL": "memory://", "ROUTES": routes}):
        assert check_routes() == []
    with override_settings(OUTBOX={"BROKER_URL": REDIS_URL, "ROUTES": routes}):
        [error] = check_routes()
    assert error.id == "django_outbox.E018"
    assert error.msg == (
        "Route 'orders' gives its queue the dead-letter exchange 'orders.dead', but its broker "
        "is redis://, which ignores queue arguments: a parked message would be dropped, not "
        "dead-lettered."
    )


@pytest.mark.parametrize(("value", "seconds"), [(0, 0.0), (2.5, 2.5), ("1", 1.0)])
def test_start_jitter_is_zero_or_seconds(value, seconds):
    if isinstance(value, str):
        assert from_env({"OUTBOX_START_JITTER": value}) == {"START_JITTER": seconds}
        return
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "START_JITTER": value}):
        assert outbox_settings.START_JITTER == seconds


@pytest.mark.parametrize("value", [-1, True, "1"])
def test_a_negative_or_non_numeric_start_jitter_is_refused(value):
    with (
        override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "START_JITTER": value}),
        pytest.raises(OutboxConfigurationError, match="START_JITTER"),
    ):
        _ = outbox_settings.START_JITTER
