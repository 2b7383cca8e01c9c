"""What each broker can carry of a route, by its URL's scheme: partition queues and
queue arguments (queue types, dead-letter exchanges) only on RabbitMQ, fanout on Redis
only as PUB/SUB, subjects and streams only on NATS JetStream (and no queue there). The
system checks (:func:`django_outbox.ops.checks.check_routes`) report what a route asks of
its broker that the broker cannot do; the settings
(:mod:`django_outbox.conf.routes`) check only what is wrong whatever the broker.
"""

from __future__ import annotations

from ..conf import KAFKA_SCHEME
from ..conf.brokers import NATS_SCHEMES
from ..conf.routes import Route, Shape

#: The schemes of kombu's Redis transport, whose fanout exchanges are PUB/SUB channels.
REDIS_SCHEMES = frozenset({"redis", "rediss", "redis+socket", "sentinel"})
#: The schemes of RabbitMQ (AMQP 0-9-1): the only brokers with the consistent-hash
#: exchange and exchange-to-exchange bindings that partition queues need.
AMQP_SCHEMES = frozenset({"amqp", "amqps", "pyamqp", "librabbitmq"})


def broker_shape_problems(route: Route, broker_scheme: str) -> list[Shape]:
    """What ``route`` asks of its broker that a broker of ``broker_scheme`` cannot do
    (nothing for a Celery route, or when the scheme is "", not known)."""
    if route.transactional and (route.is_celery or broker_scheme not in ("", KAFKA_SCHEME)):
        return [_transactional_elsewhere(route, broker_scheme)]
    if route.is_celery:
        return []
    if route.jetstream is not None and broker_scheme == KAFKA_SCHEME:
        return [_jetstream_elsewhere(route, broker_scheme)]
    if broker_scheme == KAFKA_SCHEME or route.is_kafka:
        return _kafka_problems(route, broker_scheme)
    if broker_scheme in NATS_SCHEMES:
        return _nats_problems(route, broker_scheme)
    name, exchange = route.destination, route.exchange
    if route.jetstream is not None and broker_scheme not in ("", "memory"):
        return [_jetstream_elsewhere(route, broker_scheme)]
    found = []
    elsewhere = broker_scheme and broker_scheme not in AMQP_SCHEMES  # "": not known
    if route.partitions and elsewhere:
        found.append(
            Shape(
                "partitions_not_rabbitmq",
                f"Route {name!r} has partitions, but its broker is {broker_scheme}://, which has "
                "no consistent-hash exchange: neither the relay nor run_outbox_consumer can "
                "declare them.",
                "Route it to a RabbitMQ broker (with the plugin "
                "rabbitmq_consistent_hash_exchange), or drop partitions: an ordered route "
                "without them is consumed in order on any transport.",
            )
        )
    # A test's memory:// stands in for the real broker: its queue arguments are moot.
    if elsewhere and broker_scheme != "memory":
        found += _queue_argument_problems(route, broker_scheme)
    if exchange and route.exchange_type == "fanout" and broker_scheme in REDIS_SCHEMES:
        found.append(
            Shape(
                "redis_fanout",
                f"Route {name!r} uses fanout exchange {exchange!r} on Redis, where kombu delivers "
                "fanout by PUB/SUB: an event reaches only the consumers connected at that "
                "moment and is lost, though PUBLISHED, when none is.",
                'Use a "topic" or "direct" exchange with a queue per consumer group, or RabbitMQ.',
            )
        )
    return found


def _transactional_elsewhere(route: Route, broker_scheme: str) -> Shape:
    """E063: ``"transactional": True`` on a route whose broker is not Kafka."""
    broker = "Celery's broker" if route.is_celery else f"{broker_scheme}://"
    return Shape(
        "transactional_not_kafka",
        f"Route {route.destination!r} is transactional, but its broker is {broker}: only "
        "Kafka publishes a batch in a transaction, so its events would go at least once "
        "instead of exactly once.",
        'Route it to a kafka:// broker (its broker key), or drop "transactional".',
    )


def _jetstream_elsewhere(route: Route, broker_scheme: str) -> Shape:
    """E070: a route with NATS JetStream keys whose broker is not NATS."""
    return Shape(
        "jetstream_not_nats",
        f"Route {route.destination!r} has NATS JetStream keys (subject, stream ...), but its "
        f"broker is {broker_scheme}://: they would be ignored.",
        "Route it to a nats:// broker, or drop the JetStream keys.",
    )


def _kafka_problems(route: Route, broker_scheme: str) -> list[Shape]:
    """A Kafka route (topic keys) on another broker, or queue keys on a Kafka broker:
    either would be silently ignored."""
    name = route.destination
    if broker_scheme and broker_scheme != KAFKA_SCHEME:
        return [
            Shape(
                "kafka_keys_elsewhere",
                f"Route {name!r} names a Kafka topic (topic, replication_factor or "
                f"topic_config), but its broker is {broker_scheme}://, which has no topics: "
                "they would be ignored.",
                "Route it to a kafka:// broker (its broker key), or drop those keys.",
            )
        ]
    if broker_scheme and (route.queue or route.queue_arguments or route.exchange_arguments):
        return [
            Shape(
                "queue_on_kafka",
                f"Route {name!r} declares a queue or queue/exchange arguments, but its broker is "
                "a Kafka cluster, which has topics only: they would be ignored.",
                'Give it "topic" (default: the destination), "partitions", '
                '"replication_factor" and "topic_config" instead.',
            )
        ]
    return []


def _nats_problems(route: Route, broker_scheme: str) -> list[Shape]:
    """What a route to a NATS JetStream broker asks that JetStream has no use for: a queue,
    partitions, queue or exchange arguments (its events go to a subject of a stream)."""
    asked = [
        key
        for key, value in (
            ("queue", route.queue),
            ("partitions", route.partitions),
            ("queue_arguments", route.queue_arguments),
            ("exchange_arguments", route.exchange_arguments),
        )
        if value
    ]
    if not asked:
        return []
    return [
        Shape(
            "queue_on_nats",
            f"Route {route.destination!r} gives {asked}, but its broker is {broker_scheme}:// "
            "(NATS JetStream), which publishes to a subject of a stream: they would be ignored.",
            'Give the route "subject" and "stream" (each defaults to the destination) instead.',
        )
    ]


def _queue_argument_problems(route: Route, broker_scheme: str) -> list[Shape]:
    """The queue arguments of ``route`` that a broker without them would silently drop."""
    name, found = route.destination, []
    if route.queue and route.queue_type != "classic":
        found.append(
            Shape(
                "queue_type_not_rabbitmq",
                f"Route {name!r} declares a {route.queue_type} queue, but its broker is "
                f"{broker_scheme}://, which has no queue types: its queue would silently be "
                "an ordinary one.",
                "Route it to a RabbitMQ broker, or drop queue_type (and x-queue-type).",
            )
        )
    if route.queue and route.dead_letter_exchange is not None:
        found.append(
            Shape(
                "queue_type_not_rabbitmq",
                f"Route {name!r} gives its queue the dead-letter exchange "
                f"{route.dead_letter_exchange!r}, but its broker is {broker_scheme}://, which "
                "ignores queue arguments: a parked message would be dropped, not dead-lettered.",
                "Route it to a RabbitMQ broker, or drop dead_letter_exchange (parked events "
                "stay in InboxFailure, replayable, either way).",
            )
        )
    return found
