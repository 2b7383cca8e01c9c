"""Generated broker messages through the consumer, on real RabbitMQ and PostgreSQL.

Hypothesis publishes messages with arbitrary bodies, content types, content
encodings and headers (odd ``event_id`` values among them) with a raw kombu
producer, to a queue that one ``InboxConsumer`` consumes in a thread for the
whole test. After each example the queue must drain: every message handled,
acked as a duplicate, parked or rejected (a failure is requeued until it is
parked), the consumer still running, and no event handled twice.
"""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import kombu
import pytest
from django.db import connections
from django.db.models import Count
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from django_outbox import ReceivedEvent
from django_outbox.consumer import ConsumerStats, InboxConsumer
from tests.support import AMQP_URL, broker_connection, delete_queue, unique_destination, wait_until
from tests.testapp.models import Delivery

pytestmark = pytest.mark.django_db(transaction=True)

#: A few event ids, so that generated messages share them (duplicates, failures
#: and successes of one event).
EVENT_IDS = [uuid.uuid4() for _ in range(4)]

text = st.text(max_size=20)  # lone surrogates included: py-amqp sends and reads them
header_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)  # RabbitMQ fails on those: 541
    | text
    | st.binary(max_size=10),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(min_size=1, max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)
event_id = (st.sampled_from(EVENT_IDS) | st.uuids()).flatmap(
    lambda u: st.sampled_from([str(u), str(u).upper(), f"{{{u}}}", u.urn, u.hex])
)
odd_event_id = (
    event_id
    | text
    | st.integers(-(2**63), 2**63 - 1)
    | st.none()
    | st.lists(st.integers(0, 9), max_size=2)
)
headers = st.fixed_dictionaries(
    {},
    optional={
        "event_id": odd_event_id,
        "event_type": text | st.integers(-(2**63), 2**63 - 1) | st.text(min_size=256, max_size=300),
        "x-delivery-count": st.integers(-1, 10) | text,
        "compression": st.sampled_from(["application/x-gzip", "zlib", "nonsense"]),
    },
).flatmap(
    lambda fixed: st.dictionaries(st.text(min_size=1, max_size=8), header_value, max_size=3).map(
        lambda extra: {**extra, **fixed}
    )
)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
payload = json_value | st.fixed_dictionaries({"fail": st.booleans()}, optional={"n": json_value})
body = payload.map(lambda value: json.dumps(value).encode()) | st.binary(max_size=40)
content_type = st.just("application/json") | st.sampled_from(
    [
        "application/data",
        "application/text",
        "text/plain",
        "application/x-python-serialize",
        "application/json; charset=utf-8",
        "application/x-yaml",
    ]
)
#: Anything a producer can put on the queue.
foreign_message = st.fixed_dictionaries(
    {
        "body": body,
        "content_type": content_type,
        "content_encoding": st.sampled_from(["utf-8", "UTF-8", "binary", "latin-1", "nonsense"]),
        "headers": headers,
    },
    optional={"message_id": event_id | text},
)
#: What a relay publishes (with odd headers of its users): half of the examples.
event_message = st.fixed_dictionaries(
    {
        "body": payload.map(lambda value: json.dumps(value).encode()),
        "content_type": st.just("application/json"),
        "content_encoding": st.just("utf-8"),
        "headers": st.tuples(headers, event_id).map(lambda h: {**h[0], "event_id": h[1]}),
    }
)
message = event_message | foreign_message


def _event(payload: object, event_id: uuid.UUID) -> dict[str, Any]:
    body = json.dumps(payload).encode()
    headers = {"event_id": str(event_id)}
    return {
        "body": body,
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": headers,
    }


_HANDLED, _FAILING = uuid.uuid4(), uuid.uuid4()
#: One example that reaches every outcome, whatever the generator draws: handled, the
#: same event again (duplicate), a handler failure until parked, a foreign message.
EVERY_OUTCOME = [
    _event({"n": 1}, _HANDLED),
    _event({"n": 1}, _HANDLED),
    _event({"fail": True}, _FAILING),
    {**_event({"n": 2}, uuid.uuid4()), "content_type": "application/data"},
]


def handler(event: ReceivedEvent) -> None:
    if isinstance(event.payload, dict) and event.payload.get("fail"):
        raise RuntimeError("the handler refuses this event")
    Delivery.objects.create(consumer="property", event_id=event.event_id)


def settled(stats: ConsumerStats) -> int:
    """Messages with a final outcome."""
    return stats.handled + stats.duplicates + stats.parked + stats.rejected


def publish(queue: str, properties: dict[str, Any]) -> bool:
    """Publish with a confirm; False if RabbitMQ refuses the message itself (it answers
    some header tables with INTERNAL_ERROR), which then never reaches a consumer."""
    with kombu.Connection(AMQP_URL, transport_options={"confirm_publish": True}) as connection:
        try:
            connection.Producer().publish(routing_key=queue, **properties)
        except (*connection.channel_errors, *connection.connection_errors):
            return False
    return True


def queue_depth(queue: str) -> int:
    with broker_connection() as connection:
        return kombu.Queue(queue, channel=connection.channel()).queue_declare(passive=True)[1]


@pytest.fixture
def running_consumer():
    """An InboxConsumer in a thread: no delay before a requeue, parks at 2 deliveries."""
    queue = unique_destination("p")
    stop = threading.Event()
    consumer = InboxConsumer(queue, handler, "property", max_deliveries=2, retry_delay=0, stop=stop)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run()
        except BaseException as exc:  # the property: this never happens
            errors.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="consumer")
    thread.start()
    wait_until(lambda: queue_depth_or_none(queue) is not None, timeout=30, what="queue declared")
    yield queue, consumer, thread, errors
    stop.set()
    thread.join(timeout=30)
    delete_queue(queue)
    assert errors == []


def queue_depth_or_none(queue: str) -> int | None:
    try:
        return queue_depth(queue)
    except Exception:  # not declared yet: the broker closed the channel
        return None


def test_generated_messages_are_each_settled_and_never_crash_the_consumer(running_consumer):
    queue, consumer, thread, errors = running_consumer

    @settings(
        max_examples=40,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(st.lists(message, min_size=1, max_size=6))
    @example(EVERY_OUTCOME)
    def check(messages: list[dict[str, Any]]) -> None:
        before = settled(consumer.stats)
        messages = [properties for properties in messages if publish(queue, properties)]
        wait_until(
            lambda: settled(consumer.stats) - before >= len(messages) and queue_depth(queue) == 0,
            timeout=30,
            what=f"{len(messages)} messages settled",
        )
        assert settled(consumer.stats) - before == len(messages), consumer.stats
        assert errors == [] and thread.is_alive()
        stats = consumer.stats
        assert stats.received == settled(stats) + stats.failed
        twice = Delivery.objects.values("event_id").annotate(n=Count("id")).filter(n__gt=1)
        assert list(twice) == []

    check()
    # Every outcome was reached (EVERY_OUTCOME makes sure of it).
    stats = consumer.stats
    assert min(stats.handled, stats.duplicates, stats.parked, stats.rejected) > 0, stats
