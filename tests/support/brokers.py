"""The test brokers, seen from outside the relay: their URLs, a connection, messages
read, put and taken as they are, queues deleted, and kombu's own publish of what the
relay sends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import redis
from django.conf import settings

from django_outbox.envelope import CONTENT_ENCODING, CONTENT_TYPE

AMQP_URL = settings.OUTBOX["BROKER_URL"]


REDIS_URL = settings.REDIS_URL


@contextmanager
def broker_connection(url: str = AMQP_URL) -> Iterator[kombu.Connection]:
    connection = kombu.Connection(url, connect_timeout=10)
    try:
        yield connection
    finally:
        connection.release()


def consume(
    queue: str,
    expected: int,
    *,
    url: str = AMQP_URL,
    timeout: float = 120,
    idle: float = 1.0,
) -> list[kombu.Message]:
    """Read every message from ``queue`` (acking each) until ``expected`` arrived and the
    queue stayed quiet for ``idle`` seconds, so extra (duplicate) messages are seen too."""
    received: list[kombu.Message] = []
    deadline = time.monotonic() + timeout
    with broker_connection(url) as connection:
        simple = connection.SimpleQueue(queue, no_ack=False)
        try:
            while time.monotonic() < deadline:
                try:
                    message = simple.get(block=True, timeout=idle)
                except simple.Empty:
                    if len(received) >= expected:
                        break
                    continue
                message.ack()
                received.append(message)
        finally:
            simple.close()
    return received


def delete_redis_keys(queue: str) -> None:
    """Delete the Redis keys of ``queue`` (its list, its bindings) and kombu's ``_``."""
    client = redis.Redis.from_url(REDIS_URL)
    client.delete(*client.keys(f"*{queue}*"), "_")
    client.close()


def delete_queue(queue: str, url: str = AMQP_URL) -> None:
    with broker_connection(url) as connection:
        kombu.Queue(queue, channel=connection.channel()).delete()


def publish_raw(queue: str, body: bytes | str, url: str = AMQP_URL, **properties: Any) -> None:
    """Put one message on ``queue`` as given (content type, headers ...): for the
    malformed messages a consumer must survive."""
    with broker_connection(url) as connection:
        producer = connection.Producer()
        producer.publish(body, routing_key=queue, retry=True, **properties)


def drain_raw(queue: str, url: str = AMQP_URL) -> list[kombu.Message]:
    """Take every message now in ``queue`` without decoding any (some may not decode)."""
    messages = []
    with broker_connection(url) as connection:
        bound = kombu.Queue(queue, channel=connection.channel())
        while (message := bound.get(no_ack=True)) is not None:
            messages.append(message)
    return messages


def publish_as_kombu(producer: kombu.Producer, route: Any, message: Any, **options: Any) -> None:
    """Publish a claimed ``message`` through kombu's own ``Producer.publish`` with what the
    relay sends (persistent, JSON, its wire headers, message id = event id), for tests that
    hold the relay's bytes or output against kombu's. ``options`` go to ``publish``."""
    headers = message.wire_headers()
    producer.publish(
        message.body,
        exchange=route.exchange,
        routing_key=route.routing_key_for(message.ordering_key),
        content_type=CONTENT_TYPE,
        content_encoding=CONTENT_ENCODING,
        headers=headers,
        delivery_mode=2,
        message_id=headers["event_id"],
        **options,
    )
