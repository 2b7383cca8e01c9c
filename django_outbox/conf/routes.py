"""Where an event goes: the ``OUTBOX["ROUTES"]`` table and the default route.

This module only parses and describes routes; :mod:`django_outbox.conf` decides
which route a destination takes (``outbox_settings.route_for()``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from collections.abc import Callable, Iterable, Mapping

#: A destination (and so a default queue name) is 1-255 characters: letters,
#: digits and ``. _ - : /``, starting with a letter or digit.
DESTINATION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,254}")

EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")
STRING_KEYS = frozenset({"exchange", "exchange_type", "routing_key", "queue", "broker", "topic"})
#: Keys of a broker route that become arguments of its queue: ``queue_type`` is
#: ``x-queue-type``, ``dead_letter_exchange`` is ``x-dead-letter-exchange``.
QUEUE_OPTION_KEYS = {"queue_type": "x-queue-type", "dead_letter_exchange": "x-dead-letter-exchange"}
ARGUMENT_KEYS = frozenset({"queue_arguments", "exchange_arguments"})
#: Keys of a Kafka route (see :attr:`Route.topic`): its topic, and how the relay creates
#: the topic when it is missing (with ``partitions``).
KAFKA_KEYS = frozenset({"topic", "replication_factor", "topic_config"})
BROKER_KEYS = STRING_KEYS | ARGUMENT_KEYS | frozenset(QUEUE_OPTION_KEYS) | KAFKA_KEYS
CELERY_KEYS = frozenset({"celery_task"})
#: Keys any broker route may take that are not names: see :attr:`Route.ordered` and
#: :attr:`Route.partitions`.
FLAG_KEYS = frozenset({"ordered", "partitions", "transactional"})
#: Keys of a NATS JetStream route (:class:`JetStream`): the subject its events are published
#: on, the stream that stores them, and how that stream is made when it is missing.
JETSTREAM_KEYS = frozenset({"subject", "stream", "replicas", "duplicate_window", "create_stream"})
#: The keys whose values are checked by their own rules, not as strings (the JetStream
#: keys by the route's JetStream parse: its subject and stream are names NATS takes).
NOT_STRING_KEYS = ARGUMENT_KEYS | FLAG_KEYS | JETSTREAM_KEYS | {"envelope", *KAFKA_KEYS} - {"topic"}
#: A JetStream stream name: no white space, ``.``, ``*``, ``>``, path separators.
STREAM_RE = re.compile(r"[A-Za-z0-9_-]{1,255}")
#: A NATS subject: tokens of printable characters separated by ``.``, no wildcards.
SUBJECT_RE = re.compile(r"[^\s.*>]+(\.[^\s.*>]+)*")
#: The most replicas a JetStream stream may have (NATS's own limit).
MAX_REPLICAS = 5
#: A broker route's ``envelope``: how its events go on the wire. ``"outbox"`` is the
#: outbox's own format (docs/concepts.md); the two others are CloudEvents 1.0
#: (:mod:`django_outbox.cloudevents`): ``"cloudevents"`` in binary content mode where the
#: broker has a binding that defines one (RabbitMQ), structured elsewhere (Redis);
#: ``"cloudevents-structured"`` in structured mode everywhere.
ENVELOPES = ("outbox", "cloudevents", "cloudevents-structured")
#: The most partition queues one route may have.
MAX_PARTITIONS = 1024
#: The exchange type that spreads a partitioned route's events over its partition
#: queues by ordering key (RabbitMQ's plugin ``rabbitmq_consistent_hash_exchange``).
PARTITION_EXCHANGE_TYPE = "x-consistent-hash"
#: The queue types a route may declare (RabbitMQ's ``x-queue-type``). Streams are not
#: among them: a stream cannot requeue or dead-letter a message, which the consumer's
#: retries, held-back ordered events and parking need.
QUEUE_TYPES = ("classic", "quorum")
#: AMQP names (exchange, queue) and routing keys are short strings: at most 255 bytes.
MAX_NAME_BYTES = 255


@dataclasses.dataclass(frozen=True)
class JetStream:
    """Where a NATS JetStream route's events go: the ``subject`` they are published on and
    the ``stream`` that must hold them (each defaults to the destination, the stream's
    name with every character NATS refuses in it as ``_``). A missing stream is created
    with ``replicas`` and ``duplicate_window`` (seconds during which the stream drops a
    message whose ``Nats-Msg-Id`` it has stored) unless ``create_stream`` is False."""

    subject: str = ""
    stream: str = ""
    replicas: int = 1
    duplicate_window: float = 120.0
    create_stream: bool = True

    def subject_for(self, destination: str) -> str:
        return self.subject or destination

    def stream_for(self, destination: str) -> str:
        return self.stream or re.sub(r"[^A-Za-z0-9_-]", "_", destination)


#: ``x-`` arguments of a queue or exchange, as sorted ``(name, value)`` pairs (hashable,
#: so a :class:`Route` can be kept in a set); ``dict(arguments)`` gives them back.
Arguments = tuple[tuple[str, "str | int | float | bool"], ...]


#: The broker alias of a route that names none, and of the default route.
DEFAULT_BROKER = "default"

#: The Celery task that runs Django tasks (``django.tasks``) enqueued through
#: :class:`django_outbox.tasks.OutboxTaskBackend`: every one is sent as this task.
TASK_RUNNER = "django_outbox.run_task"
#: A Django task's outbox row goes to the destination ``django.tasks:<queue_name>``,
#: whose route is made here (:meth:`Route.for_tasks`), never named in ``ROUTES``.
TASKS_PREFIX = "django.tasks:"


def is_valid_destination(value: object) -> bool:
    return isinstance(value, str) and DESTINATION_RE.fullmatch(value) is not None


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'queue'?)`` when ``word`` is a near miss of one of ``choices``
    (difflib's ratio 0.6 or more), else ``""``: the suffix of an error about a typo."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, sorted(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclasses.dataclass(frozen=True)
class Route:
    """How one destination is published.

    Either a broker route (``exchange`` of ``exchange_type``, ``routing_key``,
    and an optional durable ``queue`` declared and bound to it, each declared
    with its ``x-`` arguments), or a Celery route (``celery_task``: the task
    name given to ``send_task``). A broker route publishes to the broker of
    ``OUTBOX["BROKERS"]`` named ``broker`` (default ``"default"``); a Celery route to
    the Celery app's broker.
    """

    destination: str
    exchange: str = ""
    exchange_type: str = "topic"
    routing_key: str = ""
    queue: str | None = None
    celery_task: str | None = None
    queue_arguments: Arguments = ()
    exchange_arguments: Arguments = ()
    broker: str = DEFAULT_BROKER
    #: Strict per-key order (DESIGN guarantee 4): the events of one ordering key are
    #: published in the commit order of their staging transactions, one batch of a key
    #: in flight at a time, each with a gap-free ``sequence`` header. See docs/ordering.md.
    ordered: bool = False
    #: On a Kafka broker: each batch in one Kafka transaction, with a record of the events
    #: the log holds, so that none is written twice (docs/kafka.md#exactly-once).
    transactional: bool = False
    #: On an ordered route, the number of partition queues its events are spread over
    #: by ordering key, so several consumers share the load and keep per-key order
    #: (0: the one ``queue``). See docs/ordered-consumption.md.
    partitions: int = 0
    #: One of :data:`ENVELOPES`; None: ``OUTBOX["DEFAULT_ENVELOPE"]``.
    envelope: str | None = None
    #: On a Kafka broker: the topic (None: the destination's name). A route with any
    #: of :data:`KAFKA_KEYS` is a Kafka route, whose ``partitions`` are its topic's.
    topic: str | None = None
    #: On a Kafka broker, how a missing topic is created (0: the cluster's default).
    replication_factor: int = 0
    #: On a Kafka broker, the missing topic's configuration (``retention.ms`` ...).
    topic_config: Arguments = ()

    #: Its NATS JetStream subject and stream (the route's JetStream keys); None when it
    #: gives none (on a ``nats://`` broker: both the destination's).
    jetstream: JetStream | None = None

    @property
    def is_kafka(self) -> bool:
        """Whether it names any of :data:`KAFKA_KEYS`."""
        return self.topic is not None or bool(self.replication_factor or self.topic_config)

    @property
    def topic_name(self) -> str:
        """The Kafka topic its events go to."""
        return self.topic or self.destination

    @property
    def is_celery(self) -> bool:
        return self.celery_task is not None

    @property
    def queue_type(self) -> str:
        """The type its queue (and partition queues) is declared with: ``"classic"``
        unless its ``queue_arguments`` (or its ``queue_type`` option) say otherwise."""
        return str(dict(self.queue_arguments).get("x-queue-type", "classic"))

    @property
    def dead_letter_exchange(self) -> str | None:
        """Where the broker sends a message the consumer rejects (a parked or undecodable
        one); None when the queue has no ``x-dead-letter-exchange``."""
        value = dict(self.queue_arguments).get("x-dead-letter-exchange")
        return None if value is None else str(value)

    @property
    def partition_exchange(self) -> str:
        """The consistent-hash exchange between the route's exchange and its partitions."""
        return f"{self.queue}.partitions"

    @property
    def partition_queues(self) -> tuple[str, ...]:
        """The names of the partition queues: ``<queue>.0``, ``<queue>.1`` ... (none
        when the route is not partitioned)."""
        return tuple(f"{self.queue}.{number}" for number in range(self.partitions))

    def routing_key_for(self, key: str) -> str:
        """The routing key of a message with ordering key ``key`` ("" for none)."""
        return self.routing_key.replace("{key}", key)

    @classmethod
    def for_tasks(cls, destination: str) -> Route | None:
        """The route of a Django task queue's destination (``django.tasks:<queue>``): the
        task runner, sent to the Celery queue named like the task's ``queue_name``. None
        for any other destination."""
        queue = destination.removeprefix(TASKS_PREFIX)
        if queue == destination or not queue:
            return None
        return cls(destination, celery_task=TASK_RUNNER, queue=queue)

    @classmethod
    def default(cls, destination: str, exchange: str, *, ordered: bool = False) -> Route:
        """The route of a destination not named in ``ROUTES``: nothing is dropped
        before a consumer exists, because the queue is declared with the exchange."""
        return cls(destination, exchange, "topic", destination, destination, ordered=ordered)


def parse_routes(value: object, default_exchange: str) -> dict[str, Route]:
    """Turn the ``ROUTES`` setting into :class:`Route` objects.

    Raises ``ValueError`` with every reason found, each naming its route, joined
    by "; " (a route with a misspelt key and a misspelt exchange type says both).
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a dict of destination -> route dict; got {type(value).__name__}")
    routes, reasons = {}, []
    for name, spec in value.items():
        try:
            routes[name] = _parse_route(name, spec, default_exchange)
        except ValueError as exc:
            reasons.append(str(exc))
    if reasons:
        raise ValueError("; ".join(reasons))
    return routes


def _check_route_name(name: object) -> str:
    """``name`` if it can name a route: a valid destination the tasks backend does not own."""
    if not is_valid_destination(name):
        raise ValueError(
            f"route name {name!r} is not a valid destination "
            f"(1-255 characters of letters, digits and ._:/-)"
        )
    assert isinstance(name, str)
    if name.startswith(TASKS_PREFIX):
        raise ValueError(
            f"route name {name!r} starts with {TASKS_PREFIX!r}, which is kept for the queues "
            "of the Django tasks backend (their route is made for them)"
        )
    return name


def _reasons(*checks: Callable[[], object]) -> list[str]:
    """The ``ValueError`` text of each check that raises one, so that a route's
    independent problems are all reported at once."""
    found = []
    for check in checks:
        try:
            check()
        except ValueError as exc:
            found.append(str(exc))
    return found


def _parse_route(name: object, spec: object, default_exchange: str) -> Route:
    name = _check_route_name(name)
    if not isinstance(spec, Mapping):
        raise ValueError(f"route {name!r} must be a dict; got {type(spec).__name__}")
    # An "ordered" that is no bool is reported on its own; partitions are then checked
    # as if it were True, so they add no second, misleading reason.
    ordered = spec.get("ordered", False) is not False
    reasons = _reasons(
        lambda: _check_keys(name, spec),
        lambda: _ordered(name, spec),
        lambda: _transactional(name, spec),
        lambda: _partitions(name, spec, ordered),
        lambda: _envelope(name, spec),
        lambda: _jetstream(name, spec),
        *(
            functools.partial(_check_string, name, key, val)
            for key, val in spec.items()
            if key not in NOT_STRING_KEYS
        ),
        lambda: _kafka_options(name, spec),
        lambda: _queue_arguments(name, spec),
        lambda: _arguments(name, "exchange_arguments", spec.get("exchange_arguments", {})),
        lambda: _arguments(name, "topic_config", spec.get("topic_config", {})),
        lambda: _check_exchange_type(name, spec),
    )
    if reasons:
        raise ValueError("; ".join(reasons))
    if "celery_task" in spec:
        transactional = spec.get("transactional", False)  # E063 says it cannot be
        return Route(name, celery_task=spec["celery_task"], transactional=transactional)
    return Route(
        name,
        exchange=spec.get("exchange", default_exchange),
        exchange_type=spec.get("exchange_type", "topic"),
        routing_key=spec.get("routing_key", name),
        queue=spec.get("queue") or None,
        queue_arguments=_queue_arguments(name, spec),
        exchange_arguments=_arguments(
            name, "exchange_arguments", spec.get("exchange_arguments", {})
        ),
        broker=spec.get("broker") or DEFAULT_BROKER,
        ordered=ordered,
        transactional=spec.get("transactional", False),
        partitions=_partitions(name, spec, ordered),
        envelope=spec.get("envelope"),
        topic=spec.get("topic"),
        replication_factor=spec.get("replication_factor", 0),
        topic_config=_arguments(name, "topic_config", spec.get("topic_config", {})),
        jetstream=_jetstream(name, spec),
    )


def _jetstream(name: str, spec: Mapping[str, object]) -> JetStream | None:
    """A route's JetStream keys (None when it has none): names NATS takes, never beside an
    exchange's or a Celery task's keys."""
    given = JETSTREAM_KEYS.intersection(spec)
    if not given:
        return None
    mixed = sorted(set(spec) & (BROKER_KEYS | CELERY_KEYS | {"partitions"}) - {"broker"})
    if mixed:
        raise ValueError(
            f"route {name!r} mixes NATS JetStream keys {sorted(given)} with {mixed}; a "
            "JetStream route takes subject, stream and the stream's settings"
        )
    subject, stream = spec.get("subject", ""), spec.get("stream", "")
    if not isinstance(subject, str) or (subject and not SUBJECT_RE.fullmatch(subject)):
        raise ValueError(
            f"route {name!r} subject must be a NATS subject without wildcards (tokens "
            f"separated by '.'); got {subject!r}"
        )
    if not isinstance(stream, str) or (stream and not STREAM_RE.fullmatch(stream)):
        raise ValueError(
            f"route {name!r} stream must be a JetStream stream name (letters, digits, _ "
            f"and -); got {stream!r}"
        )
    return JetStream(subject, stream, *_stream_settings(name, spec))


def _stream_settings(name: str, spec: Mapping[str, object]) -> tuple[int, float, bool]:
    """A JetStream route's ``replicas``, ``duplicate_window`` and ``create_stream``."""
    replicas = spec.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ValueError(f"route {name!r} replicas must be a whole number; got {replicas!r}")
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"route {name!r} replicas must be 1-{MAX_REPLICAS}; got {replicas}")
    window = spec.get("duplicate_window", 120.0)
    if isinstance(window, bool) or not isinstance(window, int | float) or window <= 0:
        raise ValueError(
            f"route {name!r} duplicate_window must be a positive number of seconds; got {window!r}"
        )
    create = spec.get("create_stream", True)
    if not isinstance(create, bool):
        raise ValueError(f"route {name!r} create_stream must be True or False; got {create!r}")
    return replicas, float(window), create


def _kafka_options(name: str, spec: Mapping[str, object]) -> None:
    """A Kafka route's ``replication_factor`` (a whole number, 1 or more; its
    ``topic_config`` is checked as arguments are)."""
    if "replication_factor" not in spec:
        return
    factor = spec["replication_factor"]
    if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
        raise ValueError(
            f"route {name!r} replication_factor must be a whole number of 1 or more; got {factor!r}"
        )


def _check_keys(name: str, spec: Mapping[str, object]) -> None:
    """The keys of route ``name``: known ones (a near miss says which it resembles),
    celery_task not mixed with a broker route's, no empty broker or celery_task."""
    keys = set(spec)
    known = BROKER_KEYS | CELERY_KEYS | FLAG_KEYS | JETSTREAM_KEYS | {"envelope"}
    unknown = sorted(map(str, keys - known))
    if unknown:
        named = ", ".join(f"{key!r}{did_you_mean(key, known)}" for key in unknown)
        raise ValueError(f"route {name!r} has unknown keys [{named}]")
    if keys & CELERY_KEYS and keys & BROKER_KEYS:
        raise ValueError(
            f"route {name!r} mixes celery_task with {sorted(keys & BROKER_KEYS)}; "
            "use one or the other"
        )
    if spec.get("broker") == "":
        raise ValueError(f"route {name!r} has an empty broker alias")
    if "celery_task" in spec and not spec["celery_task"]:
        raise ValueError(f"route {name!r} has an empty celery_task")


def _check_exchange_type(name: str, spec: Mapping[str, object]) -> None:
    exchange_type = spec.get("exchange_type", "topic")
    if not isinstance(exchange_type, str):
        return  # _check_string says it
    if exchange_type not in EXCHANGE_TYPES and not exchange_type.startswith("x-"):
        raise ValueError(
            f"route {name!r} exchange_type must be one of {', '.join(EXCHANGE_TYPES)} "
            f"or a plugin type starting with x-; got {exchange_type!r}"
            + did_you_mean(exchange_type, EXCHANGE_TYPES)
        )


def _transactional(name: str, spec: Mapping[str, object]) -> None:
    """A route's ``transactional`` flag is a bool (its broker is the checks' business)."""
    value = spec.get("transactional", False)
    if not isinstance(value, bool):
        raise ValueError(
            f"route {name!r} key 'transactional' must be True or False; got {type(value).__name__}"
        )


def _ordered(name: str, spec: Mapping[str, object]) -> bool:
    """A route's ``ordered`` flag: a bool, and never on a Celery route."""
    ordered = spec.get("ordered", False)
    if not isinstance(ordered, bool):
        raise ValueError(
            f"route {name!r} key 'ordered' must be True or False; got {type(ordered).__name__}"
        )
    if ordered and "celery_task" in spec:
        raise ValueError(
            f"route {name!r} cannot be ordered: Celery workers run tasks concurrently, so no "
            "order survives them; use a broker route and run_outbox_consumer"
        )
    return ordered


def _envelope(name: str, spec: Mapping[str, object]) -> None:
    """A route's ``envelope``: one of :data:`ENVELOPES`, and never on a Celery route."""
    if "envelope" not in spec:
        return
    envelope = spec["envelope"]
    if envelope not in ENVELOPES or not isinstance(envelope, str):
        raise ValueError(
            f"route {name!r} envelope must be one of {', '.join(ENVELOPES)}; got {envelope!r}"
            + did_you_mean(envelope, ENVELOPES)
        )
    if "celery_task" in spec:
        raise ValueError(
            f"route {name!r} sends Celery tasks (celery_task), whose message is Celery's own "
            "protocol: it takes no envelope; use a broker route and run_outbox_consumer"
        )


def _partitions(name: str, spec: Mapping[str, object], ordered: bool) -> int:
    """A route's ``partitions``: a whole number of queues, on an ordered route with a
    named exchange and a queue."""
    if "partitions" not in spec:
        return 0
    partitions = spec["partitions"]
    if not isinstance(partitions, int) or isinstance(partitions, bool):
        raise ValueError(
            f"route {name!r} key 'partitions' must be a whole number; "
            f"got {type(partitions).__name__}"
        )
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ValueError(f"route {name!r} partitions must be 1-{MAX_PARTITIONS}; got {partitions}")
    if KAFKA_KEYS & set(spec):
        return partitions  # a Kafka topic's partitions, which need no queue nor order
    if "celery_task" in spec:
        raise ValueError(
            f"route {name!r} has partitions but sends Celery tasks (celery_task): partitions "
            "are queues of a broker route, for run_outbox_consumer"
        )
    if not ordered:
        raise ValueError(
            f'route {name!r} has partitions but is not ordered: add "ordered": True '
            "(partitions keep each key's events on one queue, for ordered consumption)"
        )
    if not spec.get("queue"):
        raise ValueError(
            f"route {name!r} has partitions but no queue: name the queue "
            "(its partitions are <queue>.0, <queue>.1 ...)"
        )
    if spec.get("exchange") == "":
        raise ValueError(
            f'route {name!r} has partitions on the default exchange "": name an exchange '
            "(the partitions' consistent-hash exchange is bound to it), or leave exchange out "
            "to use OUTBOX['DEFAULT_EXCHANGE']"
        )
    return partitions


def _queue_arguments(name: str, spec: Mapping[str, object]) -> Arguments:
    """A route's ``queue_arguments`` with its ``queue_type`` and ``dead_letter_exchange``
    options folded in; an option that contradicts the argument it stands for, a queue
    type RabbitMQ has not (or a stream), or an option without a queue is refused."""
    arguments = dict(_arguments(name, "queue_arguments", spec.get("queue_arguments", {})))
    for key, argument in QUEUE_OPTION_KEYS.items():
        if key not in spec:
            continue
        if not spec.get("queue"):
            raise ValueError(f"route {name!r} has {key} but no queue: name the queue it is for")
        value = str(spec[key])  # a string: checked with the route's other names
        if not value:
            raise ValueError(f"route {name!r} has an empty {key}")
        if arguments.setdefault(argument, value) != value:
            raise ValueError(
                f"route {name!r} has {key} {value!r} but queue_arguments[{argument!r}] "
                f"{arguments[argument]!r}: give one of them"
            )
    queue_type = arguments.get("x-queue-type", "classic")
    if queue_type == "stream":
        raise ValueError(
            f"route {name!r} queue type 'stream' is not supported: a stream cannot requeue or "
            "dead-letter a message, which retries and parking need; use 'quorum'"
        )
    if queue_type not in QUEUE_TYPES:
        raise ValueError(
            f"route {name!r} queue type must be one of {', '.join(QUEUE_TYPES)}; got {queue_type!r}"
            + did_you_mean(queue_type, QUEUE_TYPES)
        )
    return tuple(sorted(arguments.items()))


def _check_string(name: str, key: str, value: object) -> None:
    """A route's name or routing key: a string (``queue`` may be None) of at most
    :data:`MAX_NAME_BYTES`, which py-amqp could not even frame."""
    if not isinstance(value, str) and not (key == "queue" and value is None):
        raise ValueError(f"route {name!r} key {key!r} must be a string; got {type(value).__name__}")
    if isinstance(value, str) and len(value.encode()) > MAX_NAME_BYTES:
        raise ValueError(
            f"route {name!r} {key} is {len(value.encode())} bytes long; AMQP takes "
            f"at most {MAX_NAME_BYTES}"
        )


#: The header names a Celery task message cannot carry from the user: the protocol-2
#: headers Celery writes (``celery.app.amqp.AMQP.as_task_v2``), which ``send_task`` lets
#: a header of the same name replace (the task to run, its id, on which the inbox
#: dedupes, eta, expires ...); every name of a task's request (``celery.app.task.Context``,
#: which the worker fills from the headers, so a header of that name replaces the field,
#: a method included, or is silently replaced by it, as ``correlation_id`` is by the task
#: id); and ``compression``, which makes kombu decompress the body.
CELERY_FIELDS = frozenset(
    {
        *("lang", "task", "id", "shadow", "eta", "expires", "group", "group_index"),
        *("retries", "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr"),
        *("origin", "ignore_result", "replaced_task_nesting", "stamped_headers", "stamps"),
        *("args", "kwargs", "callbacks", "errbacks", "chain", "chord", "taskset"),
        *("correlation_id", "reply_to", "delivery_info", "properties", "headers", "hostname"),
        *("called_directly", "is_eager", "logfile", "loglevel", "utc"),
        *("time_limit", "soft_time_limit", "children", "_children", "_protected"),
        *("get", "update", "clear", "as_execution_options"),
        *("_get_custom_headers", "_filter_x_death_headers", "compression"),
    }
)


def celery_header_clash(route: Route, headers: Iterable[str]) -> str | None:
    """Why ``headers`` cannot go on the task messages of ``route``; None when they can
    (always, on a broker route)."""
    clash = sorted(CELERY_FIELDS.intersection(headers)) if route.is_celery else []
    if not clash:
        return None
    return (
        f"headers {clash} are fields of Celery's task message on the Celery route "
        f"{route.destination!r} and cannot be given"
    )


def _arguments(name: str, key: str, value: object) -> Arguments:
    """A route's ``queue_arguments`` or ``exchange_arguments``: a dict of string
    names to scalar values (every standard RabbitMQ argument is one)."""
    if not isinstance(value, Mapping):
        raise ValueError(
            f"route {name!r} {key} must be a dict such as {{'x-max-length': 10000}}; "
            f"got {type(value).__name__}"
        )
    for arg, val in value.items():
        if not isinstance(arg, str) or not arg:
            raise ValueError(f"route {name!r} {key} has a name that is not a string: {arg!r}")
        if not isinstance(val, str | int | float | bool):
            raise ValueError(
                f"route {name!r} {key}[{arg!r}] must be a string, number or boolean; "
                f"got {type(val).__name__}"
            )
    return tuple(sorted(value.items()))


@dataclasses.dataclass(frozen=True)
class Shape:
    """A route that cannot deliver (or delivers only when something else binds a
    queue): ``kind`` names its check id in ``conf.CHECK_IDS``."""

    kind: str
    msg: str
    hint: str


def shape_problems(route: Route) -> list[Shape]:
    """What is wrong with the way ``route`` is laid out, whatever its broker, for the
    system checks (what its broker cannot carry is the transports' to say:
    :func:`django_outbox.transports.capabilities.broker_shape_problems`)."""
    if route.is_celery:
        return []
    name, exchange, key, queue = route.destination, route.exchange, route.routing_key, route.queue
    found = []
    if exchange and queue and route.exchange_type == "direct" and "{key}" in key:
        found.append(
            Shape(
                "direct_key",
                f"Route {name!r} binds queue {queue!r} to direct exchange {exchange!r} with "
                f"{route.routing_key_for('')!r}, so an event staged with a key (routing key "
                f"{key!r}) never reaches it.",
                'Use exchange_type "topic" (the queue is then bound with # in place of {key}), '
                "or take {key} out of routing_key.",
            )
        )
    if not exchange and queue and key != queue:
        found.append(
            Shape(
                "default_exchange_key",
                f'Route {name!r} publishes to the default exchange "" with routing key '
                f"{key!r}, which delivers to the queue of that name, never to its queue {queue!r}.",
                f"On the default exchange the routing key is the queue name: set routing_key to "
                f"{queue!r}, or name an exchange.",
            )
        )
    if exchange and not queue:
        found.append(
            Shape(
                "no_queue",
                f"Route {name!r} declares no queue: its events reach only queues that others "
                f"bind to exchange {exchange!r}; until one is bound they fail and are retried.",
                "Give the route a queue, or make sure consumers bind theirs before events are "
                'staged (then silence this with SILENCED_SYSTEM_CHECKS = ["django_outbox.W002"]).',
            )
        )
    return found
