"""Kafka brokers and routes in the settings and their checks, and how the Kafka transport
maps librdkafka's errors to outcomes. No services, no network: librdkafka's errors are
built from their codes (confluent-kafka's own ``KafkaError``), as its delivery reports
carry them. (The real cluster's behaviour is tests/integration/test_kafka.py's.)"""

from __future__ import annotations

import dataclasses
import datetime as dt
import sys
import uuid
from unittest import mock

import pytest
from confluent_kafka import KafkaError
from django.core import checks
from django.test.utils import override_settings

from django_outbox.conf import outbox_settings
from django_outbox.conf.routes import Route
from django_outbox.envelope import ClaimedMessage
from django_outbox.ops.checks import check_brokers, check_routes
from django_outbox.transports import transport_class
from django_outbox.transports.kafka import KafkaTransport, _waves, failure_of, record_headers

KAFKA = "kafka://k1:9092,k2:9092,[::1]:9094"
RABBIT = "amqp://guest:guest@rabbit//"


def problems(**outbox):
    with override_settings(OUTBOX=outbox):
        return [(p.id, p.msg) for p in outbox_settings.problems()]


def test_a_kafka_url_picks_the_kafka_transport_and_is_valid():
    assert transport_class("kafka") is KafkaTransport
    assert problems(BROKERS={"default": {"URL": KAFKA}}) == []


@pytest.mark.parametrize("url", ["kafka://k1", "kafka://k1:9092,", "kafka://u:p@k1:9092"])
def test_a_malformed_kafka_url_is_e010_without_its_password(url):
    ((check_id, msg),) = problems(BROKERS={"default": {"URL": url}})
    assert check_id == "django_outbox.E010"
    assert msg.endswith("is malformed: it is not of the form kafka://host:port[,host:port...].")
    assert ":p@" not in msg


def test_kafka_without_confluent_kafka_names_the_extra():
    with mock.patch.dict(sys.modules, {"confluent_kafka": None}):
        ((check_id, msg),) = problems(BROKERS={"default": {"URL": KAFKA}})
    assert check_id == "django_outbox.E011"
    assert msg.endswith('not installed: pip install "django-transactional-outbox[kafka]"')


def test_a_librdkafka_password_in_options_is_redacted():
    options = {"sasl.username": "app", "sasl.password": "s3cret-pw"}
    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": KAFKA, "OPTIONS": options}}}):
        assert (
            outbox_settings.redact("SASL auth failed for s3cret-pw") == "SASL auth failed for ***"
        )
        transport = KafkaTransport(KAFKA, options)
    assert transport.config["sasl.password"] == "s3cret-pw"  # given to librdkafka as is


def test_options_cannot_undo_the_producers_guarantees():
    options = {"enable.idempotence": False, "acks": 1, "partitioner": "random", "linger.ms": 50}
    config = KafkaTransport(KAFKA, options).config
    assert config["enable.idempotence"] is True
    assert (config["acks"], config["partitioner"]) == ("all", "murmur2_random")
    assert config["linger.ms"] == 50
    assert config["bootstrap.servers"] == "k1:9092,k2:9092,[::1]:9094"


def test_a_kafka_route_parses_its_topic_keys():
    routes = {
        "orders": {
            "topic": "shop.orders",
            "partitions": 12,
            "replication_factor": 3,
            "topic_config": {"retention.ms": 86400000},
            "ordered": True,
        },
        "clicks": {"broker": "default"},
    }
    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": KAFKA}}, "ROUTES": routes}):
        orders, clicks = outbox_settings.ROUTES["orders"], outbox_settings.ROUTES["clicks"]
        assert check_routes() == []
    assert (orders.topic_name, orders.partitions, orders.replication_factor) == (
        "shop.orders",
        12,
        3,
    )
    assert dict(orders.topic_config) == {"retention.ms": 86400000}
    assert orders.ordered and orders.is_kafka
    assert clicks.topic_name == "clicks" and not clicks.is_kafka


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"topic": "t", "replication_factor": 0}, "replication_factor must be a whole number"),
        ({"topic": "t", "topic_config": ["x"]}, "topic_config must be a dict"),
        ({"topic": 5}, "key 'topic' must be a string"),
        ({"topic": "t", "celery_task": "x.y"}, "mixes celery_task"),
    ],
)
def test_malformed_kafka_routes_are_e004(spec, reason):
    ((check_id, msg),) = problems(BROKERS={"default": {"URL": KAFKA}}, ROUTES={"o": spec})
    assert check_id == "django_outbox.E004"
    assert reason in msg


def test_topic_keys_on_another_broker_are_e060():
    with override_settings(OUTBOX={"BROKER_URL": RABBIT, "ROUTES": {"o": {"topic": "o"}}}):
        found = check_routes()
    assert found[-1:] == [
        checks.Error(
            "Route 'o' names a Kafka topic (topic, replication_factor or topic_config), but "
            "its broker is amqp://, which has no topics: they would be ignored.",
            hint="Route it to a kafka:// broker (its broker key), or drop those keys.",
            id="django_outbox.E060",
        )
    ]


def test_a_queue_on_a_kafka_broker_is_e061():
    routes = {"o": {"queue": "o", "routing_key": "o"}}
    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": KAFKA}}, "ROUTES": routes}):
        ((error,),) = [check_routes()]
    assert error.id == "django_outbox.E061"
    assert error.msg.startswith("Route 'o' declares a queue or queue/exchange arguments")


@pytest.mark.parametrize(
    "code",
    [
        KafkaError._MSG_TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.NOT_ENOUGH_REPLICAS,
        KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NOT_LEADER_FOR_PARTITION,
    ],
)
def test_an_unreachable_or_short_handed_cluster_is_an_outage(code):
    failure = failure_of(KafkaError(code))
    assert failure.outage and not failure.counts
    assert failure.error.startswith(f"KafkaError {KafkaError(code).name()}")


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_EXCEPTION,
    ],
)
def test_a_record_the_cluster_refuses_for_itself_fails_alone_for_good(code):
    failure = failure_of(KafkaError(code))
    assert failure.permanent and failure.counts and not failure.outage
    assert KafkaError(code).name() in failure.error


def test_another_error_counts_an_attempt():
    failure = failure_of(KafkaError(KafkaError.INVALID_REQUIRED_ACKS))
    assert failure.counts and not failure.permanent and not failure.outage


def test_record_headers_are_utf8_text_null_or_json():
    headers = {"event_id": "e-1", "causation_id": None, "sequence": 3, "skipped": True, "ü": "ö"}
    assert record_headers(headers, "application/json") == [
        ("content_type", b"application/json"),
        ("event_id", b"e-1"),
        ("causation_id", None),
        ("sequence", b"3"),
        ("skipped", b"true"),
        ("ü", "ö".encode()),
    ]


def test_a_kafka_broker_given_by_url_to_kombu_is_refused_with_a_one_line_error():
    from django_outbox.exceptions import OutboxConfigurationError

    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": KAFKA}}}):
        with pytest.raises(OutboxConfigurationError) as raised:
            outbox_settings.require_broker_url()
    assert str(raised.value) == (
        f"{KAFKA} is a Kafka cluster, which is not given by URL: name its alias of "
        "OUTBOX['BROKERS'] (run_outbox_consumer --broker ALIAS; outbox_replay_parked finds "
        "it by the parked message's topic)"
    )


def test_the_consumer_reads_record_headers_back_as_the_relay_wrote_them():
    from django_outbox.consumer.kafka import record_headers as read_back

    headers = {"event_id": "e-1", "causation_id": None, "sequence": 3, "skipped": True}
    headers |= {"destination": "7", "tenant": "3", "ü": "ö"}
    assert read_back(record_headers(headers, "application/json")) == {
        "content_type": "application/json",
        **headers,
    }
    # A sequence that is not JSON stays text: the envelope refuses it.
    assert read_back([("sequence", b"three")]) == {"sequence": "three"}


@pytest.mark.parametrize(
    ("text", "redacted"),
    [
        ("topic 'o' does not exist on kafka://k1:9092,k2:9092: create it", None),
        ("the broker 'events' (kafka://k1:9092,[::1]:9094): KafkaException", None),
        ("kafka://app:s3cret-pw@k1:9092 refused", "kafka://app:***@k1:9092 refused"),
        ("kafka://app:s3cret-pw refused", "kafka://app:*** refused"),
    ],
)
def test_a_kafka_bootstrap_list_in_a_sentence_is_no_password(text, redacted):
    assert outbox_settings.redact(text) == (redacted or text)


#: OPTIONS librdkafka refuses to build a producer from, and what it says of each.
REFUSED_OPTIONS = [
    ({"no.such.property": 1}, 'No such configuration property: "no.such.property"'),
    ({"linger.ms": "lots"}, 'Invalid value for configuration property "queue.buffering.max.ms"'),
    (
        {"security.protocol": "SSL", "ssl.ca.location": "/nowhere/ca.pem"},
        "Failed to create producer: ssl.ca.location failed: ",
    ),
]


@pytest.mark.parametrize(("options", "said"), REFUSED_OPTIONS)
def test_options_librdkafka_refuses_are_e062(options, said):
    brokers = {"events": {"URL": KAFKA, "OPTIONS": options}}
    with override_settings(OUTBOX={"BROKERS": brokers}):
        (error,) = check_brokers()
    assert error.id == "django_outbox.E062"
    assert error.msg.startswith(
        f'OUTBOX["BROKERS"]["events"]["OPTIONS"] cannot build a Kafka producer: {said}'
    )
    assert error.hint.startswith("Fix or remove that property")


def test_options_librdkafka_takes_pass_the_check():
    options = {"linger.ms": 20, "compression.type": "zstd", "sasl.password": "pw"}
    with override_settings(OUTBOX={"BROKERS": {"events": {"URL": KAFKA, "OPTIONS": options}}}):
        assert check_brokers() == []


@pytest.mark.parametrize(("options", "said"), REFUSED_OPTIONS)
def test_a_producer_options_cannot_build_leaves_its_rows_unattempted(options, said, caplog):
    """A certificate not mounted yet at deploy: the rows wait, none is abandoned, and one
    ERROR names the property (librdkafka refuses before any broker is reached)."""
    kafka = KafkaTransport(KAFKA, options, alias="events")
    outcomes = kafka.publish(Route("orders"), claimed(3))
    assert [(o.permanent, o.counts, o.outage) for o in outcomes] == [(False, False, False)] * 3
    text = f'OUTBOX["BROKERS"][\'events\']["OPTIONS"] cannot build a Kafka producer: {said}'
    assert outcomes[0].error.startswith(text)
    kafka.publish(Route("orders"), claimed(1))  # the same error again: logged once
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert [(r.action, r.getMessage()[: len(text)]) for r in errors] == [
        ("outbox.kafka_options_refused", text)
    ]


def claimed(count: int) -> list[ClaimedMessage]:
    now = dt.datetime.now(dt.UTC)
    return [
        ClaimedMessage(n, uuid.uuid4(), "t.e", "orders", "{}", {}, "", 0, now) for n in range(count)
    ]


@pytest.mark.parametrize(("given", "used"), [(None, 20_000), (300_000, 20_000), (5_000, 5_000)])
def test_message_timeout_is_at_most_the_leases_confirm_budget(given, used):
    """LEASE_SECONDS = 60: a record waits at most 20 s (a third of the lease), however
    long OPTIONS asks (librdkafka's own default is 300 s); a shorter one is kept."""
    options = {} if given is None else {"message.timeout.ms": given}
    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": KAFKA}}, "LEASE_SECONDS": 60}):
        assert KafkaTransport(KAFKA, options).config["message.timeout.ms"] == used


def test_rows_without_a_key_on_an_ordered_route_go_in_the_first_wave():
    """Keyless rows have no order to keep: all in one wave, where each went in a wave of
    its own (under the key ""), and one failure held back every later one."""
    keyless = [dataclasses.replace(m, sequence=None) for m in claimed(3)]
    keyed = [
        dataclasses.replace(m, ordering_key="k", sequence=n + 1) for n, m in enumerate(claimed(2))
    ]
    assert _waves([*keyless, *keyed]) == [[0, 1, 2, 3], [4]]
