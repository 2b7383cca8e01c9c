"""Transports publish claimed messages: kombu (RabbitMQ, Redis, filesystem ...), Kafka
(confluent-kafka; its transactional routes in :mod:`.kafka_transactions`), NATS JetStream
(:mod:`.nats`, through nats-py), the in-memory transport, Celery.

The registry maps a broker URL's scheme to the transport class that publishes to
it, like Django's ``CACHES``/``TASKS`` backends: :data:`REGISTRY` for the schemes
with a class of their own, :data:`KOMBU` for every other kombu transport, and
:data:`CELERY` for the routes with ``celery_task``. Classes are named by dotted path
and imported on first use, so a broker's driver (redis, celery) is needed only
where it is used. Adding a broker is one module with a :class:`Transport` subclass
and one line here.

A transport may import the settings, the routes, the envelope and the leaves; never
the row's life (:mod:`django_outbox.state`), the relay, the consumer, the admin, the
commands or the test helpers, which all build on it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ..exceptions import OutboxConfigurationError
from .base import Failure, Outcome, Transport

if TYPE_CHECKING:
    from ..conf import Broker

__all__ = [
    "REGISTRY",
    "Failure",
    "Outcome",
    "Transport",
    "celery_transport",
    "for_broker",
    "require_celery",
    "transport_class",
]

_KOMBU = "django_outbox.transports.kombu"

#: URL scheme -> ``"module:Class"`` of its transport.
REGISTRY: dict[str, str] = {
    **dict.fromkeys(("amqp", "amqps", "pyamqp"), f"{_KOMBU}:AmqpTransport"),
    **dict.fromkeys(("redis", "rediss", "sentinel"), f"{_KOMBU}:RedisTransport"),
    "filesystem": "django_outbox.transports.filesystem:FilesystemTransport",
    "kafka": "django_outbox.transports.kafka:KafkaTransport",
    "memory": "django_outbox.transports.memory:MemoryTransport",
    "nats": "django_outbox.transports.nats:NatsTransport",
}
#: The transport of every other scheme kombu knows (``sqs``, ``mongodb`` ...).
KOMBU = f"{_KOMBU}:KombuTransport"
#: The transport of the routes with ``celery_task``.
CELERY = "django_outbox.transports.celery:CeleryTransport"


def transport_class(scheme: str) -> type[Transport]:
    """The class that publishes to URLs of ``scheme`` (``redis+socket`` is ``redis``)."""
    return _load(REGISTRY.get(scheme.partition("+")[0].lower(), KOMBU))


def for_broker(broker: Broker) -> Transport:
    """A transport for ``broker`` (see :meth:`django_outbox.conf.OutboxSettings.require_broker`).
    Errors of its checks name the broker's alias when it comes from ``OUTBOX["BROKERS"]``."""
    cls = transport_class(broker.scheme)
    alias = broker.alias if broker.named else None
    return cls(broker.url, broker.options, alias=alias)  # type: ignore[call-arg]


def require_celery(routes: list[str]) -> None:
    """:class:`OutboxConfigurationError` naming the Celery ``routes`` and the pip extra
    when they exist and the celery package is not installed (E016's text)."""
    from ..conf import celery_problem

    problem = celery_problem(routes) if routes else None
    if problem is not None:
        raise OutboxConfigurationError(f"{problem.id}: {problem.msg}")


def celery_transport(routes: list[str]) -> Transport:
    """The transport of the Celery ``routes`` (see :func:`require_celery`)."""
    require_celery(routes)
    return _load(CELERY)()


def _load(path: str) -> type[Transport]:
    module, _, name = path.partition(":")
    cls: type[Transport] = getattr(importlib.import_module(module), name)
    return cls
