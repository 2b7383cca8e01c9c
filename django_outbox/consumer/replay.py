"""Put parked inbox messages back on their queue: ``outbox_replay_parked``.

A parked message keeps its body and headers in
:class:`~django_outbox.models.InboxFailure`. Once the handler is fixed, a
replay publishes each one again to the queue it came from (through the AMQP
default exchange, which routes by queue name on RabbitMQ and on kombu's virtual
transports alike), persistent and, on RabbitMQ, confirmed, then unparks its
record with a fresh count (:func:`django_outbox.inbox.records.unpark`, the inbox's own
write), so ``--max-deliveries`` applies anew.

A message parked by a consumer of a NATS JetStream broker goes back to the subject it came
from (its ``queue``), on the NATS broker of the route that publishes that subject, with
a ``Nats-Msg-Id`` of its own (see :func:`_replay_to_subjects`).

Publish first, unpark second: a replay cut short between the two leaves the
record parked and the message on the queue, so replaying again sends a
duplicate the inbox skips, never a message that is neither parked nor queued.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import amqp.exceptions  # type: ignore[import-untyped]
import kombu

from ..conf import kafka_bootstrap, outbox_settings
from ..conf.brokers import KAFKA_SCHEME, NATS_SCHEMES, broker_scheme, nats_servers
from ..conf.redact import mask_url
from ..conf.routes import JetStream
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE, is_broker_header
from ..exceptions import BrokerUnreachable, OutboxConfigurationError, OutboxError
from ..inbox.records import unpark
from ..transports.confirms import CONFIRM_TIMEOUT
from ..transports.connection import new_connection
from ..transports.declare import declare, refusal_errors
from ..transports.kafka import LIBRDKAFKA_LOG, record_headers
from ..transports.kafka import REQUIRED as PRODUCER
from ..transports.nats import (
    MSG_ID,
    EventLoop,
    close_client,
    cluster_errors,
    connect_options,
    header_text,
)

if TYPE_CHECKING:
    from ..models import InboxFailure, InboxFailureQuerySet

logger = logging.getLogger("django_outbox.replay")


def replay_parked(
    failures: InboxFailureQuerySet,
    *,
    url: str | None = None,
    confirm_timeout: float | None = None,
) -> list[InboxFailure]:
    """Publish each parked message of ``failures`` to its queue again and unpark it.

    Each message goes to the broker its queue's route names (``OUTBOX["BROKERS"]``;
    ``url`` sends them all to that broker instead), and must be confirmed within
    ``confirm_timeout`` seconds (default 30) on RabbitMQ. Returns the records replayed,
    oldest first. Raises
    :class:`~django_outbox.exceptions.OutboxConfigurationError` without a usable
    broker URL or when the broker refuses to declare a queue,
    :class:`~django_outbox.exceptions.OutboxError` when it refuses (nacks) a
    message, and kombu's errors
    when it cannot be reached (what was replayed before stays replayed).
    """
    parked = list(failures.parked().order_by("id"))
    if not parked:  # a broker to replay to is required all the same
        outbox_settings.require_broker() if url is None else outbox_settings.require_broker_url(url)
        return parked
    by_broker: dict[tuple[str, tuple[tuple[str, Any], ...]], list[InboxFailure]] = {}
    for failure in parked:
        by_broker.setdefault(_broker_of(failure.queue, url), []).append(failure)
    timeout = CONFIRM_TIMEOUT if confirm_timeout is None else confirm_timeout
    for (broker_url, options), group in by_broker.items():
        _replay(broker_url, dict(options), group, timeout)
    return parked


def _broker_of(queue: str, url: str | None) -> tuple[str, tuple[tuple[str, Any], ...]]:
    """The URL and transport options of the broker that ``queue`` lives on (the
    broker its route names), or ``url`` with the default broker's options."""
    if url:
        options = outbox_settings.BROKER_TRANSPORT_OPTIONS
        return outbox_settings.require_broker_url(url), tuple(options.items())
    for route in outbox_settings.ROUTES.values():  # a subject a route publishes to NATS
        nats = outbox_settings.brokers.get(route.broker)
        if nats is None or route.is_celery or broker_scheme(nats.url) not in NATS_SCHEMES:
            continue
        if (route.jetstream or JetStream()).subject_for(route.destination) == queue:
            return nats.url, tuple(nats.options.items())
    broker = outbox_settings.require_broker(outbox_settings.route_for_queue(queue).broker)
    return broker.url, tuple(broker.options.items())


def _replay(url: str, options: dict[str, Any], parked: list[InboxFailure], timeout: float) -> None:
    """Replay ``parked`` (messages of queues on one broker) through one connection."""
    if broker_scheme(url) == KAFKA_SCHEME:
        _replay_to_kafka(url, options, parked, timeout)
        return
    if broker_scheme(url) in NATS_SCHEMES:
        _replay_to_subjects(url, options, parked, timeout)
        return
    options = {**options, "confirm_publish": True}
    conn = new_connection(url, options)
    try:
        channel = conn.channel()
        producer = kombu.Producer(channel)
        declared: set[str] = set()
        for failure in parked:
            if failure.queue not in declared:
                # As its consumer declares it, so the replay cannot go nowhere.
                route = outbox_settings.route_for_queue(failure.queue)
                declare(channel, route, refused=refusal_errors(conn))
                declared.add(failure.queue)
            _publish(producer, failure, timeout)
            _unpark(failure)
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


def _replay_to_kafka(
    url: str, options: dict[str, Any], parked: list[InboxFailure], timeout: float
) -> None:
    """Replay ``parked`` (records of topics on one Kafka cluster) through one idempotent
    producer, as the relay writes (key, murmur2 partition, headers): each record to the
    end of its topic, unparked once the cluster acknowledged it (``acks=all``)."""
    from confluent_kafka import KafkaException, Producer

    config = {**options, **PRODUCER, "bootstrap.servers": kafka_bootstrap(url)}
    config.update({"message.timeout.ms": int(timeout * 1000), "logger": LIBRDKAFKA_LOG})
    try:
        producer = Producer(config)
    except (KafkaException, TypeError, ValueError) as exc:
        raise OutboxConfigurationError(
            f"the OPTIONS of {mask_url(url)} cannot build a Kafka producer: "
            + outbox_settings.redact(str(exc.args[0]))
        ) from None
    for failure in parked:
        _send_to_kafka(producer, failure, timeout)
        _unpark(failure)


def _send_to_kafka(producer: Any, failure: InboxFailure, timeout: float) -> None:
    """Write ``failure``'s record and wait for its delivery report; :class:`OutboxError`
    when the cluster does not acknowledge it."""
    headers = replay_headers(failure.headers)
    key = headers.get("ordering_key")
    reports: list[Any] = []  # the delivery report's error (None: acknowledged)

    def report(error: Any, _record: Any) -> None:
        reports.append(error)

    wire: list[Any] = record_headers(headers, CONTENT_TYPE)
    body = failure.body.encode(CONTENT_ENCODING)
    producer.produce(
        failure.queue,
        body,
        key.encode() if isinstance(key, str) and key else None,
        headers=wire,
        on_delivery=report,
    )
    producer.flush(timeout)
    if not reports or reports[0] is not None:
        reason = outbox_settings.redact(str(reports[0])) if reports else "no acknowledgement"
        raise OutboxError(
            f"the Kafka cluster did not take the message replayed to topic "
            f"{failure.queue} ({reason}); nothing more replayed"
        )


def _unpark(failure: InboxFailure) -> None:
    """``failure``, replayed, is unparked with a fresh count."""
    unpark(failure)
    logger.info(
        "%s: replayed parked event %s to %s",
        failure.consumer,
        failure.event_id,
        failure.queue,
        extra={
            "action": "inbox.replayed",
            "consumer": failure.consumer,
            "event_id": str(failure.event_id),
            "queue": failure.queue,
        },
    )


def replay_headers(headers: dict[str, Any]) -> dict[str, Any]:
    """The stored headers without those the broker or kombu added on delivery: the
    broker's old delivery count would count against the replayed message."""
    return {
        key: value
        for key, value in headers.items()
        if key != "redelivered" and not is_broker_header(key)
    }


def _replay_to_subjects(
    url: str, options: dict[str, Any], parked: list[InboxFailure], timeout: float
) -> None:
    """Publish each of ``parked`` (parked by consumers of the NATS broker ``url``) to its
    subject again, its PubAck awaited within ``timeout``, then unpark it. Its
    ``Nats-Msg-Id`` is its event id and the time it was parked: the stream does not drop
    it as a duplicate of the message first delivered (within the duplicate window), yet
    drops a second replay of the same parking, cut short before its unpark.
    :class:`BrokerUnreachable` when the cluster cannot be reached or does not answer."""
    from nats.aio.client import Client

    loop, client = EventLoop(), Client()
    try:
        options = connect_options("django_outbox replay", options)
        loop.run(client.connect(nats_servers(url), **options), timeout)
        js = client.jetstream(timeout=timeout)
        for failure in parked:
            loop.run(js.publish(failure.queue, **_nats_message(failure)), timeout + 1)
            _unpark(failure)
    except cluster_errors() as exc:
        raise BrokerUnreachable(
            f"cannot reach the NATS broker {mask_url(url)}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        close_client(loop, client)


def _nats_message(failure: InboxFailure) -> dict[str, Any]:
    """The payload and headers that replay ``failure`` to NATS."""
    assert failure.parked_at is not None  # parked() only
    headers = {
        name: header_text(name, value)
        for name, value in replay_headers(failure.headers).items()
        if value is not None
    }
    headers[MSG_ID] = f"{failure.event_id}:replay:{failure.parked_at.isoformat()}"
    return {"payload": failure.body.encode(CONTENT_ENCODING), "headers": headers}
