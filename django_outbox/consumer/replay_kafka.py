"""Replaying parked records to their Kafka topics: through one idempotent producer, as
the relay writes (key, murmur2 partition, headers), each record to the end of its topic
and unparked once the cluster acknowledged it (``acks=all``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..conf import kafka_bootstrap, outbox_settings
from ..conf.redact import mask_url
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE
from ..exceptions import OutboxConfigurationError, OutboxError
from ..transports.kafka import LIBRDKAFKA_LOG, record_headers
from ..transports.kafka import REQUIRED as PRODUCER
from .replay import replay_headers, unpark_replayed

if TYPE_CHECKING:
    from ..models import InboxFailure


def replay(url: str, options: dict[str, Any], parked: list[InboxFailure], timeout: float) -> None:
    """Replay ``parked`` (records of topics on the Kafka cluster ``url``), each delivered
    within ``timeout`` seconds; :class:`OutboxConfigurationError` when the broker's
    OPTIONS cannot build a producer."""
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
        _send(producer, failure, timeout)
        unpark_replayed(failure)


def _send(producer: Any, failure: InboxFailure, timeout: float) -> None:
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
