"""CloudEvents on the wire (django_outbox/cloudevents.py), on real RabbitMQ and Redis,
against a client nobody here wrote: the official CloudEvents SDK for Python
(``cloudevents`` 2.x, its ``cloudevents.core`` API: the RabbitMQ binding and the JSON
event format). The SDK parses every message the relay publishes in each mode; and
events the SDK makes, published by a plain kombu client, are handled by the consumer."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import kombu
import pytest
from cloudevents.core.bindings import rabbitmq
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from django.db import transaction
from django.test import override_settings

from django_outbox import cloudevents, stage
from django_outbox.conf.routes import Route, parse_routes
from django_outbox.consumer import InboxConsumer
from django_outbox.consumer.replay import replay_parked
from django_outbox.envelope import ClaimedMessage, OutboxEvent, ReceivedEvent
from django_outbox.exceptions import InvalidEvent
from django_outbox.models import InboxFailure, InboxMessage
from django_outbox.signing import parse_keys
from django_outbox.transports.kombu import AmqpTransport, RedisTransport
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    consume,
    delete_queue,
    delete_redis_keys,
    drain_raw,
    run_relay,
    stage_events,
    unique_destination,
)

pytestmark = pytest.mark.django_db(transaction=True)

SOURCE = "https://shop.example.com/orders"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
KEYS = ["k" * 32]
#: The specification's rule for extension attribute names (20 characters at most).
EXTENSION_NAME = re.compile(r"[a-z0-9]{1,20}")


def message(n: int, **changes: Any) -> ClaimedMessage:
    claimed = ClaimedMessage(
        id=n,
        event_id=uuid.uuid4(),
        event_type="order.placed",
        destination="orders",
        payload=json.dumps({"n": n, "name": "café ☕"}),
        headers={"tenant": "t1", "traceparent": TRACEPARENT, "causation_id": "c-1"},
        ordering_key="order-1",
        attempts=0,
        created_at=dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
    )
    return dataclasses.replace(claimed, **changes)


def batch() -> list[ClaimedMessage]:
    """A plain event, one without a key (no subject), an ordered one and a skip marker."""
    return [
        message(1),
        message(2, ordering_key=""),
        message(3, sequence=7),
        message(4, sequence=8, skipped=True),
    ]


@pytest.fixture
def amqp_queue() -> Iterator[str]:
    queue = unique_destination("ce")
    yield queue
    delete_queue(queue)


@pytest.fixture
def redis_queue() -> Iterator[str]:
    queue = unique_destination("ce")
    yield queue
    delete_redis_keys(queue)


def publish(transport: Any, route: Route, messages: list[ClaimedMessage]) -> None:
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "CLOUDEVENTS_SOURCE": SOURCE}):
        try:
            assert transport.publish(route, messages) == [None] * len(messages)
        finally:
            transport.close()


def sdk_event(received: kombu.Message) -> CloudEvent:
    """What the SDK makes of a message taken from the broker: through its RabbitMQ
    binding (binary or structured, by the content type)."""
    body = received.body if isinstance(received.body, bytes) else received.body.encode()
    wire = rabbitmq.RabbitMQMessage(
        headers=dict(received.headers), content_type=received.content_type, body=body
    )
    return rabbitmq.from_rabbitmq_event(wire)


def assert_same(event: CloudEvent, sent: ClaimedMessage) -> None:
    attributes = event.get_attributes()
    assert event.get_id() == str(sent.event_id)
    assert event.get_type() == sent.event_type
    assert event.get_source() == SOURCE
    assert event.get_specversion() == "1.0"
    assert event.get_subject() == (sent.ordering_key or None)
    assert event.get_time() == sent.created_at
    assert event.get_datacontenttype() == "application/json"
    assert event.get_data() == json.loads(sent.wire_payload)
    assert attributes["traceparent"] == TRACEPARENT
    assert attributes["correlationid"] == str(sent.event_id)
    assert attributes["causationid"] == "c-1"
    if sent.sequence is not None:
        assert int(attributes["sequence"]) == sent.sequence
        assert attributes["outboxdestination"] == "orders"
    assert ("outboxskipped" in attributes) is sent.skipped
    extensions = set(attributes) - {"id", "type", "source", "specversion", "subject", "time"}
    assert all(EXTENSION_NAME.fullmatch(name) for name in extensions), extensions


@pytest.mark.parametrize("envelope", ["cloudevents", "cloudevents-structured"])
def test_the_sdk_reads_every_message_the_relay_publishes_to_rabbitmq(amqp_queue, envelope):
    """Binary mode (``ce-`` headers, the data as the body) and structured mode, through
    the relay's hand-built AMQP frames; the user's header travels beside the event."""
    route = Route(amqp_queue, "", "direct", amqp_queue, amqp_queue, envelope=envelope)
    sent = batch()
    publish(AmqpTransport(AMQP_URL), route, sent)
    received = consume(amqp_queue, len(sent))
    assert len(received) == len(sent)
    binary = envelope == "cloudevents"
    for claimed, got in zip(sent, received, strict=True):
        assert_same(sdk_event(got), claimed)
        assert got.properties["message_id"] == str(claimed.event_id)
        assert got.headers["tenant"] == "t1"
        assert got.content_type == (
            "application/json" if binary else cloudevents.STRUCTURED_CONTENT_TYPE
        )
        assert ("ce-id" in got.headers) is binary


def test_the_sdk_reads_every_message_the_relay_publishes_to_redis(redis_queue):
    """No binding defines a binary mode for Redis: "cloudevents" is structured there,
    in kombu's message format (what a kombu consumer reads), its body the JSON event."""
    route = Route(redis_queue, "", "direct", redis_queue, redis_queue, envelope="cloudevents")
    sent = batch()
    publish(RedisTransport(REDIS_URL), route, sent)
    received = consume(redis_queue, len(sent), url=REDIS_URL)
    assert len(received) == len(sent)
    for claimed, got in zip(sent, received, strict=True):
        assert got.content_type == cloudevents.STRUCTURED_CONTENT_TYPE
        assert_same(JSONFormat().read(CloudEvent, got.body), claimed)
        assert_same(sdk_event(got), claimed)
        assert got.headers["tenant"] == "t1"


@pytest.mark.parametrize(
    ("url", "envelope"),
    [
        (AMQP_URL, "cloudevents"),
        (AMQP_URL, "cloudevents-structured"),
        (REDIS_URL, "cloudevents"),
    ],
    ids=["rabbitmq binary", "rabbitmq structured", "redis structured"],
)
def test_the_consumer_reads_the_relays_cloudevents_as_its_own_envelope(url, envelope):
    """The same ReceivedEvent (id, type, payload, headers) as the outbox's own envelope;
    signed events verify (the signature covers the same fields and payload bytes); the
    CloudEvents attributes no header holds are in ``event.cloudevent``."""
    queue = unique_destination("ce")
    route = Route(queue, "", "direct", queue, queue, envelope=envelope)
    sent = batch()[:3]  # (a skip marker outside an ordered consumption is moot here)
    sent[2] = message(3)
    keys = parse_keys(KEYS)
    for claimed in sent:
        claimed.signature = keys.sign(claimed.envelope())
    handled: list[ReceivedEvent] = []
    transport = (AmqpTransport if url == AMQP_URL else RedisTransport)(url)
    with override_settings(
        OUTBOX={"BROKER_URL": url, "CLOUDEVENTS_SOURCE": SOURCE, "SIGNING_KEYS": KEYS}
    ):
        publish(transport, route, sent)
        consumer = InboxConsumer(queue, handled.append, "billing", url=url, verify_signatures=True)
        stats = consumer.run(idle_timeout=1)
    try:
        assert (stats.handled, stats.parked, stats.rejected) == (len(sent), 0, 0)
        for claimed, event in zip(sent, handled, strict=True):
            expected = OutboxEvent.from_message(claimed)
            assert (event.event_id, event.event_type) == (expected.event_id, expected.event_type)
            assert (event.payload, event.headers) == (expected.payload, expected.headers)
            assert event.ordering_key == (claimed.ordering_key or None)
            assert event.cloudevent is not None and event.cloudevent["source"] == SOURCE
    finally:
        if url == AMQP_URL:
            delete_queue(queue)


def sdk_events(n: int) -> list[CloudEvent]:
    """Events as another service makes them with the SDK: a UUID id and a subject, and
    one whose id is no UUID (the consumer derives its event id from source and id)."""
    return [
        CloudEvent(
            {
                "id": str(uuid.uuid4()) if number else f"invoice-{uuid.uuid4().hex}",
                "type": "invoice.paid",
                "source": "urn:billing",
                "subject": f"invoice-{number}",
                "datacontenttype": "application/json",
                "tenant": "t1",
            },
            {"number": number},
        )
        for number in range(n)
    ]


@pytest.mark.parametrize(
    ("url", "mode"),
    [(AMQP_URL, "binary"), (AMQP_URL, "structured"), (REDIS_URL, "structured")],
    ids=["rabbitmq binary", "rabbitmq structured", "redis structured"],
)
def test_the_consumer_handles_events_the_sdk_produces(url, mode):
    """Published by a plain kombu producer as the SDK's RabbitMQ binding encodes them
    (on Redis, kombu's own message format, which the consumer reads): each handled
    once, with the SDK's id, type, subject, data and extension; a second copy of one is
    a duplicate."""
    queue = unique_destination("ce")
    events = sdk_events(3)
    encode = rabbitmq.to_binary_event if mode == "binary" else rabbitmq.to_structured_event
    handled: list[ReceivedEvent] = []
    with override_settings(OUTBOX={"BROKER_URL": url}):
        consumer = InboxConsumer(queue, handled.append, "billing", url=url)
        with kombu.Connection(url) as connection:
            kombu.Queue(queue, durable=True)(connection.channel()).declare()
            producer = connection.Producer()
            for event in [*events, events[0]]:
                wire = encode(event)
                producer.publish(
                    wire.body,
                    routing_key=queue,
                    content_type=wire.content_type,
                    content_encoding="utf-8",
                    headers=wire.headers,
                )
        stats = consumer.run(idle_timeout=1)
    try:
        assert (stats.handled, stats.duplicates, stats.rejected) == (3, 1, 0)
        for event, got in zip(events, handled, strict=True):
            assert got.event_id == cloudevents.event_id("urn:billing", event.get_id())
            assert got.event_type == "invoice.paid"
            assert got.ordering_key == event.get_subject()
            assert got.payload == event.get_data()
            assert got.cloudevent is not None
            assert got.cloudevent["id"] == event.get_id()
            assert got.cloudevent["tenant"] == "t1"
        assert InboxMessage.objects.filter(consumer="billing").count() == 3
    finally:
        if url == AMQP_URL:
            delete_queue(queue)


def test_a_relay_publishes_the_default_route_as_cloudevents_by_the_project_default():
    """``OUTBOX["DEFAULT_ENVELOPE"]`` on a real relay process: the events staged to a
    destination of the default route reach its queue as binary-mode CloudEvents, with
    the project's source."""
    destination = unique_destination("ce")
    ids = stage_events(3, destination, keys=3)
    try:
        run_relay("--drain", DEFAULT_ENVELOPE="cloudevents", CLOUDEVENTS_SOURCE=SOURCE)
        received = [sdk_event(got) for got in consume(destination, len(ids))]
    finally:
        delete_queue(destination)
    assert [event.get_id() for event in received] == ids
    assert {event.get_source() for event in received} == {SOURCE}
    assert [event.get_subject() for event in received] == ["k0", "k1", "k2"]
    assert [event.get_data() for event in received] == [{"n": n} for n in range(3)]


def test_a_parked_cloudevent_is_replayed_in_the_outbox_envelope_as_the_same_event():
    """A parked CloudEvent keeps its payload's text and its headers mapped back; the
    replay sends those in the outbox's envelope, which reads as the same event (its
    event id made from source and id too)."""
    queue = unique_destination("ce")
    (event,) = sdk_events(1)  # its id is no UUID
    wire = rabbitmq.to_binary_event(event)

    def refuse(received: ReceivedEvent) -> None:
        raise RuntimeError("the ledger is down")

    handled: list[ReceivedEvent] = []
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL}):
        failing = InboxConsumer(queue, refuse, "billing", max_deliveries=1)
        with kombu.Connection(AMQP_URL) as connection:
            kombu.Queue(queue, durable=True)(connection.channel()).declare()
            connection.Producer().publish(
                wire.body,
                routing_key=queue,
                content_type=wire.content_type,
                content_encoding="utf-8",
                headers=wire.headers,
            )
        try:
            assert failing.run(idle_timeout=1).parked == 1
            (parked,) = InboxFailure.objects.parked()
            assert json.loads(parked.body) == {"number": 0}
            assert parked.headers["event_type"] == "invoice.paid"
            replay_parked(InboxFailure.objects.all())
            stats = InboxConsumer(queue, handled.append, "billing").run(idle_timeout=1)
        finally:
            delete_queue(queue)
    assert stats.handled == 1
    (again,) = handled
    assert again.event_id == cloudevents.event_id("urn:billing", event.get_id())
    assert (again.event_type, again.payload, again.ordering_key) == (
        "invoice.paid",
        {"number": 0},
        "invoice-0",
    )


@pytest.mark.parametrize("mode", ["binary", "structured"])
def test_a_cloudevent_whose_body_does_not_decode_is_rejected_and_the_consumer_goes_on(mode):
    """kombu marks bytes published without a content encoding ``binary``, a codec Python
    does not know: the message is rejected with one line, and the next one handled."""
    queue = unique_destination("ce")
    encode = rabbitmq.to_binary_event if mode == "binary" else rabbitmq.to_structured_event
    first, second = (encode(event) for event in sdk_events(2))
    handled: list[ReceivedEvent] = []
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL}):
        consumer = InboxConsumer(queue, handled.append, "billing")
        with kombu.Connection(AMQP_URL) as connection:
            kombu.Queue(queue, durable=True)(connection.channel()).declare()
            producer = connection.Producer()
            for wire, encoding in ((first, None), (second, "utf-8")):
                producer.publish(
                    wire.body,
                    routing_key=queue,
                    content_type=wire.content_type,
                    content_encoding=encoding,
                    headers=wire.headers,
                )
        try:
            stats = consumer.run(idle_timeout=1)
        finally:
            delete_queue(queue)
    assert (stats.rejected, stats.handled) == (1, 1)
    assert [event.payload for event in handled] == [{"number": 1}]


@pytest.mark.parametrize(
    ("content_type", "headers", "body"),
    [
        (cloudevents.STRUCTURED_CONTENT_TYPE, {}, b'{"data": ' + b"[" * 100_000),
        (
            "application/json",
            {"ce-specversion": "1.0", "ce-id": "1", "ce-source": "s", "ce-type": "t"},
            b"[" * 100_000,
        ),
        ("application/json", {"event_id": str(uuid.uuid4())}, b"[" * 100_000),
    ],
    ids=["structured", "binary", "outbox envelope"],
)
def test_json_nested_too_deeply_is_rejected_and_the_consumer_goes_on(content_type, headers, body):
    """100 KB of ``[``: Python's JSON decoder raises RecursionError, no ValueError; the
    consumer rejects the message with one line instead of dying of it."""
    queue = unique_destination("ce")
    handled: list[ReceivedEvent] = []
    (good,) = sdk_events(1)
    wire = rabbitmq.to_binary_event(good)
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL}):
        consumer = InboxConsumer(queue, handled.append, "billing")
        with kombu.Connection(AMQP_URL) as connection:
            kombu.Queue(queue, durable=True)(connection.channel()).declare()
            producer = connection.Producer()
            for data, kind, more in ((body, content_type, headers), (wire.body, None, None)):
                producer.publish(
                    data,
                    routing_key=queue,
                    content_type=kind or wire.content_type,
                    content_encoding="utf-8",
                    headers=more or wire.headers,
                )
        try:
            stats = consumer.run(idle_timeout=1)
        finally:
            delete_queue(queue)
    assert (stats.rejected, stats.handled) == (1, 1)


def test_a_partitioned_route_spreads_cloudevents_by_key_as_its_own_envelope():
    """The partitions' consistent-hash exchange hashes the ``ordering_key`` header: a
    partitioned route's CloudEvents carry it beside ``ce-subject``, so each key's
    events still go to one partition queue, and the keys over several."""
    name = unique_destination("cep")
    spec = {"queue": name, "ordered": True, "partitions": 4, "envelope": "cloudevents"}
    route = parse_routes({name: spec}, "outbox")[name]
    keys = [f"order-{number}" for number in range(24)]
    sent = [message(n, ordering_key=key, sequence=1) for n, key in enumerate(keys)]
    try:
        publish(AmqpTransport(AMQP_URL), route, sent)
        placed = {queue: drain_raw(queue) for queue in route.partition_queues}
    finally:
        for queue in route.partition_queues:
            delete_queue(queue)
        with kombu.Connection(AMQP_URL) as connection:
            kombu.Exchange(route.partition_exchange, channel=connection.channel()).delete()
    subjects = {q: [m.headers["ce-subject"] for m in got] for q, got in placed.items()}
    assert sorted(s for found in subjects.values() for s in found) == sorted(keys)
    assert sum(1 for found in subjects.values() if found) > 1, subjects
    for got in placed.values():
        assert all(m.headers["ordering_key"] == m.headers["ce-subject"] for m in got)


@pytest.mark.parametrize("name", ["ce-id", "CE-SpecVersion", "ce-tenant"])
def test_stage_refuses_a_header_named_like_a_cloudevents_attribute(name):
    """On a CloudEvents route it would pass for the event's attribute, on any other route
    make its consumer read the event as a CloudEvent (``ce-specversion``)."""
    with transaction.atomic(), pytest.raises(InvalidEvent) as raised:
        stage("order.placed", {}, destination="orders", headers={name: "x", "tenant": "t1"})
    assert str(raised.value) == (
        f"event 'order.placed': headers [{name!r}] are reserved for the relay, kombu and the "
        "brokers and cannot be given"
    )
