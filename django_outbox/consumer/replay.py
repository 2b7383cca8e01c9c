"""Put parked inbox messages back where they came from: ``outbox_replay_parked``.

A parked message keeps its body and headers in
:class:`~django_outbox.models.InboxFailure`. Once the handler is fixed, a replay
publishes each one again to the queue it came from, on the broker of that queue's route,
then unparks its record with a fresh count (:func:`django_outbox.inbox.records.unpark`,
the inbox's own write), so ``--max-deliveries`` applies anew.

Each broker's replay is a module of its own, named by the broker's URL scheme in
:data:`~.brokers.PARTS`: :mod:`.replay_kombu` (a queue of RabbitMQ, Redis or another
kombu broker), :mod:`.replay_kafka` (a Kafka topic), :mod:`.replay_nats` (a NATS
JetStream subject). Each is called with the broker's URL and options, the parked records
of its queues and the confirm timeout, and calls :func:`unpark_replayed` after each
publish.

Publish first, unpark second: a replay cut short between the two leaves the
record parked and the message on the queue, so replaying again sends a
duplicate the inbox skips, never a message that is neither parked nor queued.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from django.utils.module_loading import import_string

from ..conf import outbox_settings
from ..conf.brokers import NATS_SCHEMES, broker_scheme
from ..conf.routes import JetStream
from ..envelope import is_broker_header
from ..inbox.records import unpark
from ..transports.confirms import CONFIRM_TIMEOUT
from .brokers import parts

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
        import_string(parts(broker_url).replay)(broker_url, dict(options), group, timeout)
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


def unpark_replayed(failure: InboxFailure) -> None:
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
