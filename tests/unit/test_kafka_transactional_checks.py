"""The settings and system checks of a transactional Kafka route (E063-E065); no
services. (What the route does on the real cluster: tests/integration/
test_kafka_transactions.py.)"""

from __future__ import annotations

import pytest
from django.core import checks
from django.test.utils import override_settings

from django_outbox.conf import outbox_settings
from django_outbox.ops.checks import check_brokers, check_routes

KAFKA = "kafka://k1:9092,k2:9092"
RABBIT = "amqp://guest:guest@rabbit//"


def test_a_transactional_route_on_a_kafka_broker_passes():
    routes = {"o": {"topic": "o", "transactional": True, "ordered": True}}
    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": KAFKA}}, "ROUTES": routes}):
        assert outbox_settings.ROUTES["o"].transactional
        assert check_routes() == []
        assert check_brokers() == []


@pytest.mark.parametrize(
    ("outbox", "broker"),
    [
        ({"BROKER_URL": RABBIT, "ROUTES": {"o": {"queue": "o", "transactional": True}}}, "amqp://"),
        (
            {"BROKER_URL": RABBIT, "ROUTES": {"o": {"celery_task": "a.b", "transactional": True}}},
            "Celery's broker",
        ),
    ],
)
def test_transactional_on_a_route_whose_broker_is_not_kafka_is_e063(outbox, broker):
    with override_settings(OUTBOX=outbox):
        found = check_routes()
    assert found == [
        checks.Error(
            f"Route 'o' is transactional, but its broker is {broker}: only Kafka publishes a "
            "batch in a transaction, so its events would go at least once instead of exactly "
            "once.",
            hint='Route it to a kafka:// broker (its broker key), or drop "transactional".',
            id="django_outbox.E063",
        )
    ]


def test_a_transactional_flag_that_is_no_bool_is_e004():
    routes = {"o": {"topic": "o", "transactional": "yes"}}
    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": KAFKA}}, "ROUTES": routes}):
        ((check_id, msg),) = [(p.id, p.msg) for p in outbox_settings.problems()]
    assert check_id == "django_outbox.E004"
    assert "route 'o' key 'transactional' must be True or False; got str" in msg


@pytest.mark.parametrize("given", ["", "  ", 7])
def test_a_transactional_id_that_is_no_text_is_e064(given):
    brokers = {"events": {"URL": KAFKA, "OPTIONS": {"transactional.id": given}}}
    with override_settings(OUTBOX={"BROKERS": brokers}):
        found = [error for error in check_brokers() if error.id != "django_outbox.E062"]
    assert found == [
        checks.Error(
            'OUTBOX["BROKERS"]["events"]["OPTIONS"]["transactional.id"] must be a non-empty '
            f"string; got {given!r}",
            hint="Give each relay process its own id (e.g. from an environment variable), or "
            "drop it for django-outbox-<host name> (docs/kafka.md#exactly-once).",
            id="django_outbox.E064",
        )
    ]


@pytest.mark.parametrize("timeout", [10_001, "5000"])
def test_a_transaction_timeout_beyond_the_publish_budget_is_e065(timeout):
    brokers = {"events": {"URL": KAFKA, "OPTIONS": {"transaction.timeout.ms": timeout}}}
    with override_settings(OUTBOX={"BROKERS": brokers, "LEASE_SECONDS": 30}):
        found = [error for error in check_brokers() if error.id != "django_outbox.E062"]
    assert found == [
        checks.Error(
            'OUTBOX["BROKERS"]["events"]["OPTIONS"]["transaction.timeout.ms"] must be an int of '
            "at most 10000 (the publish's confirm budget: a third of LEASE_SECONDS, at most "
            f"30 s); got {timeout!r}",
            hint="Drop it (it defaults to that budget) or raise LEASE_SECONDS: a zombie relay's "
            "transaction must end before its rows' lease does.",
            id="django_outbox.E065",
        )
    ]


def test_a_transaction_timeout_within_the_budget_and_an_id_pass():
    options = {"transactional.id": "relay-1", "transaction.timeout.ms": 10_000}
    brokers = {"events": {"URL": KAFKA, "OPTIONS": options}}
    with override_settings(OUTBOX={"BROKERS": brokers, "LEASE_SECONDS": 30}):
        assert check_brokers() == []


def test_a_shorter_transaction_timeout_shortens_the_transactional_producers_record_timeout():
    """librdkafka refuses a transactional producer whose records may outlive their
    transaction: built offline here (no broker is reached), as the relay builds it."""
    from confluent_kafka import Producer

    from django_outbox.transports.kafka import KafkaTransport

    options = {"transactional.id": "relay-1", "transaction.timeout.ms": 5_000}
    with override_settings(OUTBOX={"BROKERS": {"events": {"URL": KAFKA}}, "LEASE_SECONDS": 30}):
        transport = KafkaTransport(KAFKA, options)
    config = transport._transactions._config
    assert (config["message.timeout.ms"], config["transaction.timeout.ms"]) == (5_000, 5_000)
    Producer({name: value for name, value in config.items() if name != "error_cb"})
