"""Text PostgreSQL cannot store is refused at stage time, before any SQL, so the caller's
transaction stays usable; and what a consumer gets for everything that is stored
(docs/staging.md, "What a consumer gets"), relayed for real through RabbitMQ."""

from __future__ import annotations

import datetime as dt
import decimal
import json
import reprlib

import pytest
from django.db import transaction

from django_outbox import InvalidEvent, PayloadNotSerializable, StagingError, stage, stage_many
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from tests.support import consume, delete_queue, unique_destination
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)

NUL = "PostgreSQL cannot store the NUL character (\\u0000) in "
SURROGATE = (
    "PostgreSQL cannot store the lone surrogate \\u{} in {}: "
    "it is half of a UTF-16 pair, not a Unicode character"
)
PAYLOAD = "the payload of event 'order.placed'"
HEADERS = "the headers of event 'order.placed'"


def refusal(**kwargs) -> StagingError:
    arguments = {"event_type": "order.placed", "payload": {}, "destination": "orders", **kwargs}
    with pytest.raises(StagingError) as excinfo, transaction.atomic():
        stage(arguments.pop("event_type"), arguments.pop("payload"), **arguments)
    return excinfo.value


@pytest.mark.parametrize(
    "payload",
    [
        {"note": "a\x00b"},
        {"a\x00": 1},
        {"deep": [1, {"x": ["ok", "\x00"]}]},
        "\x00",
        {"escaped": "\\\\\x00"},  # backslashes, then a real NUL
    ],
)
def test_a_nul_anywhere_in_the_payload_is_refused(payload):
    error = refusal(payload=payload)
    assert isinstance(error, PayloadNotSerializable)
    assert str(error) == NUL + PAYLOAD


@pytest.mark.parametrize(
    ("payload", "surrogate"),
    [
        ({"name": "\ud800"}, "d800"),
        ({"\udfff": 1}, "dfff"),
        ({"list": ["ok", "x\udc80y"]}, "dc80"),
        ({"pair": "\ud83d\ude00"}, "d83d"),  # the halves of 😀 as two code points
    ],
)
def test_a_surrogate_anywhere_in_the_payload_is_refused(payload, surrogate):
    error = refusal(payload=payload)
    assert isinstance(error, PayloadNotSerializable)
    assert str(error) == SURROGATE.format(surrogate, PAYLOAD)


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ({"x-trace": "a\x00"}, NUL + HEADERS),
        ({"x-\x00": "a"}, NUL + HEADERS),
        ({"x-trace": {"nested": ["\ud800"]}}, SURROGATE.format("d800", HEADERS)),
        ({"x-\udbff": "a"}, SURROGATE.format("dbff", HEADERS)),
    ],
)
def test_a_nul_or_surrogate_in_a_header_name_or_value_is_refused(headers, message):
    error = refusal(headers=headers)
    assert isinstance(error, PayloadNotSerializable)
    assert str(error) == message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"key": "k\x00"}, NUL + "the key of event 'order.placed'"),
        ({"key": "\udc00"}, SURROGATE.format("dc00", "the key of event 'order.placed'")),
        ({"event_type": "a\x00b"}, NUL + "event_type 'a\\x00b'"),
        ({"event_type": "a\ud800"}, SURROGATE.format("d800", "event_type 'a\\ud800'")),
    ],
)
def test_a_nul_or_surrogate_in_the_key_or_event_type_is_an_invalid_event(kwargs, message):
    error = refusal(**kwargs)
    assert isinstance(error, InvalidEvent)
    assert str(error) == message


def test_stage_many_refuses_the_whole_call_for_one_bad_event_and_names_it():
    """Among many events of one type, the refusal says which one (it did not)."""
    events = [{"event_type": "a.b", "payload": {"n": n}, "destination": "d"} for n in range(50)]
    events[37]["payload"] = {"k\x00ey": 1}  # in a name
    with pytest.raises(PayloadNotSerializable) as raised:
        with transaction.atomic():
            stage_many(events)
    assert str(raised.value) == f"stage_many(): event #37: {NUL}the payload of event 'a.b'"
    assert not OutboxMessage.objects.exists()


def test_text_that_only_looks_like_a_nul_or_a_surrogate_is_stored():
    text = {"backslash-u": "\\u0000 \\ud800", "emoji": "😀", "nul-name": "NUL"}
    with transaction.atomic():
        stage("a.b", text, destination="d", key="\\u0000", headers={"x": "\\ud800"})
    row = OutboxMessage.objects.get()
    assert (row.payload, row.ordering_key, row.headers) == (text, "\\u0000", {"x": "\\ud800"})


def test_a_caller_that_catches_the_refusal_keeps_a_usable_transaction():
    hostile = [
        {"payload": {"note": "\x00"}},
        {"payload": {"name": "\ud800"}},
        {"payload": {}, "headers": {"x": "\x00"}},
        {"payload": {}, "key": "k\x00"},
        {"payload": {}, "event_type": "a\x00"},
    ]
    refused = []
    with transaction.atomic():
        Order.objects.create(customer="ada", total=1)
        for kwargs in hostile:
            try:
                stage(kwargs.pop("event_type", "order.placed"), destination="orders", **kwargs)
            except StagingError as exc:
                refused.append(type(exc).__name__)
        stage("order.placed", {"ok": True}, destination="orders")
        Order.objects.create(customer="bob", total=2)

    assert refused == ["PayloadNotSerializable"] * 3 + ["InvalidEvent"] * 2
    assert sorted(Order.objects.values_list("customer", flat=True)) == ["ada", "bob"]
    assert list(OutboxMessage.objects.values_list("payload", flat=True)) == [{"ok": True}]


@pytest.fixture
def destination():
    name = unique_destination("fidelity")
    yield name
    delete_queue(name)


PLUS_TWO = dt.timezone(dt.timedelta(hours=2))
STAGED = {
    "zebra": "last in Python, first by length",
    "at": dt.datetime(2026, 5, 1, 12, 34, 56, 789123, tzinfo=PLUS_TWO),
    "utc": dt.datetime(2026, 5, 1, 10, 0, 0, 500, tzinfo=dt.UTC),
    "day": dt.date(2026, 5, 1),
    "price": decimal.Decimal("12.50"),
    "tiny": decimal.Decimal("1E-30"),
    "float": 0.1,
    "whole": 2.0,
    "big_float": 1e20,
    "small_float": 1.5e-7,
    "minus_zero": -0.0,
    "big_int": 2**100,
    "text": "héllo 😀 \u2028 \\u0000",
    "b": 1,
    "a": 2,
}
#: What the consumer's json.loads gives, in the order the body has the keys.
RECEIVED = {
    "a": 2,
    "b": 1,
    "at": "2026-05-01T12:34:56.789+02:00",  # microseconds cut to milliseconds
    "day": "2026-05-01",
    "utc": "2026-05-01T10:00:00.000Z",  # 500 µs cut to .000; +00:00 written Z
    "text": "héllo 😀 \u2028 \\u0000",
    "tiny": "1E-30",
    "float": 0.1,
    "price": "12.50",
    "whole": 2.0,
    "zebra": "last in Python, first by length",
    "big_int": 2**100,
    "big_float": 100000000000000000000,  # an int: PostgreSQL writes no exponent
    "minus_zero": 0.0,  # the sign is lost
    "small_float": 1.5e-07,
}


def test_what_a_consumer_gets_back_through_the_relay_and_rabbitmq(destination):
    with transaction.atomic():
        stage("order.placed", STAGED, destination=destination, headers={"x-note": "é😀"})
    with Relay() as relay:
        assert relay.run_once().published == 1
    (message,) = consume(destination, 1)

    received = json.loads(message.body)
    assert received == RECEIVED
    assert list(received) == list(RECEIVED)  # jsonb's order: shorter keys first, then bytewise
    assert type(received["big_float"]) is int
    assert "héllo 😀" in message.body  # as UTF-8 text, not \\u escapes
    assert message.headers["x-note"] == "é😀"


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ({"x-count": 2**63}, "holds a number outside the signed 64-bit range"),
        ({"x-nested": {"deep": [-(2**63) - 1]}}, "holds a number outside the signed 64-bit range"),
        ({"x-big": 1e20}, "holds a number outside the signed 64-bit range"),  # jsonb: an int
        ({"x" * 256: 1}, "has a name (or holds a key) of over 255 bytes"),
        ({"x-map": {"é" * 128: 1}}, "has a name (or holds a key) of over 255 bytes"),
    ],
)
def test_a_header_amqp_cannot_carry_is_refused_instead_of_abandoned_at_publish(headers, problem):
    error = refusal(headers=headers)
    assert isinstance(error, InvalidEvent)
    (name,) = headers
    assert str(error) == (
        f"event 'order.placed': header {reprlib.repr(name)} {problem}, which AMQP headers "
        "cannot carry; put it in the payload or send it as a string"
    )


def test_headers_at_the_amqp_limits_are_relayed(destination):
    headers = {"x" * 255: 1, "x-min": -(2**63), "x-max": 2**63 - 1, "x-float": 1e18}
    with transaction.atomic():
        stage("order.placed", {}, destination=destination, headers=headers)
    with Relay() as relay:
        assert relay.run_once().published == 1
    (message,) = consume(destination, 1)
    assert {name: message.headers[name] for name in headers} == {**headers, "x-float": 10**18}


def test_headers_too_large_for_a_content_frame_are_refused():
    """RabbitMQ closed the connection on such a message (FRAME_ERROR frame_too_large),
    failing every message of its batch, attempt after attempt, until all were abandoned."""
    error = refusal(headers={"x-big": "x" * 200_000})
    assert isinstance(error, InvalidEvent)
    assert str(error) == (
        "event 'order.placed': the headers take 200016 bytes as an AMQP field table, more "
        "than the 65536 a message's properties can carry; put the data in the payload"
    )


def test_headers_just_under_the_frame_bound_are_relayed_with_their_batch(destination):
    with transaction.atomic():
        stage("order.placed", {"n": 0}, destination=destination)
        stage("order.placed", {"n": 1}, destination=destination, headers={"x-big": "é" * 32_500})
        stage("order.placed", {"n": 2}, destination=destination)
    with Relay() as relay:
        assert relay.run_once().published == 3
    assert len(consume(destination, 3)) == 3
