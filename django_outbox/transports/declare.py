"""A route's topology declared on a broker: its durable exchange and queue (or a
partitioned route's consistent-hash exchange and partition queues), with their
arguments, bound. The relay and the consumer both declare, so either may start first
and nothing published before a consumer exists is dropped.

A queue or exchange the broker refuses to declare (it exists with other
arguments: 406 PRECONDITION_FAILED) is a configuration error, :class:`DeclareRefused`:
retrying cannot help. A declaration Redis refuses for want of memory is no such
refusal: it is an outage (see :func:`~.connection.transient_failure`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import amqp.exceptions  # type: ignore[import-untyped]
import kombu
import kombu.transport.virtual
from kombu.transport.virtual.base import NotEquivalentError

from ..conf.routes import PARTITION_EXCHANGE_TYPE, Route
from ..exceptions import OutboxConfigurationError
from .redis_wire import write_refusal


def binding_key(route: Route) -> str:
    """What the route's queue is bound with: ``{key}`` matches any key on a topic exchange."""
    return route.routing_key.replace("{key}", "#" if route.exchange_type == "topic" else "")


class DeclareRefused(OutboxConfigurationError):
    """The broker refused to declare a route's exchange or queue: it exists with other
    arguments (or type), or the user may not declare it. Retrying cannot help."""

    def __init__(self, kind: str, name: str, exc: BaseException, fix: str = "") -> None:
        keys = "exchange_type and exchange_arguments" if kind == "exchange" else "queue_arguments"
        fix = fix or (
            f"make the route's {keys} in OUTBOX['ROUTES'] match the existing {kind}, or delete it"
        )
        super().__init__(f"the broker refused to declare {kind} {name!r}: {exc}; {fix}")
        self.kind, self.name = kind, name


@contextlib.contextmanager
def _refusal(
    kind: str, name: str, refused: tuple[type[BaseException], ...], fix: str = ""
) -> Iterator[None]:
    """Turn the broker's refusal to declare ``name`` (one of ``refused``) into DeclareRefused;
    a Redis that refuses every write for now (out of memory, read-only ...) refuses
    declarations too: that one is raised as it is (an outage, see
    :func:`~.connection.transient_failure`)."""
    try:
        yield
    except refused as exc:
        if write_refusal(exc) is not None:
            raise
        raise DeclareRefused(kind, name, exc, fix) from exc


def refusal_errors(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """The errors with which a broker refuses a declaration: a channel error
    (AMQP 403, 404, 405, 406), RabbitMQ's 503 for an exchange type it does not know (a
    plugin's, not enabled: a connection error, which would count as an outage), or
    kombu's own for an inequivalent virtual exchange."""
    return (*connection.channel_errors, amqp.exceptions.InvalidCommand, NotEquivalentError)


def declare(
    channel: Any, route: Route, *, refused: tuple[type[BaseException], ...] = ()
) -> list[kombu.Queue]:
    """Declare the route's durable exchange and queue, with their arguments, and bind
    them; returns the queue (none when the route names none). A partitioned route
    (:attr:`Route.partitions`) gets its consistent-hash exchange and partition queues
    instead of the one queue, and returns those. Raises :class:`DeclareRefused`
    naming the exchange or queue when the broker refuses it with one of ``refused``
    (see :func:`refusal_errors`).

    The relay and the consumer both call this, so either may start first and
    nothing published before a consumer exists is dropped.
    """
    exchange = None
    if route.exchange:  # "" is the AMQP default exchange: nothing to declare
        exchange = kombu.Exchange(
            route.exchange,
            route.exchange_type,
            durable=True,
            arguments=dict(route.exchange_arguments) or None,
        )
        _check_exchange_type(channel, route)
        with _refusal("exchange", route.exchange, refused):
            exchange(channel).declare()
    if not route.queue:
        return []
    if route.partitions:
        return _declare_partitions(channel, route, refused)
    routing = binding_key(route) if exchange is not None else route.queue
    return [
        _declare_queue(
            channel, route, route.queue, exchange, routing, dict(route.queue_arguments), refused
        )
    ]


def _declare_queue(
    channel: Any,
    route: Route,
    name: str,
    exchange: kombu.Exchange | None,
    routing: str,
    arguments: Mapping[str, Any],
    refused: tuple[type[BaseException], ...],
) -> kombu.Queue:
    queue = kombu.Queue(
        name, exchange, routing_key=routing, durable=True, queue_arguments=dict(arguments) or None
    )(channel)
    try:
        queue.declare()
    except refused as exc:
        if write_refusal(exc) is not None:
            raise  # not a refusal: the outage of a Redis that takes no writes
        fix = _queue_type_fix(route, name) if "x-queue-type" in str(exc) else ""
        raise DeclareRefused("queue", name, exc, fix) from exc
    return queue


def _queue_type_fix(route: Route, name: str) -> str:
    """What to do about a queue that exists with another type than its route declares."""
    return (
        f"route {route.destination!r} declares queue {name!r} as a {route.queue_type} queue "
        "and a queue's type cannot change: set the route's queue_type to the type the queue "
        f"has, or drain the queue and delete it (rabbitmqctl delete_queue {name}) so it is "
        "declared afresh"
    )


#: What a broker without the consistent-hash exchange needs to carry partitions.
PARTITIONS_FIX = (
    "enable the RabbitMQ plugin (rabbitmq-plugins enable rabbitmq_consistent_hash_exchange), "
    "or drop 'partitions' from the route"
)


def _declare_partitions(
    channel: Any, route: Route, refused: tuple[type[BaseException], ...]
) -> list[kombu.Queue]:
    """The consistent-hash exchange of a partitioned route, bound to the route's exchange
    (an exchange-to-exchange binding), hashing each event's ``ordering_key`` header;
    and its partition queues, bound with weight 1 each and single-active-consumer, so
    one consumer at a time takes a partition and a second one waits as a standby."""
    name = route.partition_exchange
    if isinstance(channel, kombu.transport.virtual.Channel):
        raise DeclareRefused(
            "exchange",
            name,
            LookupError("this kombu transport has no consistent-hash exchange"),
            fix="partitions need RabbitMQ: drop 'partitions' from the route",
        )
    hashed = kombu.Exchange(
        name, PARTITION_EXCHANGE_TYPE, durable=True, arguments={"hash-header": "ordering_key"}
    )(channel)
    with _refusal("exchange", name, refused, PARTITIONS_FIX):
        hashed.declare()
        hashed.bind_to(route.exchange, routing_key=binding_key(route))
    arguments = {**dict(route.queue_arguments), "x-single-active-consumer": True}
    return [
        _declare_queue(channel, route, queue, hashed, "1", arguments, refused)
        for queue in route.partition_queues
    ]


def _check_exchange_type(channel: Any, route: Route) -> None:
    """kombu's virtual transports (Redis, filesystem, memory) know only some exchange
    types; with another one each publish failed with ``KeyError: 'headers'``."""
    if not isinstance(channel, kombu.transport.virtual.Channel):
        return  # RabbitMQ refuses an unknown type itself (see refusal_errors)
    known: dict[str, Any] = channel.exchange_types
    if route.exchange_type not in known:
        raise DeclareRefused(
            "exchange",
            route.exchange,
            LookupError(f"this kombu transport has no exchange type {route.exchange_type!r}"),
            fix=f"make the route's exchange_type one of {', '.join(sorted(known))}",
        )
