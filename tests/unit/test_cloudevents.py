"""The CloudEvents mapping (django_outbox/cloudevents.py) without a broker: every shape of
event the relay sends reads back as the outbox's own envelope gives it, signatures cover
the same bytes, and the route option and settings are checked. The SDK's view of the
same messages on real brokers is tests/integration/test_cloudevents.py."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import uuid
from typing import Any

import pytest
from django.core import checks
from django.test import override_settings

from django_outbox import cloudevents
from django_outbox.conf.routes import parse_routes
from django_outbox.envelope import ClaimedMessage, OutboxEvent
from django_outbox.exceptions import InvalidMessage
from django_outbox.signing import parse_keys
from django_outbox.transports.amqp_frames import PublishFrames, method_frame

SOURCE = "urn:shop"
#: The specification's naming rule for extension attributes (20 characters at most).
EXTENSION_NAME = re.compile(r"[a-z0-9]{1,20}")
CONTEXT_ATTRIBUTES = {"id", "source", "specversion", "type", "datacontenttype"}
CONTEXT_ATTRIBUTES |= {"dataschema", "subject", "time", "data", "data_base64"}


def message(**changes: Any) -> ClaimedMessage:
    claimed = ClaimedMessage(
        id=1,
        event_id=uuid.uuid4(),
        event_type="order.placed",
        destination="orders",
        payload='{"n": 1, "name": "café ☕"}',
        headers={"tenant": "t1", "count": 3, "flag": False, "causation_id": "c-1"},
        ordering_key="order-1",
        attempts=0,
        created_at=dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
    )
    return dataclasses.replace(claimed, **changes)


SHAPES = {
    "plain": {},
    "no key": {"ordering_key": ""},
    "ordered": {"sequence": 7},
    "skip marker": {"sequence": 8, "skipped": True},
    "null payload": {"payload": "null"},
}


def read(wire: cloudevents.Wire) -> tuple[Any, str]:
    return cloudevents.received(wire.content_type, wire.headers, wire.body.decode(), 10**7)


def test_every_extension_name_follows_the_specifications_rules():
    for name in cloudevents.EXTENSIONS.values():
        assert EXTENSION_NAME.fullmatch(name), name
        assert name not in CONTEXT_ATTRIBUTES


@pytest.mark.parametrize("mode", [cloudevents.binary, cloudevents.structured])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_event_reads_back_as_the_outbox_envelope_gives_it(mode, shape):
    sent = message(**SHAPES[shape])
    sent.signature = parse_keys(["k" * 32]).sign(sent.envelope())
    event, text = read(mode(sent, SOURCE))
    expected = OutboxEvent.from_message(sent)
    assert (event.event_id, event.event_type, event.payload) == (
        expected.event_id,
        expected.event_type,
        expected.payload,
    )
    assert event.headers == expected.headers
    assert (event.sequence, event.skipped) == (sent.sequence, sent.skipped)
    assert text == sent.wire_payload
    assert event.cloudevent == {
        "specversion": "1.0",
        "source": SOURCE,
        "id": str(sent.event_id),
        "datacontenttype": "application/json",
    }


def test_binary_mode_writes_every_attribute_as_a_ce_header_holding_a_string():
    wire = cloudevents.binary(message(sequence=7, skipped=True), SOURCE)
    attributes = {k: v for k, v in wire.headers.items() if k.startswith("ce-")}
    assert all(isinstance(value, str) for value in attributes.values())
    assert attributes["ce-sequence"] == "7"
    assert attributes["ce-outboxskipped"] == "true"
    assert attributes["ce-subject"] == "order-1"
    assert "ce-datacontenttype" not in attributes
    assert "ce-causationid" in attributes
    assert wire.headers["count"] == 3  # a user header travels as it is, beside the event
    assert wire.content_type == "application/json"


def test_structured_mode_writes_data_first_as_the_payloads_own_text():
    sent = message(payload='{"b":1,  "a": 2.50}')  # not as json.dumps would write it
    wire = cloudevents.structured(sent, SOURCE)
    assert wire.body.startswith(b'{"data": {"b":1,  "a": 2.50}, ')
    document = json.loads(cloudevents.structured(message(sequence=7, skipped=True), SOURCE).body)
    assert (document["sequence"], document["outboxskipped"]) == (7, True)
    assert (document["subject"], document["causationid"]) == ("order-1", "c-1")
    assert "ce-id" not in wire.headers and wire.headers["tenant"] == "t1"
    assert read(wire)[1] == sent.payload


@pytest.mark.parametrize("mode", [cloudevents.binary, cloudevents.structured])
def test_a_signature_covers_the_payload_and_fails_on_altered_data(mode):
    keys = parse_keys(["k" * 32])
    sent = message(sequence=3)
    sent.signature = keys.sign(sent.envelope())
    wire = mode(sent, SOURCE)
    event, text = read(wire)
    assert keys.problem(event.headers["outbox_signature"], event.envelope(text.encode())) is None
    altered = dataclasses.replace(wire, body=wire.body.replace(b'"n": 1', b'"n": 2'))
    event, text = read(altered)
    problem = keys.problem(event.headers["outbox_signature"], event.envelope(text.encode()))
    assert problem is not None and "does not match" in problem


def test_an_id_that_is_no_uuid_becomes_one_of_source_and_id():
    made = cloudevents.event_id("urn:billing", "invoice-7")
    assert made == cloudevents.event_id("urn:billing", "invoice-7")
    assert made != cloudevents.event_id("urn:other", "invoice-7")
    same = uuid.uuid4()
    assert cloudevents.event_id("urn:billing", str(same)) == same


def test_a_ce_header_without_specversion_leaves_an_outbox_envelope_as_it_is():
    """A user's header named ce-... on the outbox's envelope does not make it a CloudEvent."""
    assert not cloudevents.is_cloudevent("application/json", {"ce-tenant": "t1"})
    assert cloudevents.is_cloudevent("application/json", {"CE-SpecVersion": "1.0"})
    assert cloudevents.is_cloudevent("application/cloudevents+json; charset=utf-8", {})


@pytest.mark.parametrize(
    ("content_type", "body", "error"),
    [
        (
            "application/cloudevents+json",
            "[]",
            "the CloudEvent's structured body is not a JSON object",
        ),
        (
            "application/cloudevents-batch+json",
            "[]",
            "content type 'application/cloudevents-batch+json' is a CloudEvents format other "
            "than JSON (application/cloudevents+json)",
        ),
        (
            "application/cloudevents+json",
            '{"specversion": "1.0", "id": "1", "source": "s", "type": "t", '
            '"datacontenttype": "text/plain", "data": "hi"}',
            "the CloudEvent's datacontenttype 'text/plain' is not application/json: "
            "run_outbox_consumer takes JSON data only",
        ),
        (
            "application/cloudevents+json",
            '{"specversion": "1.0", "id": "1", "source": "", "type": "t"}',
            "the CloudEvent has no non-empty id, source and type (required attributes, each "
            "a non-empty string)",
        ),
        (
            "application/cloudevents+json",
            '{"id": "1", "source": "s", "type": "t"}',
            "the CloudEvent has no specversion",
        ),
    ],
)
def test_a_cloudevent_it_cannot_read_is_one_line(content_type, body, error):
    with pytest.raises(InvalidMessage) as raised:
        cloudevents.received(content_type, {}, body, 10**6)
    assert str(raised.value) == error


def test_binary_data_of_another_type_is_refused():
    headers = {"ce-specversion": "1.0", "ce-id": "1", "ce-source": "s", "ce-type": "t"}
    with pytest.raises(InvalidMessage) as raised:
        cloudevents.received("text/plain", headers, "hi", 10**6)
    assert str(raised.value) == (
        "the CloudEvent's datacontenttype 'text/plain' is not application/json: "
        "run_outbox_consumer takes JSON data only"
    )


def test_a_route_takes_an_envelope_but_not_a_celery_one():
    routes = parse_routes({"a": {"queue": "a", "envelope": "cloudevents-structured"}}, "x")
    assert routes["a"].envelope == "cloudevents-structured"
    assert parse_routes({"a": {"queue": "a"}}, "x")["a"].envelope is None
    with pytest.raises(ValueError) as raised:
        parse_routes({"a": {"envelope": "cloudevent"}, "b": {"envelope": ["x"]}}, "x")
    assert str(raised.value) == (
        "route 'a' envelope must be one of outbox, cloudevents, cloudevents-structured; got "
        "'cloudevent' (did you mean 'cloudevents'?); route 'b' envelope must be one of outbox, "
        "cloudevents, cloudevents-structured; got ['x']"
    )


@pytest.mark.parametrize(
    ("outbox", "line"),
    [
        (
            {"DEFAULT_ENVELOPE": "cloud"},
            "django_outbox.E003: OUTBOX[\"DEFAULT_ENVELOPE\"] must be one of 'outbox', "
            "'cloudevents', 'cloudevents-structured'; got 'cloud'.",
        ),
        (
            {"CLOUDEVENTS_SOURCE": " "},
            'django_outbox.E003: OUTBOX["CLOUDEVENTS_SOURCE"] must be a non-empty string; '
            "got ' '.",
        ),
    ],
)
def test_the_settings_are_checked(outbox, line):
    with override_settings(OUTBOX={"BROKER_URL": "memory://", **outbox}):
        found = checks.run_checks(databases=[])
    assert [f"{m.id}: {m.msg}" for m in found if m.id.startswith("django_outbox")] == [line]


def test_a_frame_of_another_content_type_is_that_of_a_channel_of_it():
    method = method_frame(1, "", "q")
    wire = cloudevents.structured(message(), SOURCE)
    mine = PublishFrames(1, 131072, "application/json", "utf-8")
    theirs = PublishFrames(1, 131072, cloudevents.STRUCTURED_CONTENT_TYPE, "utf-8")
    assert mine.message(method, wire.body, wire.headers, "id", wire.content_type) == (
        theirs.message(method, wire.body, wire.headers, "id")
    )
