"""Publishing through kombu: RabbitMQ with pipelined publisher confirms, and every
other kombu transport (Redis, filesystem, memory; others untested) through its producer.

On RabbitMQ (py-amqp) the channel is put in confirm mode once; a batch is
written without waiting, then the broker's ``basic.ack``/``basic.nack`` frames
(possibly ``multiple=True``) are collected. A message counts as published only
when its own delivery tag was acked; a nack, a lost connection or the confirm
timeout fail the messages still unconfirmed.

On Redis a batch goes out as one pipeline in kombu's own message format, written
without kombu's producer (:mod:`.redis_wire`; a fanout exchange keeps the producer's
``Producer.batch()``), so kombu consumers read it; the exchange's bindings are read
once per batch instead of once per message. Each message counts as published when its
push was answered without an error; if the pipeline itself failed (the connection),
none of it does. A Redis out of memory (``maxmemory`` reached, nothing to evict) is an
outage, as RabbitMQ's memory alarm is: no attempt counted, and the relay backs off
until a probe write (:meth:`RedisTransport._check_ready`) is accepted again.

No message counts as published unless it reached a queue: RabbitMQ returns an
unroutable message (``mandatory``); on kombu's virtual transports (Redis,
filesystem, memory ...), which would drop it, the relay looks the queues up in
the exchange's bindings first and does not send a message that would reach none.
Both fail it with the same :func:`unroutable` text.

A broker URL may be kombu's failover list (``amqp://a//;amqp://b//;amqp://c//``, the
nodes of a cluster): :func:`connect` tries each address once, in the list's order,
so a relay or consumer whose node stops is on another node at its next attempt.

A queue or exchange the broker refuses to declare (it exists with other
arguments: 406 PRECONDITION_FAILED) is a configuration error: its rows fail
without counting an attempt and are due again in :data:`REFUSED_RETRY_DELAY`,
and one ERROR per refusal and interval says why. A declaration Redis refuses for
want of memory is no such refusal: it is the outage above.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import struct
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import amqp.exceptions  # type: ignore[import-untyped]
import kombu
import kombu.exceptions
import kombu.transport.virtual
from kombu.transport.virtual.base import NotEquivalentError

from .. import cloudevents
from ..conf import outbox_settings
from ..conf.redact import SecretFilter, mask_url
from ..conf.routes import PARTITION_EXCHANGE_TYPE, Route
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE, ClaimedMessage
from ..exceptions import BrokerOutOfMemory, BrokerUnreachable, OutboxConfigurationError
from .amqp_frames import PublishFrames, chunks, method_frame
from .base import NACKED, Failure, Outcome, Transport
from .redis_wire import RedisWire, out_of_memory

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' and brokers' texts

CONNECT_TIMEOUT = 5.0
#: The longest a batch waits for its confirms; shorter under a short lease, see
#: :func:`lease_confirm_timeout`.
CONFIRM_TIMEOUT = 30.0
#: Where :meth:`KombuTransport.check` sends its probe on RabbitMQ: the default exchange
#: with a routing key no queue has, so the broker drops the message and confirms it.
PROBE_ROUTING_KEY = "django_outbox.probe"
#: How kombu walks a failover list: each address in turn, from the first.
FAILOVER_STRATEGY = "round-robin"
#: Seconds until the rows of a route whose queue the broker refused are due again,
#: and between two ERROR records about the same refusal.
REFUSED_RETRY_DELAY = 30.0
#: About how many bytes of a batch's frames go to the socket in one write.
WRITE_SIZE = 256 * 1024
#: Errors that mean "the message could not be encoded": retrying cannot help.
#: (py-amqp raises struct.error for a header int beyond 64 bits or a key over 255 bytes,
#: while it builds the frame and before it writes a byte.)
ENCODE_ERRORS = (TypeError, ValueError, UnicodeError, struct.error, kombu.exceptions.EncodeError)


def lease_confirm_timeout() -> float:
    """Seconds a relay's batch waits for the confirms of one destination:
    :data:`CONFIRM_TIMEOUT`, but at most a third of ``LEASE_SECONDS``. The relay starts
    a destination only in the first half of a claim's lease, so its confirms are in
    (or given up) with a sixth of the lease left to record the outcomes before another
    relay may take the rows over."""
    return min(CONFIRM_TIMEOUT, outbox_settings.LEASE_SECONDS / 3)


class BrokerStalled(ConnectionError):
    """The broker took messages and did not confirm them: it blocked the connection
    (a resource alarm) or said nothing within the confirm timeout. Its messages may
    still arrive; the relay treats the broker as down (no attempt counted)."""


def _stalled(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker stopped answering (not that the message or the
    connection failed): no confirm in time, a blocked connection, or a write that
    timed out because the broker stopped reading (py-amqp wraps the socket timeout)."""
    return isinstance(exc, (BrokerStalled, TimeoutError)) or isinstance(
        exc.__context__, TimeoutError
    )


#: How a failure of a broker out of memory begins (its ``last_error``), and its kind.
OUT_OF_MEMORY = "the broker is out of memory"


def transient_failure(exc: BaseException) -> Failure:
    """The outcome of the messages a transient error left unsettled: a broker that
    stopped answering (see :func:`_stalled`) or is out of memory is down, no attempt
    counted; any other error (a connection refused or reset, a channel closed) counts
    one, and the relay then backs off from the broker, its rows not attempted
    meanwhile. Shared with the Celery transport, whose sends meet the same errors."""
    if out_of_memory(exc):
        return Failure.broker_down(
            f"{OUT_OF_MEMORY} (Redis maxmemory reached, nothing it may evict): "
            f"{type(exc).__name__}: {exc}",
            kind="out_of_memory",
        )
    if _stalled(exc):
        return Failure.broker_down(f"{type(exc).__name__}: {exc}")
    return Failure.from_exception(exc)


#: A batch's envelope (one of ``routes.ENVELOPES``), CloudEvents source, and whether its
#: CloudEvents carry the ``ordering_key`` header too (see :func:`envelope_of`).
Envelope = tuple[str, str, bool]


def envelope_of(route: Route, *, binary: bool) -> Envelope:
    """The envelope ``route``'s messages go in (``OUTBOX["DEFAULT_ENVELOPE"]`` unless it
    names one), and the CloudEvents source: on a broker without a binary content mode
    (``binary`` False), CloudEvents are structured. A partitioned route's CloudEvents
    keep the ``ordering_key`` header, which its consistent-hash exchange hashes."""
    envelope = route.envelope or outbox_settings.DEFAULT_ENVELOPE
    if envelope == cloudevents.BINARY and not binary:
        envelope = cloudevents.STRUCTURED
    return envelope, outbox_settings.CLOUDEVENTS_SOURCE, route.partitions > 0


def routing_key(route: Route, message: ClaimedMessage) -> str:
    """The route's routing key, with ``{key}`` replaced by the message's ordering key."""
    return route.routing_key_for(message.ordering_key)


def binding_key(route: Route) -> str:
    """What the route's queue is bound with: ``{key}`` matches any key on a topic exchange."""
    return route.routing_key.replace("{key}", "#" if route.exchange_type == "topic" else "")


def unroutable(exchange: str, routing_key: str) -> str:
    """The error of a message that no queue would receive, on every transport."""
    return f"unroutable: no queue is bound to exchange {exchange!r} for routing key {routing_key!r}"


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
    a Redis out of memory refuses every write, declarations too: that one is raised as it
    is (an outage, see :func:`transient_failure`)."""
    try:
        yield
    except refused as exc:
        if out_of_memory(exc):
            raise
        raise DeclareRefused(kind, name, exc, fix) from exc


def refusal_errors(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """The errors with which a broker refuses a declaration: a channel error
    (AMQP 403, 404, 405, 406), RabbitMQ's 503 for an exchange type it does not know (a
    plugin's, not enabled: a connection error, which would count as an outage), or
    kombu's own for an inequivalent virtual exchange."""
    return (*connection.channel_errors, amqp.exceptions.InvalidCommand, NotEquivalentError)


def transient_errors(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """Errors that mean the broker or the way to it failed, not the message: the
    connection's driver errors (which ``connection`` need not be connected to tell)."""
    return (
        kombu.exceptions.OperationalError,
        kombu.exceptions.BatchPublishError,  # a pipeline failed: delivery uncertain
        OSError,
        *connection.connection_errors,
        *connection.channel_errors,
    )


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
        if out_of_memory(exc):
            raise  # not a refusal: the outage of a full Redis
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


def new_connection(url: str, options: Mapping[str, Any] | None = None) -> kombu.Connection:
    """A kombu connection to ``url`` (a failover list too), not connected yet."""
    return kombu.Connection(
        url,
        transport_options=dict(options or {}),
        connect_timeout=CONNECT_TIMEOUT,
        failover_strategy=FAILOVER_STRATEGY,
    )


def connect(connection: kombu.Connection) -> None:
    """Connect: one try at each address of a failover list, in its order, without a
    pause between them; a single URL gets kombu's own ``connect()`` (two tries). The
    driver's error of the last address is raised; the caller owns the backoff."""
    connection.ensure_connection(
        max_retries=max(len(connection.alt) - 1, 1), reraise_as_library_errors=False
    )


def bound_socket_waits(connection: kombu.Connection, seconds: float) -> None:
    """Make py-amqp give up on a broker that does not answer within ``seconds``: it
    waits for the reply to its close without end, so a broker that went silent while
    the relay was idle would keep a stopping relay from exiting. Other drivers (and
    a connection never made) are left as they are."""
    transport = getattr(connection._connection, "_transport", None)  # py-amqp's socket owner
    sock = getattr(transport, "sock", None)
    if sock is not None:
        sock.settimeout(seconds)


#: An outcome not known yet: not sent, or sent and not confirmed.
_UNSETTLED: Any = object()


def _nacked_whole(outcomes: Sequence[Outcome]) -> bool:
    """Whether the broker nacked every message of a batch."""
    return bool(outcomes) and all(
        isinstance(outcome, Failure) and outcome.error == NACKED for outcome in outcomes
    )


class _Confirms:
    """Delivery tags of one confirm-mode channel and the batch they belong to."""

    def __init__(self, channel: Any) -> None:
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        self.last_tag = 0  # the broker numbers a channel's messages 1, 2, ...
        self.first_tag = 1  # no tag below this one is pending
        self.pending: dict[int, int] = {}  # delivery tag -> index in the batch
        self.ids: dict[int, str] = {}  # index -> message id
        self.returned: dict[str, str] = {}  # message id -> why the broker returned it
        self.outcomes: list[Outcome] = []

    def start(self, outcomes: list[Outcome]) -> None:
        self.first_tag = self.last_tag + 1
        self.pending.clear()
        self.ids.clear()
        self.returned.clear()
        self.outcomes = outcomes

    def sent(self, indices: Sequence[int], message_ids: Sequence[str]) -> None:
        """The messages at ``indices`` of the batch were (or are about to be) written, in
        this order: they take the channel's next delivery tags."""
        first = self.last_tag + 1
        self.last_tag += len(indices)
        self.pending.update(zip(range(first, self.last_tag + 1), indices, strict=True))
        self.ids.update(zip(indices, message_ids, strict=True))

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        self.returned[message.properties.get("message_id", "")] = unroutable(exchange, routing_key)

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        # A returned message is acked after its basic.return: it reached no queue.
        for index in self._settle(delivery_tag, multiple):
            error = self.returned.get(self.ids.get(index, ""))
            self.outcomes[index] = None if error is None else Failure(error, kind="unroutable")

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        for index in self._settle(delivery_tag, multiple):
            self.outcomes[index] = Failure(NACKED, kind="nacked")

    def _settle(self, delivery_tag: int, multiple: bool) -> list[int]:
        tags: range | list[int] = [delivery_tag]
        if multiple:  # every tag up to this one: walk only those not settled before
            tags = range(self.first_tag, delivery_tag + 1)
            self.first_tag = max(self.first_tag, delivery_tag + 1)
        return [self.pending.pop(tag) for tag in tags if tag in self.pending]


class _Writer(Protocol):
    """Writes the messages of one route's batch (see :meth:`KombuTransport._writer`)."""

    #: Whether messages reach the broker only when the batch ends.
    deferred: bool

    @property
    def failed(self) -> Mapping[int, Exception]:
        """Once a deferred batch ended: the messages the broker refused, by their place
        among those written, each with the broker's error."""

    def reaches(self, routing_key: str) -> bool:
        """Whether a message with ``routing_key`` would reach a queue."""

    def write(self, message: ClaimedMessage, routing_key: str) -> None:
        """Write (or add to the batch) ``message``; raises one of :data:`ENCODE_ERRORS`
        for a message that cannot be encoded."""


class _ProducerWriter:
    """kombu's ``Producer.publish``, one message at a time."""

    def __init__(
        self,
        producer: kombu.Producer,
        route: Route,
        reaches: Callable[[str], bool],
        *,
        deferred: bool,
        envelope: Envelope,
    ) -> None:
        self._producer, self._exchange = producer, route.exchange
        self.reaches, self.deferred = reaches, deferred
        self._envelope = envelope
        self.failed: Mapping[int, Exception] = {}  # kombu's batch raises instead

    def write(self, message: ClaimedMessage, routing_key: str) -> None:
        wire = cloudevents.wire(message, *self._envelope)
        self._producer.publish(
            wire.body,
            exchange=self._exchange,
            routing_key=routing_key,
            content_type=wire.content_type,
            content_encoding=CONTENT_ENCODING,
            headers=wire.headers,
            delivery_mode=2,
            message_id=str(message.event_id),
            retry=False,
        )


class KombuTransport(Transport):
    """Any kombu transport: one connection and channel per relay, declared topology
    cached per route, and (unless a subclass below writes its broker's batches itself)
    one message at a time through kombu's producer. The subclasses declare what their
    broker can do more.

    Messages no queue would receive are found in the exchange's bindings (kombu's
    virtual transports would drop them): a per-message routing result."""

    reports_unroutable = True
    #: Whether the broker has a CloudEvents binding with a binary content mode (AMQP's
    #: ``ce-`` headers); without one, CloudEvents go in structured mode.
    cloudevents_binary = True

    def __init__(
        self,
        url: str,
        transport_options: Mapping[str, Any] | None = None,
        *,
        alias: str | None = None,
        confirm_timeout: float | None = None,
        refused_retry_delay: float = REFUSED_RETRY_DELAY,
    ) -> None:
        self._url = url
        #: The broker alias of OUTBOX["BROKERS"] the check's errors name (None: unnamed).
        self.alias = alias
        #: Where the transport options are set, for error texts.
        self.options_setting = (
            f'OUTBOX["BROKERS"]["{alias}"]["OPTIONS"]'
            if alias is not None
            else 'OUTBOX["BROKER_TRANSPORT_OPTIONS"]'
        )
        # Confirms are pipelined here; py-amqp's own per-message confirm mode would
        # consume the acks this transport waits for.
        self._options = {
            key: value
            for key, value in (transport_options or {}).items()
            if key != "confirm_publish"
        }
        #: Default: derived from LEASE_SECONDS (:func:`lease_confirm_timeout`).
        self._confirm_timeout = (
            lease_confirm_timeout() if confirm_timeout is None else confirm_timeout
        )
        #: Why the broker blocked the connection (RabbitMQ's ``connection.blocked``, sent
        #: under a resource alarm once the connection publishes); None while it is not.
        self._blocked: str | None = None
        self._refused_retry_delay = refused_retry_delay
        #: refusal text -> when (monotonic) it may be logged again
        self._refusals_logged: dict[str, float] = {}
        self._connection: kombu.Connection | None = None
        self._channel: Any = None
        self._producer: kombu.Producer | None = None
        self._confirms: _Confirms | None = None
        #: The frame encoder of a confirm-mode (RabbitMQ) channel.
        self._frames: PublishFrames | None = None
        self._declared: set[Route] = set()
        # Building a Connection does not connect; it tells the driver's errors.
        probe = kombu.Connection(url)
        self._transient = transient_errors(probe)
        self._refused = refusal_errors(probe)

    # -- connection -----------------------------------------------------------------

    def _connect(self) -> kombu.Connection:
        if self._connection is None:
            connection = new_connection(self._url, self._options)
            try:
                connect(connection)  # one attempt per address; the relay owns the backoff
                # A broker that stops reading (a resource alarm, a silent network) fails a
                # write or a reply's wait instead of blocking the relay without end.
                bound_socket_waits(connection, max(self._confirm_timeout, CONNECT_TIMEOUT))
                channel = connection.channel()
                confirms = _Confirms(channel) if self.supports_confirms else None
            except BaseException:
                connection.release()
                raise
            self._connection, self._channel, self._confirms = connection, channel, confirms
            if confirms is not None:  # py-amqp: this channel's frames are built here
                self._frames = PublishFrames(
                    channel.channel_id,
                    connection.connection.frame_max,
                    CONTENT_TYPE,
                    CONTENT_ENCODING,
                )
            self._blocked = None
            if confirms is not None:  # py-amqp: hear connection.blocked and .unblocked
                connection.connection.on_blocked = self._on_blocked
                connection.connection.on_unblocked = self._on_unblocked
            self._producer = kombu.Producer(channel, auto_declare=False)
        return self._connection

    def _on_blocked(self, reason: str) -> None:
        self._blocked = reason or "connection.blocked"

    def _on_unblocked(self) -> None:
        self._blocked = None

    def check(self) -> None:
        """Connect (once) and, with publisher confirms, have a probe message confirmed
        (a broker that takes connections but blocks publishers is down too); an error
        names the broker's alias when it has one."""
        try:
            self._connect()
            self._check_ready()
            self._probe()
        except Exception as exc:
            if self.alias is None:
                raise
            raise BrokerUnreachable(
                f"broker {self.alias!r} ({mask_url(self._url)}): {type(exc).__name__}: {exc}"
            ) from exc

    def _check_ready(self) -> None:
        """What else the broker needs, once connected (a subclass's own check)."""

    def _probe(self) -> None:
        """With confirms: publish one empty message to no queue (:data:`PROBE_ROUTING_KEY`,
        not mandatory: dropped) and wait for its confirm, at most ``CONNECT_TIMEOUT``;
        raises :class:`BrokerStalled` (the connection dropped) when it does not come. A
        broker that answers at all (a confirm, a nack, or a refusal of the probe, such as
        a user without write permission on the default exchange) is up."""
        confirms, channel = self._confirms, self._channel
        if confirms is None:
            return
        confirms.start([_UNSETTLED])
        confirms.sent([0], [""])
        try:
            channel.basic_publish(
                channel.prepare_message(b""), exchange="", routing_key=PROBE_ROUTING_KEY
            )
            self._await_confirms(confirms, 1, min(self._confirm_timeout, CONNECT_TIMEOUT))
        except self._refused:  # it answered: up; the refused channel is opened afresh
            self.close(graceful=False)
        except self._transient:
            self.close(graceful=False)
            raise

    def close(self, *, graceful: bool = True) -> None:
        """Drop the connection. ``graceful=False`` closes the socket without AMQP's
        close handshake: after an error the broker may never answer it (a resource
        alarm, a network that drops packets) and the handshake would wait forever."""
        connection, self._connection = self._connection, None
        self._channel = self._producer = self._confirms = self._frames = None
        self._declared.clear()
        if connection is not None:
            try:
                if graceful:
                    bound_socket_waits(connection, CONNECT_TIMEOUT)
                    connection.release()
                else:
                    connection.collect()
            except Exception:  # the connection is already broken; nothing to save
                logger.debug("error closing a broken broker connection", exc_info=True)

    # -- publishing -----------------------------------------------------------------

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        outcomes: list[Outcome] = [_UNSETTLED] * len(messages)
        try:
            self._connect()
            refusal = self._declare(route)
        except self._transient as exc:  # nothing sent (a broker that stopped answering: no attempt)
            self.close(graceful=False)
            return [transient_failure(exc)] * len(messages)
        if refusal is not None:
            return [refusal] * len(messages)
        envelope = envelope_of(route, binary=self.cloudevents_binary)
        try:
            if self._confirms is not None:
                self._publish_confirmed(route, messages, outcomes, envelope)
            else:
                self._publish_each(route, messages, outcomes, envelope)
        except self._transient as exc:
            # Whatever was not confirmed may or may not have reached the broker:
            # it is retried (at-least-once), and the channel starts afresh.
            self.close(graceful=False)
            failure = transient_failure(exc)
            outcomes = [failure if outcome is _UNSETTLED else outcome for outcome in outcomes]
        if self._confirms is not None and _nacked_whole(outcomes):
            # RabbitMQ 3.10 can leave a channel opened while a quorum queue elects a new
            # leader (the relay failing over to another node of a cluster) nacking every
            # publish to that queue for minutes: the retry goes through a new connection.
            self.close()
        return outcomes

    def _declare(self, route: Route) -> Failure | None:
        """Declare the route's topology once per connection; the failure of all its
        messages when the broker refuses it (a configuration error: no attempt)."""
        if route in self._declared:
            return None
        try:
            declare(self._channel, route, refused=self._refused)
        except DeclareRefused as exc:
            self.close()  # the broker closed the channel; the next route reconnects
            self._log_refusal(route, exc)
            return Failure.not_attempted(str(exc), self._refused_retry_delay)
        self._declared.add(route)
        return None

    def _log_refusal(self, route: Route, exc: DeclareRefused) -> None:
        """One ERROR per refusal and retry interval, however many batches it fails."""
        text, now = str(exc), time.monotonic()
        if self._refusals_logged.get(text, 0.0) > now:
            return
        self._refusals_logged[text] = now + self._refused_retry_delay
        logger.error(
            "destination %r: %s (its rows wait, attempts unchanged, and are retried every %gs)",
            route.destination,
            text,
            self._refused_retry_delay,
            extra={
                "action": "outbox.declare_refused",
                "destination": route.destination,
                exc.kind: exc.name,
            },
        )

    def _reaches_a_queue(self, route: Route, key: str) -> bool:
        """Whether kombu's virtual channel would deliver a message with routing key
        ``key`` to a queue: the lookup its own delivery makes, in the exchange's
        bindings (cached per batch on Redis), without its dead-letter fallback."""
        channel = self._channel
        if self.supports_confirms or not route.exchange:
            return True  # the broker returns what it cannot route; "" delivers to queue `key`
        exchange_type = channel.typeof(route.exchange)
        if exchange_type.type == "fanout" and not channel.supports_fanout:
            return False  # kombu drops fanout messages where the transport has no fanout
        try:
            table = channel.get_table(route.exchange)
        except KeyError:  # an exchange that was never declared has no bindings
            return False
        return bool(exchange_type.lookup(table, route.exchange, key, None))

    def _publish_each(
        self,
        route: Route,
        messages: Sequence[ClaimedMessage],
        outcomes: list[Outcome],
        envelope: Envelope,
    ) -> None:
        """Through the route's writer (see :meth:`_writer`); where it defers its writes
        (Redis), a message counts as published only once the whole batch was written,
        and unless the broker refused it then (:attr:`_Writer.failed`)."""
        accepted = []  # written into the batch, not yet to the broker
        with self._writer(route, len(messages), envelope) as writer:
            for index, message in enumerate(messages):
                key = routing_key(route, message)
                if not writer.reaches(key):
                    outcomes[index] = Failure(unroutable(route.exchange, key), kind="unroutable")
                    continue
                try:
                    writer.write(message, key)
                except ENCODE_ERRORS as exc:
                    outcomes[index] = Failure.from_exception(exc, permanent=True)
                    continue
                if writer.deferred:
                    accepted.append(index)
                else:
                    outcomes[index] = None
        if not writer.failed:  # (the common case: the loop of a batch that went through)
            for index in accepted:
                outcomes[index] = None
            return
        failures = {id(error): transient_failure(error) for error in writer.failed.values()}
        for place, index in enumerate(accepted):
            error = writer.failed.get(place)
            outcomes[index] = None if error is None else failures[id(error)]

    @contextlib.contextmanager
    def _writer(self, route: Route, size: int, envelope: Envelope) -> Iterator[_Writer]:
        """What writes the ``size`` messages of a batch for ``route`` in ``envelope``:
        kombu's producer, batched where the transport can defer writes (see :meth:`_batch`)."""
        producer = self._producer
        assert producer is not None
        with self._batch(producer, size) as batched:
            # Looked up once per routing key and batch, like the bindings themselves.
            reaches = functools.cache(functools.partial(self._reaches_a_queue, route))
            yield _ProducerWriter(producer, route, reaches, deferred=batched, envelope=envelope)

    @contextlib.contextmanager
    def _batch(self, producer: kombu.Producer, size: int) -> Iterator[bool]:
        """One pipeline for the batch where kombu supports it (yields True), else
        publish as we go (yields False).

        kombu's virtual transports (Redis among them) look the exchange's bindings
        up for every message, a round trip each on Redis; within one batch they
        are read once (a binding made meanwhile applies from the next batch)."""
        if not (self.supports_batch and producer.supports_batch_publish):
            yield False  # (Redis: kombu batches only where a retry cannot duplicate)
            return
        channel = self._channel
        channel.get_table = functools.cache(channel.get_table)
        try:
            with producer.batch(max_size=size):
                yield True
        finally:
            del channel.get_table  # back to kombu's own method

    def _publish_confirmed(
        self,
        route: Route,
        messages: Sequence[ClaimedMessage],
        outcomes: list[Outcome],
        envelope: Envelope,
    ) -> None:
        """Encode the batch (a message AMQP cannot carry fails alone, permanently), write
        it in a few socket writes, then collect its confirms."""
        confirms, connection = self._confirms, self._connection
        assert confirms is not None and connection is not None
        confirms.start(outcomes)
        # Hear a connection.blocked sent since the last batch's confirms came (py-amqp
        # reads what is there before each message it publishes): then send nothing.
        with contextlib.suppress(TimeoutError):
            connection.drain_events(timeout=0)
        if self._blocked is not None:
            raise self._blocked_error(confirms, len(messages))
        indices, ids, frames = self._encode(route, messages, outcomes, envelope)
        # The tags are registered first: the broker may confirm while the batch is written.
        confirms.sent(indices, ids)
        self._write(connection, frames)
        self._await_confirms(confirms, len(messages), self._confirm_timeout)

    @staticmethod
    def _write(connection: kombu.Connection, frames: list[bytes]) -> None:
        """Hand the frames to the socket; :class:`BrokerStalled` when the broker stops
        reading (a resource alarm, a silent network) until the socket's timeout."""
        write = connection.connection.transport.write
        try:
            for data in chunks(frames, WRITE_SIZE):
                write(data)
        except TimeoutError as exc:
            raise BrokerStalled(
                f"the broker stopped reading: writing a batch of {len(frames)} messages timed out"
            ) from exc

    def _encode(
        self,
        route: Route,
        messages: Sequence[ClaimedMessage],
        outcomes: list[Outcome],
        envelope: Envelope,
    ) -> tuple[list[int], list[str], list[bytes]]:
        """The indices, message ids and frames of the messages that could be encoded
        (in ``envelope``); the others get a permanent failure in ``outcomes``."""
        frames = self._frames
        assert frames is not None
        methods: dict[str, bytes] = {}  # routing key -> its basic.publish frame
        indices: list[int] = []
        ids: list[str] = []
        encoded: list[bytes] = []
        for index, message in enumerate(messages):
            try:
                key = routing_key(route, message)
                method = methods.get(key)
                if method is None:
                    method = methods[key] = method_frame(frames.channel_id, route.exchange, key)
                if envelope[0] == cloudevents.OUTBOX:
                    headers = message.wire_headers()
                    event_id = headers["event_id"]
                    encoded.append(frames.message(method, message.body, headers, event_id))
                else:
                    wire = cloudevents.wire(message, *envelope)
                    event_id = str(message.event_id)
                    kind = None if wire.content_type == CONTENT_TYPE else wire.content_type
                    encoded.append(frames.message(method, wire.body, wire.headers, event_id, kind))
            except ENCODE_ERRORS as exc:
                outcomes[index] = Failure.from_exception(exc, permanent=True)
                continue
            indices.append(index)
            ids.append(event_id)
        return indices, ids, encoded

    def _blocked_error(self, confirms: _Confirms, total: int) -> BrokerStalled:
        unconfirmed = sum(outcome is _UNSETTLED for outcome in confirms.outcomes)
        return BrokerStalled(
            f"the broker blocked publishing ({self._blocked}): "
            f"{unconfirmed} of {total} messages not confirmed"
        )

    def _await_confirms(self, confirms: _Confirms, total: int, timeout: float) -> None:
        """Collect the confirms of the ``total`` messages sent; :class:`BrokerStalled`
        when the broker blocks the connection or ``timeout`` passes first (the
        messages never sent, after a block, count among those unconfirmed)."""
        connection = self._connection
        assert connection is not None
        deadline = time.monotonic() + timeout
        while confirms.pending:
            if self._blocked is not None:
                raise self._blocked_error(confirms, total)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerStalled(
                    f"{len(confirms.pending)} of {total} messages were not confirmed "
                    f"by the broker within {timeout:g}s"
                )
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=remaining)


class AmqpTransport(KombuTransport):
    """RabbitMQ (py-amqp: ``amqp://``, ``amqps://``, ``pyamqp://``): publisher confirms,
    pipelined per batch; unroutable messages come back from the broker (``mandatory``)."""

    supports_confirms = True


class RedisTransport(KombuTransport):
    """Redis (``redis://``, ``rediss://``, ``sentinel://``): a batch goes out as one
    pipeline, in kombu's own message format but without its producer
    (:mod:`~django_outbox.transports.redis_wire`); a message counts as published when its
    push was answered without an error, and none of it when the pipeline itself failed
    (some of it may have reached Redis). A kombu whose channel that writer does not know
    (another version) gets kombu's producer instead."""

    supports_batch = True
    cloudevents_binary = False  # no CloudEvents binding for Redis: structured mode
    #: The channel :meth:`RedisWire.unusable` last checked, and what it said.
    _wire_checked: tuple[Any, str] = (None, "")

    @contextlib.contextmanager
    def _writer(self, route: Route, size: int, envelope: Envelope) -> Iterator[_Writer]:
        if self._wire_unusable() or not RedisWire.takes(self._channel, route.exchange):
            with super()._writer(route, size, envelope) as writer:
                yield writer
            return
        wire = RedisWire(self._channel, route.exchange, envelope)
        yield wire
        wire.send()

    def _check_ready(self) -> None:
        """Have Redis take a write: ``LPUSHX`` to a key that does not exist (nothing is
        written), which Redis refuses like any push when it is out of memory
        (``OutOfMemoryError``), so a relay backing off from a full Redis resumes only
        once pushes are accepted again. Any other refusal (an ACL that does not let this
        user write the probe's key: ``NOPERM``) is an answer: the broker is up."""
        try:
            self._channel.client.lpushx(f"django_outbox.probe.{uuid.uuid4().hex}", "")
        except self._refused as exc:
            if not out_of_memory(exc):
                return
            raise BrokerOutOfMemory(
                f"Redis refuses every write at its maxmemory ({exc}): let consumers drain its "
                "queues or raise maxmemory; the rows wait, attempts unchanged"
            ) from exc

    def _wire_unusable(self) -> str:
        """Why the relay's Redis writer cannot serve this connection's channel ("": it
        can), checked once per channel; logged once as an ERROR when it cannot."""
        channel, reason = self._wire_checked
        if channel is not self._channel:
            reason = RedisWire.unusable(self._channel)
            if reason and channel is None:
                logger.error(
                    "this kombu's Redis channel is not what the relay's Redis writer knows "
                    "(%s): publishing through kombu's producer, message by message",
                    reason,
                    extra={"action": "outbox.redis_wire_unusable"},
                )
            self._wire_checked = (self._channel, reason)
        return reason
