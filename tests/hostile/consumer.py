"""Triggers for the "Consumers: failing handlers and foreign messages" section of
docs/hostile-input.md: real messages on the test RabbitMQ, consumed by
``InboxConsumer`` in this process; each returns the log line the consumer wrote."""

from __future__ import annotations

import bz2
import logging
import pickle
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kombu
from django.core.management import CommandError, call_command

from django_outbox import ReceivedEvent
from django_outbox.consumer import InboxConsumer
from tests.support import REDIS_URL, broker_connection, delete_queue, unique_destination

from . import case, error_line


def refuse(event: ReceivedEvent) -> None:
    raise RuntimeError("the payment service said 503")


def die(event: ReceivedEvent) -> None:
    """Stands in for a SIGKILL mid-handler: the consumer stops holding the message
    unacked, and the broker redelivers it marked redelivered."""
    raise SystemExit("killed mid-handler")


@contextmanager
def queue_with(body: bytes, **properties: Any) -> Iterator[str]:
    """A fresh durable queue holding one message published as given."""
    queue = unique_destination("h")
    with broker_connection() as connection:
        kombu.Queue(queue, durable=True)(connection.channel()).declare()
        connection.Producer().publish(body, routing_key=queue, **properties)
    try:
        yield queue
    finally:
        delete_queue(queue)


def event(body: bytes = b'{"id": 1}') -> dict[str, Any]:
    return {
        "body": body,
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": {"event_id": str(uuid.uuid4()), "event_type": "order.placed"},
    }


def consume(queue: str, handler: Callable[[ReceivedEvent], object], **options: Any) -> None:
    """Run a consumer until the queue is idle for a second (or its handler "dies")."""
    try:
        InboxConsumer(queue, handler, "billing", **options).run(idle_timeout=1)
    except SystemExit:
        pass


def logged(action: str, run: Callable[[], None], stop: threading.Event | None = None) -> str:
    """The message of the first consumer log record with ``action`` while ``run()`` ran;
    ``stop`` is set once it came."""
    lines: list[str] = []

    def emit(record: logging.LogRecord) -> None:
        if getattr(record, "action", None) == action:
            lines.append(record.getMessage())
            if stop is not None:
                stop.set()

    handler = logging.Handler()
    handler.emit = emit  # type: ignore[method-assign]
    logger = logging.getLogger("django_outbox.consumer")
    logger.addHandler(handler)
    try:
        run()
    finally:
        logger.removeHandler(handler)
    assert lines, f"no {action} record"
    return lines[0]


def rejected(body: bytes, **properties: Any) -> str:
    with queue_with(body, **properties) as queue:
        return logged("inbox.rejected", lambda: consume(queue, refuse))


@case("consumer-not-json")
def not_json(request: object) -> str:
    return rejected(
        b'{"id": 1}',
        content_type="application/data",
        content_encoding="binary",
        headers={"event_id": str(uuid.uuid4())},
    )


@case("consumer-pickle")
def pickled(request: object) -> str:
    return rejected(
        pickle.dumps({"id": 1}),
        content_type="application/x-python-serialize",
        content_encoding="binary",
        headers={"event_id": str(uuid.uuid4())},
    )


@case("consumer-bad-json")
def bad_json(request: object) -> str:
    message = event(b"{not json")
    return rejected(message.pop("body"), **message)


@case("consumer-no-event-id")
def no_event_id(request: object) -> str:
    message = event()
    message["headers"] = {"event_id": "42"}
    return rejected(message.pop("body"), **message)


@case("consumer-handler-failed")
def handler_failed(request: object) -> str:
    message = event()
    with queue_with(message.pop("body"), **message) as queue:
        stop = threading.Event()  # set at the first failure: the message goes back at once
        consumer = InboxConsumer(queue, refuse, "billing", stop=stop)
        return logged("inbox.handler_failed", lambda: consumer.run(), stop)


@case("consumer-parked")
def parked(request: object) -> str:
    message = event()
    with queue_with(message.pop("body"), **message) as queue:
        return logged("inbox.parked", lambda: consume(queue, refuse, max_deliveries=1))


@case("consumer-crash-parked")
def crash_parked(request: object) -> str:
    message = event()
    with queue_with(message.pop("body"), **message) as queue:
        consume(queue, die, max_deliveries=1)  # a fresh delivery: not counted
        consume(queue, die, max_deliveries=1)  # redelivered: counted, then "killed"
        return logged("inbox.parked", lambda: consume(queue, die, max_deliveries=1))


@case("consumer-retry-delay-over-max")
def retry_delay_over_max(request: object) -> str:
    try:
        call_command(
            "run_outbox_consumer",
            "--queue=orders",
            "--handler=tests.testapp.handlers.record",
            "--retry-delay=60",
            "--retry-max-delay=30",
        )
    except CommandError as exc:
        return error_line(exc)
    raise AssertionError("run_outbox_consumer accepted the options")


@case("replay-not-parked")
def replay_not_parked(request: object) -> str:
    try:
        call_command("outbox_replay_parked", "--event-id", "7d3c1a52-5f0e-4a8e-9c11-0b6f4c1f2e9a")
    except CommandError as exc:
        return error_line(exc)
    raise AssertionError("outbox_replay_parked replayed nothing without an error")


@case("replay-nacked")
def replay_nacked(request: object) -> str:
    from django.conf import settings
    from django.test import override_settings
    from django.utils import timezone

    from django_outbox.models import InboxFailure

    queue = unique_destination("h")
    event_id = uuid.uuid4()
    InboxFailure.objects.create(
        consumer="billing",
        event_id=event_id,
        queue=queue,
        body="{}",
        headers={"event_id": str(event_id)},
        parked_at=timezone.now(),
    )
    full = {"queue": queue, "queue_arguments": {"x-max-length": 0, "x-overflow": "reject-publish"}}
    try:
        with override_settings(OUTBOX={**settings.OUTBOX, "ROUTES": {queue: full}}):
            call_command("outbox_replay_parked", "--event-id", str(event_id))
    except CommandError as exc:
        return error_line(exc)
    finally:
        delete_queue(queue)
    raise AssertionError("outbox_replay_parked replayed to a full queue without an error")


def ordered_event(sequence: int = 1, **headers: Any) -> dict[str, Any]:
    """An event of an ordered route's key ``order-1`` at ``sequence``, a fresh event id."""
    message = event()
    message["headers"].update(
        destination="orders", ordering_key="order-1", sequence=sequence, **headers
    )
    return message


def put(queue: str, message: dict[str, Any]) -> None:
    """Publish one more message as given to ``queue``."""
    with broker_connection() as connection:
        connection.Producer().publish(message.pop("body"), routing_key=queue, **message)


@case("consumer-sequence-conflict")
def sequence_conflict(request: object) -> str:
    first = ordered_event()
    with queue_with(first.pop("body"), **first) as queue:
        put(queue, ordered_event())  # another event id claiming the same sequence
        return logged("inbox.conflict", lambda: consume(queue, lambda event: None))


@case("consumer-compressed")
def compressed(request: object) -> str:
    message = event(bz2.compress(b'{"id": 1}'))
    message["headers"]["compression"] = "application/x-bz2"
    return rejected(message.pop("body"), **message)


class Unprintable(Exception):
    def __str__(self) -> str:  # a library's bug
        raise RuntimeError("no str for you")


def refuse_unprintably(event: ReceivedEvent) -> None:
    raise Unprintable()


@case("consumer-unprintable-error")
def unprintable_error(request: object) -> str:
    message = event()
    with queue_with(message.pop("body"), **message) as queue:
        return logged("inbox.parked", lambda: consume(queue, refuse_unprintably, max_deliveries=1))


@case("consumer-unstorable-key")
def unstorable_key(request: object) -> str:
    message = ordered_event()
    message["headers"]["ordering_key"] = "order-1\x00"  # a NUL: PostgreSQL cannot store it
    with queue_with(message.pop("body"), **message) as queue:
        return logged("inbox.rejected", lambda: consume(queue, lambda event: None))


@case("consumer-redis-unreadable")
def redis_unreadable(request: object) -> str:
    import json

    message = {"body": "e30=", "headers": ["a", "list"], "properties": {"delivery_tag": "1"}}
    return pushed_to_redis(json.dumps(message))


@case("consumer-redis-not-json")
def redis_not_json(request: object) -> str:
    return pushed_to_redis(b"not json {")


def pushed_to_redis(item: str | bytes) -> str:
    """The line a consumer logs of ``item``, pushed onto a Redis queue's list."""
    import redis
    from django.test import override_settings

    queue, client = unique_destination("h"), redis.Redis.from_url(REDIS_URL)
    try:
        with override_settings(OUTBOX={"BROKER_URL": REDIS_URL}):
            consume(queue, refuse)  # declares it
            client.lpush(queue, item)
            return logged("inbox.rejected", lambda: consume(queue, refuse))
    finally:
        client.delete(queue)
        client.close()
