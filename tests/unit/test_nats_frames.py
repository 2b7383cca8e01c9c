"""The relay's NATS frames are the bytes nats-py's own ``publish()`` writes for the same
message (nats-py's real encoder, run on a client that never connects: what it queues
for its socket is compared; the frames reach a real JetStream cluster in
tests/integration/test_nats.py), and the headers NATS cannot carry are refused before
anything is sent."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client

from django_outbox import cloudevents
from django_outbox.conf import outbox_settings
from django_outbox.transports import nats as nats_transport
from django_outbox.transports import nats_frames
from django_outbox.transports.writers import envelope_of
from tests.support.rows import claimed_message


def nats_py_frame(subject: str, reply: str, body: bytes, headers: dict[str, str]) -> bytes:
    """What nats-py queues for its socket when publishing this message."""
    client = Client()  # not connected: its flusher is not started, the frame stays queued
    asyncio.run(client._send_publish(subject, reply, body, len(body), headers))
    return b"".join(client._pending)


def our_frame(subject: str, reply: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [nats_frames.header_line(name, value) for name, value in headers.items()]
    block = nats_frames.header_block(lines)
    return nats_frames.hpub(subject.encode(), reply.encode(), block, body)


@pytest.mark.parametrize(
    "headers",
    [
        {"event_id": "4c3f", "Nats-Msg-Id": "4c3f"},
        {"tenant": "  acme ", "empty": "", "unicode": "café ☕", "json": '{"a":[1,2]}'},
        {"x-a!#$%&'*+-.^_`|~9": "token characters", "Nats-Expected-Stream": "ORDERS"},
    ],
)
def test_a_frame_is_the_bytes_nats_py_writes(headers):
    body = '{"order_id": 7, "note": "naïve"}'.encode()
    args = ("outbox.orders", "_INBOX.abc.17", body, headers)
    assert our_frame(*args) == nats_py_frame(*args)


def test_a_relays_message_is_framed_as_nats_py_frames_its_headers():
    """The whole message as the transport encodes it (envelope headers, the message id,
    the expected stream), against nats-py given the same headers as text."""
    message = claimed_message(1, "orders")
    message.headers = {"tenant": "acme", "attempt": 2, "vip": True}
    route = outbox_settings.route_for("orders")
    wire = cloudevents.wire(message, *envelope_of(route, binary=False))
    block = nats_transport.header_block(message, wire, "ORDERS")
    texts = {
        name: nats_transport.header_text(name, value)
        for name, value in wire.headers.items()
        if value is not None
    }
    texts |= {"Nats-Msg-Id": str(message.event_id), "Nats-Expected-Stream": "ORDERS"}
    ours = nats_frames.hpub(b"outbox.orders", b"_INBOX.r.1", block, wire.body)
    assert ours == nats_py_frame("outbox.orders", "_INBOX.r.1", wire.body, texts)
    assert b"attempt: 2\r\n" in block and b"vip: true\r\n" in block


@pytest.mark.parametrize("name", ["a b", "a:b", "café", "(x)", ""])
def test_a_header_name_nats_cannot_carry_is_refused_before_sending(name):
    with pytest.raises(ValueError, match="cannot travel as a NATS header"):
        nats_frames.header_line(name, "v")


@pytest.mark.parametrize("value", ["two\nlines", "carriage\rreturn", "end\r\n", "\n start"])
def test_a_value_with_a_line_break_is_refused_naming_its_header(value):
    """nats-py would write a space in its place, or strip it: the value would not arrive
    as it was."""
    with pytest.raises(ValueError, match="'note' cannot travel as a NATS header"):
        lines = [nats_frames.header_line("ok", "fine"), nats_frames.header_line("note", value)]
        nats_frames.header_block(lines)


def test_a_user_header_jetstream_reads_itself_is_refused():
    message = claimed_message(1, "orders")
    message.headers = {"NATS-Rollup": "all"}
    route = outbox_settings.route_for("orders")
    wire = cloudevents.wire(message, *envelope_of(route, binary=False))
    with pytest.raises(ValueError, match="JetStream's own"):
        nats_transport.header_block(message, wire, "ORDERS")


def test_a_cloudevents_content_type_is_the_one_content_type_header():
    """On a structured CloudEvents route the relay's content type replaces a user header of
    that name: a client reading the first of two (Go's Header.Get) would read the user's."""
    message = claimed_message(1, "orders")
    message.headers = {"content-type": "text/plain", "tenant": "t1"}
    envelope = (cloudevents.STRUCTURED, "urn:test", False)
    block = nats_transport.header_block(message, cloudevents.wire(message, *envelope), "S")
    assert block.count(b"content-type: ") == 1
    assert b"content-type: application/cloudevents+json\r\n" in block


def test_a_reconnecting_connection_takes_no_frame_and_says_why():
    """The relay's batch is an outage, published again once the connection is back (nats-py
    would buffer it meanwhile); the error says the connection is reconnecting."""
    from nats.errors import ConnectionReconnectingError

    client = Client()
    client._status = Client.RECONNECTING
    with pytest.raises(ConnectionReconnectingError):
        asyncio.run(nats_frames.write(client, [b"HPUB s r 12 12\r\nNATS/1.0\r\n\r\n\r\n"]))
    assert client._pending == []


def test_a_parked_message_whose_header_nats_cannot_carry_is_refused_by_name():
    """A consumer may park a message another publisher sent, with a header the relay would
    never write; its replay fails with the event and the header named, not as a cluster
    outage."""
    import uuid

    from django.utils import timezone

    from django_outbox.consumer.replay_nats import _message
    from django_outbox.exceptions import OutboxError
    from django_outbox.models import InboxFailure

    event_id = uuid.uuid4()
    failure = InboxFailure(
        event_id=event_id, queue="orders", body="{}", headers={"trace/id": "7"},
        parked_at=timezone.now(),
    )  # fmt: skip
    with pytest.raises(OutboxError, match=f"parked event {event_id} cannot be replayed.*trace/id"):
        _message(failure)
