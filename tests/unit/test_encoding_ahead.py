"""A transport's wire form worked out ahead (``Transport.prepare``, on the relay's claim
thread) and read back by its publish: only by that transport, for that route; an encoding
that fails ahead is met again by the publish, as if nothing had been prepared."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid

import pytest

from django_outbox.conf.routes import Route
from django_outbox.envelope import ClaimedMessage
from django_outbox.transports.memory import MemoryTransport


class Counting(MemoryTransport):
    """Encodes a message as its payload's text, counting the calls; refuses "bad"."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encoder(self, route):
        def encode(message: ClaimedMessage) -> str:
            self.calls += 1
            if message.payload == '"bad"':
                raise ValueError("cannot encode")
            return f"{route.destination}:{message.payload}"

        return encode


def message(payload: str = '{"n": 1}') -> ClaimedMessage:
    now = dt.datetime.now(dt.UTC)
    return ClaimedMessage(1, uuid.uuid4(), "t.e", "orders", payload, {}, "", 0, now)


def test_a_prepared_message_is_read_back_without_encoding_it_again():
    transport, route, claimed = Counting(), Route("orders"), message()
    transport.prepare(route, [claimed])
    assert transport.calls == 1
    assert transport.encoded(route, claimed, transport.encoder(route)) == 'orders:{"n": 1}'
    assert transport.calls == 1


def test_another_route_or_transport_encodes_the_message_again():
    transport, route, claimed = Counting(), Route("orders"), message()
    transport.prepare(route, [claimed])
    other_route = Route("orders")  # equal, yet another object: settings reloaded
    assert transport.encoded(other_route, claimed, transport.encoder(other_route)) is not None
    assert transport.calls == 2
    other = Counting()
    assert other.encoded(route, claimed, other.encoder(route)) == 'orders:{"n": 1}'
    assert other.calls == 1


def test_an_encoding_that_fails_ahead_is_left_for_the_publish_to_meet():
    transport, route, bad, good = Counting(), Route("orders"), message('"bad"'), message()
    transport.prepare(route, [bad, good])
    assert (bad.encoded, good.encoded is not None) == (None, True)
    with pytest.raises(ValueError, match="cannot encode"):
        transport.encoded(route, bad, transport.encoder(route))


def test_a_transport_that_encodes_as_it_publishes_prepares_nothing():
    transport, claimed = MemoryTransport(), message()
    transport.prepare(Route("orders"), [claimed])
    assert claimed.encoded is None


class Broken(MemoryTransport):
    def encoder(self, route):
        raise RuntimeError("a bug in the transport")


def test_a_transport_whose_encoder_raises_leaves_the_claim_alone():
    """The claim has leased its rows: the error is the publish's to meet and report."""
    claimed = message()
    Broken().prepare(Route("orders"), [claimed])
    assert claimed.encoded is None


def test_the_prepared_form_is_no_part_of_the_messages_equality_or_repr():
    transport, prepared = Counting(), message()
    plain = dataclasses.replace(prepared)
    transport.prepare(Route("orders"), [prepared])
    assert prepared == plain
    assert repr(prepared) == repr(plain)
