"""The relay's AMQP frames on a real RabbitMQ (django_outbox/transports/amqp_frames.py):
the bytes kombu's own ``Producer.publish`` writes to the socket, and a message whose
content header does not fit in the connection's frame.

RabbitMQ offers each new connection the ``frame_max`` of its ``rabbit`` application
(131072 by default, rabbitmq.conf's ``frame_max``), and py-amqp 5.4 takes the broker's
value whatever the client asks. The small-frame tests set it to 4096 in the running node
(``rabbitmqctl eval``: the same value rabbitmq.conf sets at boot) for as long as the
relay's connection takes to open, then back: RabbitMQ holds that connection to 4096
bytes a frame and closes it (501 FRAME_ERROR) on a larger one, as a node configured so
would. Connections opened meanwhile by others would get 4096 too: ``disrupts``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kombu
import pytest
from amqp.method_framing import frame_writer
from django.db import transaction

from django_outbox import stage, stage_many
from django_outbox.conf import outbox_settings
from django_outbox.conf.routes import Route
from django_outbox.envelope import CONTENT_ENCODING, CONTENT_TYPE, ClaimedMessage
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from django_outbox.state import store
from django_outbox.transports.amqp_frames import PublishFrames, method_frame
from django_outbox.transports.base import Failure
from django_outbox.transports.kombu import AmqpTransport
from tests.support import (
    AMQP_URL,
    consume,
    delete_queue,
    publish_as_kombu,
    rabbitmqctl,
    unique_destination,
)

pytestmark = pytest.mark.django_db(transaction=True)

SMALL_FRAME_MAX = 4096


@pytest.fixture
def destination() -> Iterator[str]:
    name = unique_destination("frames")
    yield name
    delete_queue(name)


@contextlib.contextmanager
def small_frames() -> Iterator[None]:
    """RabbitMQ offers frame_max 4096 to the connections opened in the block."""
    before = rabbitmqctl("eval", "application:get_env(rabbit, frame_max).")
    found = re.fullmatch(r"\{ok,(\d+)\}", before.strip())
    assert found is not None, before
    rabbitmqctl("eval", f"application:set_env(rabbit, frame_max, {SMALL_FRAME_MAX}).")
    try:
        yield
    finally:
        rabbitmqctl("eval", f"application:set_env(rabbit, frame_max, {found.group(1)}).")


def small_frame_transport() -> AmqpTransport:
    """A transport whose connection RabbitMQ holds to 4096-byte frames."""
    transport = AmqpTransport(AMQP_URL)
    with small_frames():
        transport.check()  # connects, and has a probe confirmed
    assert transport._connection is not None
    assert transport._connection.connection.frame_max == SMALL_FRAME_MAX
    return transport


@pytest.mark.disrupts
def test_a_header_larger_than_the_frame_fails_alone_and_for_good(destination):
    """Events a, b, c staged together, b with a 5,000-byte header: b is abandoned at once,
    nothing of it written (the connection stays open), and a and c reach the queue once
    each. (Before: RabbitMQ closed the connection on b's header frame, 501 FRAME_ERROR,
    every unconfirmed message was charged an attempt, and so on until all three were
    abandoned, the queue holding copies of a and none of c.)"""
    with transaction.atomic():
        a, b, c = stage_many(
            [
                {"event_type": "t.a", "payload": {"n": 1}, "destination": destination},
                {
                    "event_type": "t.b",
                    "payload": {"n": 2},
                    "destination": destination,
                    "headers": {"x-big": "x" * 5000},
                },
                {"event_type": "t.c", "payload": {"n": 3}, "destination": destination},
            ]
        )
    transport = small_frame_transport()
    with Relay(transports={"default": transport}) as relay:
        stats = relay.run_once()
        assert relay.run_once().claimed == 0  # nothing left to retry
        connection = transport._connection
        assert connection is not None and connection.connected  # not closed by the broker
    assert (stats.published, stats.abandoned, stats.failed) == (2, 1, 0)
    rows = {row.event_id: row for row in OutboxMessage.objects.filter(destination=destination)}
    assert {rows[e.event_id].status for e in (a, c)} == {"published"}
    assert (rows[b.event_id].status, rows[b.event_id].attempts) == ("abandoned", 1)  # one try
    assert rows[b.event_id].last_error.startswith("FrameTooLarge: ")
    assert "frame_max (4096 bytes" in rows[b.event_id].last_error
    received = consume(destination, 2)
    assert [m.headers["event_id"] for m in received] == [str(a.event_id), str(c.event_id)]


@pytest.mark.disrupts
def test_the_limit_is_the_frames_payload_to_the_byte(destination):
    """A content header frame of exactly 4088 bytes (frame_max less its 8 bytes of
    framing) goes through RabbitMQ at 4096; one byte more fails alone, for good."""
    [message] = claimed(destination, headers={"x-pad": ""})
    route = outbox_settings.route_for(destination)
    assert route is not None
    frames = PublishFrames(1, SMALL_FRAME_MAX, CONTENT_TYPE, CONTENT_ENCODING)
    method = method_frame(1, route.exchange, destination)
    data = frames.message(method, b"", message.wire_headers(), str(message.event_id))
    pad = SMALL_FRAME_MAX - 8 - header_frame_size(data[len(method) :])
    fits = dataclasses.replace(message, headers={"x-pad": "p" * pad})
    over = dataclasses.replace(
        message, id=0, event_id=uuid.uuid4(), headers={"x-pad": "p" * (pad + 1)}
    )
    transport = small_frame_transport()
    try:
        outcomes = transport.publish(route, [fits, over])
    finally:
        transport.close()
    assert outcomes[0] is None
    assert isinstance(outcomes[1], Failure) and outcomes[1].permanent
    assert outcomes[1].error.startswith("FrameTooLarge: ")
    [received] = consume(destination, 1)
    assert received.headers["event_id"] == str(fits.event_id)


def claimed(destination: str, **stage_options: Any) -> list[ClaimedMessage]:
    """One event staged to ``destination``, as the relay claims it."""
    with transaction.atomic():
        stage("order.placed", {"n": 1}, destination=destination, **stage_options)
    return list(
        store.claim(
            "default", limit=1, lease_seconds=60, worker="t", token=uuid.uuid4(), ordered=True
        )
    )


def header_frame_size(data: bytes) -> int:
    """The payload size of the first frame in ``data`` (a content header frame)."""
    assert data[0] == 2, "not a content header frame"
    return int.from_bytes(data[3:7], "big")


class Recorder:
    """Stands in for a py-amqp connection's socket writer: keeps each write's bytes and
    passes them on to the real socket."""

    def __init__(self, write: Callable[[bytes], None]) -> None:
        self.written: list[bytes] = []
        self._write = write

    def write(self, data: bytes) -> None:
        self.written.append(bytes(data))
        self._write(data)


@contextlib.contextmanager
def recording(connection: kombu.Connection) -> Iterator[Recorder]:
    """Record what ``connection`` (connected, py-amqp) writes to its socket in the block:
    py-amqp's frame writer (kombu's publish) and the transport's own writes (the relay's)."""
    amqp_connection = connection.connection
    socket_writer = amqp_connection.transport
    recorder = Recorder(socket_writer.write)
    writer = amqp_connection.frame_writer
    amqp_connection.frame_writer = frame_writer(amqp_connection, recorder)
    socket_writer.write = recorder.write
    try:
        yield recorder
    finally:
        amqp_connection.frame_writer = writer
        del socket_writer.write  # back to the class's method


def transport_frames(transport: AmqpTransport, route: Route, message) -> bytes:  # type: ignore[no-untyped-def]
    """What the relay's transport writes to its socket to publish ``message``."""
    transport.publish(route, [message])  # declares the queue first: not recorded
    assert transport._connection is not None
    with recording(transport._connection) as recorder:
        transport.publish(route, [message])
    return b"".join(recorder.written)


def kombu_frames(route: Route, message) -> bytes:  # type: ignore[no-untyped-def]
    """What kombu's own ``Producer.publish`` writes to the socket for ``message`` (as the
    relay publishes: persistent, JSON content type, its headers and message id, and
    mandatory, as the relay's returns need), on a channel numbered as the relay's."""
    with kombu.Connection(AMQP_URL) as connection:
        producer = kombu.Producer(connection.channel(), auto_declare=False)
        with recording(connection) as recorder:
            publish_as_kombu(producer, route, message, mandatory=True, retry=False)
    return b"".join(recorder.written)


@pytest.mark.parametrize("size", [12, 131072 - 8, 300_000], ids=["small", "one frame", "three"])
def test_the_relays_bytes_are_those_of_kombus_producer(destination, size):
    """Byte for byte on the socket, properties (priority 0 among them: flags 0xf880)
    and body frames alike, for a body in one frame, filling one, and over three."""
    payload = {"text": "x" * (size - 12)}  # a body of ``size`` bytes
    [message] = claimed(
        destination,
        key="k-1",
        headers={"tenant": "t1", "x-int": 7, "x-flag": True, "x-none": None},
    )
    message = dataclasses.replace(message, payload=json.dumps(payload))
    assert len(message.body) == size
    route = outbox_settings.route_for(destination)
    assert route is not None
    transport = AmqpTransport(AMQP_URL)
    try:
        relay = transport_frames(transport, route, message)
    finally:
        transport.close()
    expected = kombu_frames(route, message)
    assert relay == expected
    header = 8 + int.from_bytes(expected[3:7], "big")  # after the method frame
    flags = header + 7 + 12  # past its frame head, class, weight and body size
    assert expected[flags : flags + 2] == b"\xf8\x80"  # priority among the properties
    received = consume(destination, 3)
    assert {m.properties.get("priority") for m in received} == {0}
    assert all(m.payload == payload for m in received)
