"""Property: whatever is passed to ``stage()`` on PostgreSQL is either stored and
relayed as docs/staging.md ("What a consumer gets") says, or refused with a specific
StagingError; never a DatabaseError, and the caller's transaction stays usable.

Hypothesis generates payloads (nested JSON-ish values with NUL characters, surrogates,
huge integers, floats with NaN and infinities, Decimals, datetimes), keys, headers and
event types; each accepted event is committed, published by a real relay to real
RabbitMQ and read back from the queue.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
from typing import Any

import kombu
import pytest
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from django_outbox import (
    InvalidEvent,
    PayloadNotSerializable,
    PayloadTooLarge,
    StagingError,
    stage,
)
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from tests.support import broker_connection, delete_queue, unique_destination
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)

#: Characters that matter here, drawn often: the unstorable ones, what escapes look like.
TRICKY = st.sampled_from(["\x00", "\ud800", "\udbff", "\udc00", "\\", "u", "0", '"', "é", "😀"])
TEXT = st.text(st.one_of(TRICKY, st.characters(exclude_categories=())), max_size=12)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**200), max_value=2**200),
    st.sampled_from([2**63, -(2**63) - 1]),
    # Python will not write an int of over 4300 digits: refused
    st.integers(4295, 4305).map(lambda digits: 10**digits),
    st.floats(),  # NaN and infinities included: refused
    st.decimals(),  # NaN and infinities are strings: stored
)
TIMES = st.one_of(
    st.datetimes(timezones=st.one_of(st.none(), st.just(dt.UTC))),
    st.datetimes(
        timezones=st.builds(
            dt.timezone, st.timedeltas(dt.timedelta(hours=-23), dt.timedelta(hours=23))
        )
    ),
    st.dates(),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TIMES, TEXT)
JSONISH = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)
EVENTS = st.fixed_dictionaries(
    {
        "event_type": st.text(st.one_of(TRICKY, st.characters()), min_size=1, max_size=12),
        "payload": JSONISH,
        "key": st.one_of(st.none(), st.text(st.one_of(TRICKY, st.characters()), min_size=1)),
        "headers": st.one_of(st.none(), st.dictionaries(TEXT, JSONISH, max_size=3)),
    }
)
REFUSALS = (InvalidEvent, PayloadNotSerializable, PayloadTooLarge)


def documented(value: Any) -> Any:
    """What the consumer decodes, per docs/staging.md, with every number as an exact
    Decimal (so 1e+20 and 100000000000000000000 compare equal, as they are)."""
    text = json.dumps(value, cls=DjangoJSONEncoder)
    return json.loads(text, parse_float=decimal.Decimal, parse_int=decimal.Decimal)


def exact(value: Any) -> Any:
    """``value`` (a decoded header) with every number as an exact Decimal."""
    return json.loads(json.dumps(value), parse_float=decimal.Decimal, parse_int=decimal.Decimal)


def jsonb_key_order(value: Any) -> list[list[str]]:
    """Each object's keys as PostgreSQL's jsonb orders them: by UTF-8 length, then bytes."""
    if isinstance(value, list):
        return [order for item in value for order in jsonb_key_order(item)]
    if isinstance(value, dict):
        keys = sorted(value, key=lambda k: (len(k.encode()), k.encode()))
        return [keys] + [order for k in keys for order in jsonb_key_order(value[k])]
    return []


def key_order(value: Any) -> list[list[str]]:
    """Each object's keys in the order the decoded body has them."""
    if isinstance(value, list):
        return [order for item in value for order in key_order(item)]
    if isinstance(value, dict):
        return [list(value)] + [order for v in value.values() for order in key_order(v)]
    return []


def stored_text(pk: int) -> str:
    table = OutboxMessage._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT payload::text FROM "{table}" WHERE id = %s', [pk])
        return cursor.fetchone()[0]


def stage_or_refuse(event: dict[str, Any], destination: str) -> OutboxMessage | None:
    """Stage ``event`` between two business writes; the row, or None when refused."""
    row = None
    with transaction.atomic():
        Order.objects.create(customer="before", total=1)
        try:
            row = stage(destination=destination, **event)
        except StagingError as exc:
            assert isinstance(exc, REFUSALS), repr(exc)
            assert "\n" not in str(exc)
        Order.objects.create(customer="after", total=1)  # the transaction is usable
    return row


@pytest.fixture
def destination():
    name = unique_destination("property")
    yield name
    delete_queue(name)


def test_every_event_is_stored_and_relayed_as_documented_or_refused(destination):
    seen = {"stored": 0, "refused": 0}
    with Relay() as relay, broker_connection() as broker:
        queue = kombu.Queue(destination, channel=broker.channel())

        @settings(
            max_examples=200,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(event=EVENTS)
        def stored_relayed_or_refused(event: dict[str, Any]) -> None:
            orders = Order.objects.count()
            row = stage_or_refuse(event, destination)
            assert Order.objects.count() == orders + 2
            if row is None:
                seen["refused"] += 1
                return
            seen["stored"] += 1
            assert relay.run_once().published == 1
            message = queue.get(no_ack=True)
            assert message is not None
            # kombu decodes the UTF-8 body: equal text is equal bytes.
            assert message.body == stored_text(row.pk)  # sent as stored
            received = json.loads(
                message.body, parse_float=decimal.Decimal, parse_int=decimal.Decimal
            )
            assert received == documented(event["payload"])
            assert key_order(received) == jsonb_key_order(documented(event["payload"]))
            assert message.headers["ordering_key"] == event["key"]
            assert message.headers["event_type"] == event["event_type"]
            for name, value in (event["headers"] or {}).items():
                assert exact(message.headers[name]) == documented(value)

        stored_relayed_or_refused()
    # Both outcomes were exercised (Hypothesis's first examples are the simple ones).
    assert seen["stored"] > 10 and seen["refused"] > 10, seen
