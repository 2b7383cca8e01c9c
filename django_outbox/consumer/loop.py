"""The kombu consumer loop behind ``run_outbox_consumer``.

:class:`InboxConsumer` reads one queue and runs a handler for each event through
the inbox (:func:`~django_outbox.inbox.process_once`), so a redelivered event
is acknowledged without running the handler again. It holds what to consume and
how, and its totals (:attr:`InboxConsumer.stats`); each :meth:`InboxConsumer.run` is a
:class:`ConsumerRun`, which keeps that run's state. Per message (:mod:`.handling`):
it decodes (:mod:`.decode`: the outbox's envelope or a CloudEvent),
rejects what is not an outbox event and parks what is
not signed (:mod:`.parking`), runs an ordered route's events in their key's turn
(:mod:`.ordered`), counts failed deliveries and redeliveries and parks a message
after ``max_deliveries`` (:mod:`.deliveries`), keeps a failed or early message
unacked until its time (:mod:`.held`), and rides out a database outage without
counting (:mod:`.outages`).

The queue of a route with partitions is consumed as its partition queues (all,
or those given), one kombu consumer each. On a NATS JetStream broker (``nats://``) the
run pulls from a stream's durable consumer instead (:mod:`.nats`), through the same
handling.

Prefetch is bounded, so a stopped or killed consumer leaves at most
``prefetch`` messages unacked, and the broker redelivers them. A lost broker
connection is retried with backoff. :meth:`InboxConsumer.run` returns when its
stop event is set (after the message in hand) or after ``idle_timeout``; with an
``idle_timeout``, it gives up (:class:`~django_outbox.exceptions.BrokerUnreachable`)
once that long went by without a broker since the last message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import kombu
from django.db import close_old_connections, connections
from django.utils import timezone
from django.utils.module_loading import import_string
from kombu.mixins import ConsumerMixin

from .. import tracing
from ..conf import outbox_settings
from ..conf.brokers import KAFKA_SCHEME, NATS_SCHEMES, broker_scheme
from ..conf.redact import mask_url
from ..conf.routes import Route
from ..exceptions import BrokerUnreachable, OutboxConfigurationError
from ..inbox.records import handled_types
from ..models import WorkerKind
from ..signing import Keyring
from ..transports.connection import CONNECT_TIMEOUT, open_connection, release, transient_errors
from ..transports.declare import declare, refusal_errors
from ..workers.heartbeat import Heartbeat, HeartbeatThread, process_name
from ..workers.outage import broker_outage
from .context import ConsumerStats, Context, Handler
from .decode import uninflated
from .deliveries import Deliveries, retry_policy
from .handling import Handling
from .held import Held
from .nats import JetStreamSource, Naks
from .ordered import Ordered
from .outages import DatabaseOutage
from .parking import Parking

logger = logging.getLogger("django_outbox.consumer")

DEFAULT_PREFETCH = 100
DEFAULT_MAX_DELIVERIES = 5
#: Backoff before a failed message is requeued: about 1, 2, 4, 8 s ... capped at
#: 30 s, each shortened by up to half at random (so five deliveries span 7.5-15 s).
DEFAULT_RETRY_DELAY = 1.0
DEFAULT_RETRY_MAX_DELAY = 30.0
#: How long one wait for a message lasts, so a stop request is seen promptly.
DRAIN_TIMEOUT = 1.0
#: The runs of brokers kombu does not serve, by URL scheme, imported by path (their
#: modules build on this one): each is made with the consumer, ``idle_timeout``, a
#: factory of the pipeline's :class:`~.handling.Handling` and one of the heartbeat.
RUNS = {KAFKA_SCHEME: "django_outbox.consumer.kafka.KafkaRun"}


class InboxConsumer:
    """Consume ``queue`` and run ``handler`` once per event for ``consumer``.

    It keeps what to consume and how, its totals (:attr:`stats`) and its stop event;
    each :meth:`run` is a :class:`ConsumerRun` (kombu's
    :class:`~kombu.mixins.ConsumerMixin`), which keeps the run's state.
    """

    def __init__(
        self,
        queue: str,
        handler: Handler,
        consumer: str,
        *,
        using: str = "default",
        prefetch: int = DEFAULT_PREFETCH,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        retry_delay: float = DEFAULT_RETRY_DELAY,
        retry_max_delay: float = DEFAULT_RETRY_MAX_DELAY,
        url: str | None = None,
        broker: str | None = None,  # an alias of OUTBOX["BROKERS"]; url, if given, wins
        transport_options: dict[str, Any] | None = None,
        event_types: Iterable[str] | None = None,
        stop: threading.Event | None = None,
        partitions: Sequence[int] | None = None,
        verify_signatures: bool | None = None,  # None: OUTBOX["VERIFY_SIGNATURES"]
    ) -> None:
        self.queue = queue
        self.handler = handler
        self.consumer = consumer
        self.event_types = handled_types(event_types)
        self.using = using
        self.prefetch = prefetch
        self.max_deliveries = max_deliveries
        self.retry = retry_policy(retry_delay, retry_max_delay, max_deliveries)
        self.url, self.transport_options = _broker_for(queue, url, broker, transport_options)
        self._source(queue, consumer, prefetch)
        self.route = outbox_settings.route_for_queue(queue)
        if self._run is not None and partitions is not None:
            raise OutboxConfigurationError(
                f"partitions given, but {mask_url(self.url)} is not RabbitMQ: the consumers "
                "of a Kafka group share the topic's partitions by themselves"
            )
        self.queues = _queues_to_take(self.route, queue, partitions)
        #: The keys a message's signature must be made with; None: not verified.
        self.keys = _verifying_keys(verify_signatures)
        #: The attributes of every ``process`` span but the queue and the message id.
        self._span_attributes = tracing.broker_attributes(self.url)
        self._span_attributes["messaging.consumer.group.name"] = consumer
        #: The totals of every run.
        self.stats = ConsumerStats()
        #: Set it (e.g. from a signal handler) to stop after the message in hand.
        self.stop = stop if stop is not None else threading.Event()

    def _source(self, queue: str, consumer: str, prefetch: int) -> None:
        """Where the messages come from: the run of a broker kombu does not serve
        (``_run``, :data:`RUNS`), a ``nats://`` broker's durable consumer (``jetstream``),
        else kombu's; and the errors that mean the broker or the way to it failed."""
        scheme = broker_scheme(self.url)
        self._run = RUNS.get(scheme)
        self.jetstream: JetStreamSource | None = None
        self._transient: tuple[type[BaseException], ...] = ()
        if scheme in NATS_SCHEMES:
            options = self.transport_options
            self.jetstream = JetStreamSource(self.url, options, queue, consumer, prefetch)
            self._transient = self.jetstream.transient
        elif self._run is None:
            self._transient = transient_errors(kombu.Connection(self.url))

    def run(self, *, idle_timeout: float | None = None) -> ConsumerStats:
        """Consume until :attr:`stop` is set, or until no message came for
        ``idle_timeout`` seconds. Returns the totals (also in :attr:`stats`).

        Without ``idle_timeout`` an unreachable broker is waited for without end.
        With it, the time without a broker since the last message (or the start) is
        counted too: once it reaches ``idle_timeout``, :class:`BrokerUnreachable`
        is raised."""
        if self._run is None:
            return ConsumerRun(self, idle_timeout).run()
        handling = functools.partial(_handling, self)
        heartbeat = functools.partial(_heartbeat, self)
        return import_string(self._run)(self, idle_timeout, handling, heartbeat).run()


class ConsumerRun(ConsumerMixin):
    """One run of an :class:`InboxConsumer`: its connections, the state it keeps between
    messages, and the parts that handle them.

    Built on kombu's :class:`~kombu.mixins.ConsumerMixin`: its consumer context
    (connection, consumers, cancel) and hooks (``get_consumers``,
    ``on_consume_ready``, ``on_decode_error``). ``run()`` and ``consume()`` are this
    class's own, for the reasons said at each.
    """

    def __init__(self, consumer: InboxConsumer, idle_timeout: float | None = None) -> None:
        self.consumer, self.idle_timeout = consumer, idle_timeout
        self.stats = consumer.stats
        #: The broker's outages; its downtime is what ``idle_timeout`` counts.
        self._broker = broker_outage()
        self._attempt: float | None = None  # when the connection attempt under way began
        self._first_message_at: float | None = None
        self._last_message = 0.0  # monotonic time of the last message (or the start)
        self._idle = False  # idle for idle_timeout: done
        self._connection: kombu.Connection | None = None  # the one being set up or used
        self.context = Context(
            consumer.consumer, consumer.using, consumer.event_types, self.stats, consumer.queue
        )
        self.held = Held() if consumer.jetstream is None else Naks()
        self.outage = DatabaseOutage(consumer.using, consumer.stop)
        self.handling = _handling(consumer, self.context, self.held, self.outage)

    def run(self) -> ConsumerStats:  # type: ignore[override]
        """See :meth:`InboxConsumer.run`."""
        # Not ConsumerMixin.run(): it reconnects through Connection.ensure_connection,
        # with kombu's own intervals, deaf to the stop event and blind to the time
        # without a broker that idle_timeout counts. This loop backs off through the
        # broker's OutageTracker instead, and waits on the stop event.
        started = self._last_message = time.monotonic()
        beating = _heartbeat(self.consumer, lambda: self._last_message)
        beating.start()
        try:
            while not self.should_stop:
                try:
                    self.consume()
                except self.consumer._transient as exc:
                    # An outage begins when the connection attempt that failed began (or
                    # now, when a working connection failed); logged at its start only.
                    self._broker.failed(exc, since=self._attempt)
                    self._attempt = None
                    self._wait_for_broker(exc)
        finally:
            self.stats.elapsed = time.monotonic() - started
            beating.stop()
            # This thread's connection, unless a transaction holds it: a consumer run in
            # a thread of its own leaves none for the garbage collector to find later.
            if not connections[self.consumer.using].in_atomic_block:
                connections[self.consumer.using].close()
        return self.stats

    @property
    def should_stop(self) -> bool:  # type: ignore[override]  # read by ConsumerMixin
        """Stop requested, or idle for ``idle_timeout`` with nothing held."""
        return self.consumer.stop.is_set() or self._idle

    def _wait_for_broker(self, exc: BaseException) -> None:
        """Back off before the next attempt to reach the broker; give up (raise
        :class:`BrokerUnreachable`) once ``idle_timeout`` seconds went by without it."""
        without = self._broker.downtime()
        backoff = self._broker.backoff()
        idle_timeout = self.idle_timeout
        if idle_timeout is not None:
            if without >= idle_timeout:
                raise BrokerUnreachable(
                    f"gave up after {idle_timeout:g}s without a broker: "
                    f"{mask_url(self.consumer.url)} unreachable "
                    f"({outbox_settings.redact(f'{type(exc).__name__}: {exc}')})"
                )
            backoff = min(backoff, idle_timeout - without)
        self.consumer.stop.wait(backoff)

    # -- ConsumerMixin's hooks ------------------------------------------------------

    def consume(self, *args: Any, **kwargs: Any) -> None:
        """One connection's life: subscribe (ConsumerMixin's ``consumer_context``),
        handle messages until stopped or idle, then unsubscribe. A broker error raises
        one of the transient errors."""
        # Not ConsumerMixin.consume(): it drains with a fixed timeout, where a held
        # message must be requeued when its delay is over.
        if self.consumer.jetstream is not None:  # a NATS JetStream broker's connection
            self._attempt = time.monotonic()
            self.consumer.jetstream.consume(self)
            return
        with self.consumer_context(**kwargs) as (connection, _channel, _consumers):
            self._drain(connection)

    @contextlib.contextmanager
    def establish_connection(self) -> Iterator[kombu.Connection]:
        """A connection with bounded waits, made once: :meth:`run` retries (the
        mixin's own would retry through ``ensure_connection`` without end)."""
        consumer = self.consumer
        self._attempt = time.monotonic()
        # A reply the broker never sends (a silent network) fails the wait for it, so
        # neither subscribing, unsubscribing nor closing blocks a stopping consumer.
        connection = open_connection(
            consumer.url, consumer.transport_options, socket_timeout=CONNECT_TIMEOUT
        )
        try:
            self._connection = connection
            yield connection
            # Stopping (or idle), no longer subscribed: nothing held waits for its delay.
            self.held.requeue_all()
        finally:
            self.held.forget()  # on a lost connection the broker requeues them itself
            release(connection, logger)

    def get_consumers(self, Consumer: Any, channel: Any) -> list[kombu.Consumer]:
        """The one consumer of the queue; a refusal to declare it (e.g. the queue exists
        with other arguments) raises DeclareRefused, an OutboxConfigurationError with
        the relay's wording: retrying cannot help."""
        assert self._connection is not None  # set by establish_connection()
        consumer = self.consumer
        declared = declare(channel, consumer.route, refused=refusal_errors(self._connection))
        channel.Message = uninflated(channel.Message)
        return [
            Consumer(
                queues=[queue],
                accept=["json"],
                on_message=functools.partial(self.on_message, queue.name),
                prefetch_count=consumer.prefetch,
                auto_declare=False,
            )
            for queue in declared
            if queue.name in consumer.queues
        ]

    def on_consume_ready(
        self, connection: Any, channel: Any, consumers: Any, **kwargs: Any
    ) -> None:
        """kombu's hook once consuming starts (again): see :meth:`ready`."""
        self.ready()

    def ready(self) -> None:
        """Consuming starts (again): the broker outage, if any, ends."""
        self._attempt = None
        self._broker.recovered()
        consumer = self.consumer
        logger.info(
            "consuming %s as %r (prefetch %d)",
            ", ".join(consumer.queues),
            consumer.consumer,
            consumer.prefetch,
            extra={"action": "inbox.consuming", "queue": consumer.queue},
        )

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        """kombu could not even turn the frame into a message, or it was compressed
        (see :func:`~.decode.uninflated`)."""
        self._last_message = time.monotonic()
        self.handling.reject(message, exc)

    def _drain(self, connection: kombu.Connection) -> None:
        """Handle messages until stopped, or idle for ``idle_timeout`` with nothing held;
        requeue each held message when its delay is over. Idle time runs from the last
        message (or the start) over every connection: a broker whose connections drop
        now and then does not restart it."""
        while not self.should_stop:
            self.held.requeue_due()
            try:
                connection.drain_events(timeout=self.held.wait(DRAIN_TIMEOUT))
            except TimeoutError:
                connection.heartbeat_check()
                self.idle()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                # A virtual transport's list item that is not even JSON (anyone who can
                # push to a Redis list can write one): kombu parses it before any message
                # exists, and it is gone from the list already. Counted, logged, dropped.
                self._last_message = time.monotonic()
                self.handling.unreadable(exc)

    def idle(self) -> None:
        """No message came for a while: idle for ``idle_timeout`` with nothing held is
        done."""
        idle = time.monotonic() - self._last_message
        timeout = self.idle_timeout
        self._idle = timeout is not None and idle >= timeout and not self.held
        close_old_connections()  # honours CONN_MAX_AGE between idle spells

    def on_message(self, queue: str, message: Any) -> None:
        self.context.queue = queue
        if self.consumer.stop.is_set():  # delivered while the consumer unsubscribes: not started
            message.requeue()
            return
        if self._first_message_at is None:
            self._first_message_at = time.monotonic()
        self._last_message = time.monotonic()
        self._broker.forget_downtime()
        try:
            self.handling.handle(message)
        finally:
            self.stats.busy = time.monotonic() - self._first_message_at


def _handling(
    consumer: InboxConsumer,
    context: Context,
    held: Held,
    outage: DatabaseOutage,
    ordered_class: type[Ordered] = Ordered,
) -> Handling:
    """The parts that handle one run's messages, put together (an ordered route's events
    by ``ordered_class``)."""
    early: dict[Any, int] = {}  # event id -> times held back for its key
    parking = Parking(context, outage, early)
    deliveries = Deliveries(
        context,
        max_deliveries=consumer.max_deliveries,
        retry=consumer.retry,
        # A quorum queue's x-delivery-count, JetStream's delivery count: the broker's own.
        broker_counts=consumer.route.queue_type == "quorum" or consumer.jetstream is not None,
        span_attributes=consumer._span_attributes,
        held=held,
        outage=outage,
        parking=parking,
    )
    ordered = ordered_class(
        context,
        consumer.handler,
        early=early,
        held=held,
        deliveries=deliveries,
        parking=parking,
        outage=outage,
    )
    return Handling(
        context,
        consumer.handler,
        consumer.keys,
        deliveries=deliveries,
        ordered=ordered,
        parking=parking,
        outage=outage,
    )


def _heartbeat(consumer: InboxConsumer, last_message: Callable[[], float]) -> HeartbeatThread:
    """A run's heartbeat: ``host:pid``, named ``consumer@queue``, with the totals and the
    last message's time (told from ``last_message()``, its monotonic time)."""
    name = f"{consumer.consumer}@{consumer.queue}"
    beat = Heartbeat(WorkerKind.CONSUMER, process_name(), consumer.using, name=name)

    def snapshot() -> tuple[dict[str, int], dt.datetime | None]:
        counts = dataclasses.asdict(consumer.stats)
        last = None
        if consumer.stats.received:
            last = timezone.now() - dt.timedelta(seconds=time.monotonic() - last_message())
        return {k: v for k, v in counts.items() if isinstance(v, int)}, last

    return HeartbeatThread(beat, snapshot)


def _broker_for(
    queue: str, url: str | None, broker: str | None, transport_options: dict[str, Any] | None
) -> tuple[str, dict[str, Any]]:
    """The URL and transport options a consumer of ``queue`` connects with: ``url``, else
    the alias ``broker`` names, else the one the route of ``queue`` publishes to ("default"
    for the default route). Raises :class:`~django_outbox.exceptions.OutboxConfigurationError`
    when no broker is configured."""
    if url is None:
        chosen = outbox_settings.require_broker(
            broker or outbox_settings.route_for_queue(queue).broker
        )
        url = chosen.url
        if transport_options is None:
            transport_options = dict(chosen.options)
    if broker_scheme(url) in RUNS:  # not kombu's: its OPTIONS are the broker's own
        return url, dict(transport_options or {})
    if transport_options is None:
        transport_options = outbox_settings.BROKER_TRANSPORT_OPTIONS
    return outbox_settings.require_broker_url(url), transport_options


def _verifying_keys(verify: bool | None) -> Keyring | None:
    """``OUTBOX["SIGNING_KEYS"]`` when signatures are verified (``verify``, else
    ``OUTBOX["VERIFY_SIGNATURES"]``), else None; an :class:`OutboxConfigurationError`
    when they are to be verified and there are none."""
    if not (outbox_settings.VERIFY_SIGNATURES if verify is None else verify):
        return None
    keys: Keyring = outbox_settings.SIGNING_KEYS
    if not keys:
        raise OutboxConfigurationError(
            "signatures are to be verified, but OUTBOX['SIGNING_KEYS'] is empty: give it "
            "the keys the relays sign with"
        )
    return keys


def _queues_to_take(route: Route, queue: str, partitions: Sequence[int] | None) -> tuple[str, ...]:
    """The queues a consumer of ``queue`` takes: ``queue`` itself, or of a partitioned
    route's queue the partitions numbered ``partitions`` (all when None).
    :class:`OutboxConfigurationError` for partitions the route does not have."""
    if not route.partitions or queue in route.partition_queues:
        if partitions is not None:
            raise OutboxConfigurationError(
                f"partitions given, but queue {queue!r} is not the queue of a route with "
                "partitions (OUTBOX['ROUTES'][...]['partitions'])"
            )
        return (queue,)
    if partitions is None:
        return route.partition_queues
    wrong = sorted(set(partitions) - set(range(route.partitions)))
    if wrong or not partitions:
        raise OutboxConfigurationError(
            f"queue {queue!r} has partitions 0-{route.partitions - 1}; "
            f"got {', '.join(map(str, wrong)) or 'none'}"
        )
    return tuple(route.partition_queues[number] for number in sorted(set(partitions)))
