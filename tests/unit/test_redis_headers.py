"""The headers' JSON the relay writes into its Redis messages is kombu's JSON of the
message's wire headers, to the byte, whatever the message holds.

kombu's own encoder over ``ClaimedMessage.wire_headers()`` is the reference; no Redis
is needed to compare texts (tests/integration/test_redis_wire.py compares whole
messages against kombu's producer on a real Redis)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

import pytest

from django_outbox.envelope import ClaimedMessage
from django_outbox.transports.redis_wire import HeadersMemo, _encode_headers, headers_json

BASE = ClaimedMessage(
    id=1,
    event_id=uuid.UUID("12345678-1234-5678-1234-567812345678"),
    event_type="order.placed",
    destination="orders",
    payload="{}",
    headers={},
    ordering_key="",
    attempts=0,
    created_at=dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
)

SHAPES: dict[str, dict[str, Any]] = {
    "plain": {},
    "a key": {"ordering_key": "customer-42"},
    "a key to escape": {"ordering_key": 'quote " back \\ tab \t nul \x00 é ☕ 𝄞'},
    "an event type to escape": {"event_type": 'ordre.passé "vite"\n\u2028'},
    "a whole second": {"created_at": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)},
    "another zone": {
        "created_at": dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.timezone(dt.timedelta(hours=5)))
    },
    "naive (USE_TZ off)": {"created_at": dt.datetime(2026, 1, 2, 3, 4, 5, 6)},
    "ordered": {"ordering_key": "k", "sequence": 7},
    "ordered, a destination to escape": {"sequence": 1, "destination": 'dé"st'},
    "a skip marker": {"ordering_key": "k", "sequence": 2**40, "skipped": True},
    "skipped, unordered": {"skipped": True},
    "user headers": {"headers": {"tenant": "t1", "note": "ünïcode", "n": 3, "f": 1.5}},
    "nested user headers": {"headers": {"a": {"b": [1, None, True, "x"]}, "": ""}},
    "user headers kombu's encoder types": {
        "headers": {"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "d": Decimal("1.10")},
        "sequence": 3,
    },
    "a user's correlation id": {"headers": {"correlation_id": "c-1", "x": 1}},
    "a user's causation id": {"headers": {"y": 2, "causation_id": "e-0"}},
    "a user header named like a standard one": {"headers": {"event_id": "forged"}},
    "a user header named like an ordering one": {"headers": {"sequence": 99}, "sequence": 5},
    "a user's skipped header": {"headers": {"skipped": False}},
}


@pytest.mark.parametrize("shape", SHAPES)
def test_the_headers_json_is_kombus_json_of_the_wire_headers(shape):
    message = dataclasses.replace(BASE, **SHAPES[shape])
    expected = _encode_headers(message.wire_headers())
    assert headers_json(message, str(message.event_id)) == expected


def test_headers_met_before_in_a_batch_are_written_as_kombu_writes_them():
    """The writer keeps the text of headers whose values are all strings (``known``,
    one per batch): headers with equal items of other types must not get it (``1`` and
    ``True`` are equal, and so are ``0.0`` and ``-0.0``), nor headers in another order."""
    known = HeadersMemo()
    runs = [
        {"tenant": "t1"},
        {"tenant": "t1"},
        {"tenant": "t1", "note": "é"},
        {"note": "é", "tenant": "t1"},
        {"n": 1},
        {"n": True},
        {"n": 1.0},
        {"z": 0.0},
        {"z": -0.0},
        {"tenant": "t1", "list": [1]},
        {"tenant": "t1"},
    ]
    for headers in runs:
        message = dataclasses.replace(BASE, headers=headers)
        expected = _encode_headers(message.wire_headers())
        assert headers_json(message, str(message.event_id), None, known) == expected
    assert sorted(known.users) == [
        (("note", "é"), ("tenant", "t1")),
        (("tenant", "t1"),),
        (("tenant", "t1"), ("note", "é")),
    ]


def test_the_text_around_the_event_id_is_reused_only_for_messages_that_share_it():
    """The writer keeps the headers' text around the event id per event type, key, time
    and user headers (``known.around``): each message of a batch that changes one of
    them, or is ordered or a skip marker (never kept), must still get its own text."""
    known = HeadersMemo()
    later = dt.datetime(2026, 1, 2, 3, 4, 6, tzinfo=dt.UTC)
    changes = [
        {},
        {"event_id": uuid.UUID(int=7)},
        {"event_type": "order.paid"},
        {"ordering_key": "k"},
        {"ordering_key": "k", "created_at": later},
        {"ordering_key": "k", "created_at": later, "headers": {"tenant": "t1"}},
        {"ordering_key": "k", "headers": {"tenant": "t2"}},
        {"ordering_key": "k", "sequence": 1},
        {"ordering_key": "k", "sequence": 2},
        {"ordering_key": "k", "sequence": 2, "skipped": True},
        {"skipped": True},
        {},
    ]
    for change in changes:
        message = dataclasses.replace(BASE, **change)
        expected = _encode_headers(message.wire_headers())
        occurred_at = message.created_at.isoformat()
        assert headers_json(message, str(message.event_id), occurred_at, known) == expected
    assert len(known.around) == 6  # the unordered messages' distinct texts


@pytest.mark.parametrize("headers", [[1, 2], [], "abc", None], ids=repr)
def test_headers_that_are_not_a_dict_get_kombus_error_not_a_text(headers):
    """A row written around stage() can hold headers that are no JSON object (the portable
    claim returns them as they are): the message fails, as kombu's producer would make
    it, instead of a text no consumer can read."""
    message = dataclasses.replace(BASE, headers=headers)
    with pytest.raises((TypeError, ValueError)) as theirs:
        _encode_headers(message.wire_headers())
    with pytest.raises(type(theirs.value)):
        headers_json(message, str(message.event_id))


def test_a_header_kombus_json_cannot_encode_raises_its_error():
    message = dataclasses.replace(BASE, headers={"blob": object()})
    with pytest.raises(TypeError) as theirs:
        _encode_headers(message.wire_headers())
    with pytest.raises(TypeError) as ours:
        headers_json(message, str(message.event_id))
    assert str(ours.value) == str(theirs.value)
