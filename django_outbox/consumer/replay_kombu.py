"""Replaying parked messages to their queues on a kombu broker (RabbitMQ, Redis ...):
through the AMQP default exchange, which routes by queue name on RabbitMQ and on
kombu's virtual transports alike, persistent and, on RabbitMQ, confirmed; each queue
declared first, as its consumer declares it, so that a replay cannot go nowhere."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import amqp.exceptions  # type: ignore[import-untyped]
import kombu

from ..conf import outbox_settings
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE
from ..exceptions import OutboxError
from ..transports.connection import new_connection
from ..transports.declare import declare, refusal_errors
from .replay import replay_headers, unpark_replayed

if TYPE_CHECKING:
    from ..models import InboxFailure


def replay(url: str, options: dict[str, Any], parked: list[InboxFailure], timeout: float) -> None:
    """Replay ``parked`` (messages of queues on one broker) through one connection, each
    confirmed within ``timeout`` seconds on RabbitMQ."""
    conn = new_connection(url, {**options, "confirm_publish": True})
    try:
        channel = conn.channel()
        producer = kombu.Producer(channel)
        declared: set[str] = set()
        for failure in parked:
            if failure.queue not in declared:
                route = outbox_settings.route_for_queue(failure.queue)
                declare(channel, route, refused=refusal_errors(conn))
                declared.add(failure.queue)
            _publish(producer, failure, timeout)
            unpark_replayed(failure)
    except BaseException:
        # No close handshake: a broker that blocked or stopped answering (a resource
        # alarm, a silent network) would never reply to it, and the replay would hang.
        conn.collect()
        raise
    conn.release()


def _publish(producer: kombu.Producer, failure: InboxFailure, timeout: float) -> None:
    try:
        producer.publish(
            failure.body.encode(CONTENT_ENCODING),
            exchange="",
            routing_key=failure.queue,
            content_type=CONTENT_TYPE,
            content_encoding=CONTENT_ENCODING,
            headers=replay_headers(failure.headers),
            message_id=str(failure.event_id),
            delivery_mode=2,
            confirm_timeout=timeout,  # a broker that never confirms (blocked, silent)
        )
    except amqp.exceptions.MessageNacked:  # e.g. a full queue with x-overflow reject-publish
        raise OutboxError(
            f"the broker refused the message replayed to {failure.queue} "
            "(negative acknowledgement); nothing more replayed"
        ) from None
