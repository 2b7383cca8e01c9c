"""How the messages of a route's batch are written to a broker: through kombu's
producer one at a time (:class:`ProducerWriter`, batched where kombu can defer the
writes), as RabbitMQ frames a few socket writes at a time (:func:`encode_frames`,
:func:`write_frames`: the confirmed path of :mod:`.confirms`), or on Redis as one
pipeline (:mod:`.redis_wire`, a :class:`Writer` too).

No message counts as published unless it reached a queue: on kombu's virtual
transports (Redis, filesystem, memory ...), which would drop it, the exchange's
bindings are looked up first (:func:`reaches_a_queue`) and a message that would reach
none is not sent; it fails with :func:`~.base.unroutable`'s text.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import kombu
import kombu.exceptions

from .. import cloudevents
from ..conf import outbox_settings
from ..conf.routes import Route
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE, ClaimedMessage
from .amqp_frames import PublishFrames, chunks, method_frame
from .base import Failure, Outcome, unroutable
from .connection import BrokerStalled, transient_failure

#: About how many bytes of a batch's frames go to the socket in one write.
WRITE_SIZE = 256 * 1024
#: Errors that mean "the message could not be encoded": retrying cannot help.
#: (py-amqp raises struct.error for a header int beyond 64 bits or a key over 255 bytes,
#: while it builds the frame and before it writes a byte.)
ENCODE_ERRORS = (TypeError, ValueError, UnicodeError, struct.error, kombu.exceptions.EncodeError)


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


class Writer(Protocol):
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


def write_batch(
    writing: contextlib.AbstractContextManager[Writer],
    route: Route,
    messages: Sequence[ClaimedMessage],
    outcomes: list[Outcome],
) -> None:
    """Write ``messages`` through the writer ``writing`` yields; where it defers its
    writes (Redis), a message counts as published only once the whole batch was
    written, and unless the broker refused it then (:attr:`Writer.failed`)."""
    accepted = []  # written into the batch, not yet to the broker
    with writing as writer:
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


class ProducerWriter:
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


@contextlib.contextmanager
def producer_writer(
    producer: kombu.Producer, route: Route, size: int, *, batch: bool, envelope: Envelope
) -> Iterator[ProducerWriter]:
    """kombu's producer writing the ``size`` messages of a batch for ``route`` in
    ``envelope``, in one pipeline where ``batch`` asks for it and kombu supports it (see
    :func:`_batch`)."""
    with _batch(producer, size, batch) as batched:
        # Looked up once per routing key and batch, like the bindings themselves.
        reaches = functools.cache(functools.partial(reaches_a_queue, producer.channel, route))
        yield ProducerWriter(producer, route, reaches, deferred=batched, envelope=envelope)


@contextlib.contextmanager
def _batch(producer: kombu.Producer, size: int, batch: bool) -> Iterator[bool]:
    """One pipeline for the batch where kombu supports it (yields True), else
    publish as we go (yields False).

    kombu's virtual transports (Redis among them) look the exchange's bindings
    up for every message, a round trip each on Redis; within one batch they
    are read once (a binding made meanwhile applies from the next batch)."""
    if not (batch and producer.supports_batch_publish):
        yield False  # (Redis: kombu batches only where a retry cannot duplicate)
        return
    channel = producer.channel
    channel.get_table = functools.cache(channel.get_table)
    try:
        with producer.batch(max_size=size):
            yield True
    finally:
        del channel.get_table  # back to kombu's own method


def reaches_a_queue(channel: Any, route: Route, key: str) -> bool:
    """Whether kombu's virtual channel would deliver a message with routing key
    ``key`` to a queue: the lookup its own delivery makes, in the exchange's
    bindings (cached per batch on Redis), without its dead-letter fallback. (Not
    asked on RabbitMQ: the broker returns what it cannot route.)"""
    if not route.exchange:
        return True  # "" delivers to queue `key`
    exchange_type = channel.typeof(route.exchange)
    if exchange_type.type == "fanout" and not channel.supports_fanout:
        return False  # kombu drops fanout messages where the transport has no fanout
    try:
        table = channel.get_table(route.exchange)
    except KeyError:  # an exchange that was never declared has no bindings
        return False
    return bool(exchange_type.lookup(table, route.exchange, key, None))


def encode_frames(
    frames: PublishFrames,
    route: Route,
    messages: Sequence[ClaimedMessage],
    outcomes: list[Outcome],
    envelope: Envelope,
) -> tuple[list[int], list[str], list[bytes]]:
    """The indices, message ids and RabbitMQ frames of the messages that could be
    encoded (in ``envelope``); the others get a permanent failure in ``outcomes``."""
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
            event_id = str(message.event_id)
            encoded.append(_frame(frames, method, message, envelope))
        except ENCODE_ERRORS as exc:
            outcomes[index] = Failure.from_exception(exc, permanent=True)
            continue
        indices.append(index)
        ids.append(event_id)
    return indices, ids, encoded


def _frame(
    frames: PublishFrames, method: bytes, message: ClaimedMessage, envelope: Envelope
) -> bytes:
    """``message``'s frames after ``method``: as stored in the outbox's envelope (its
    body never re-encoded), else as :func:`~django_outbox.cloudevents.wire` makes it."""
    if envelope[0] == cloudevents.OUTBOX:
        headers = message.wire_headers()
        return frames.message(method, message.body, headers, headers["event_id"])
    wire = cloudevents.wire(message, *envelope)
    kind = None if wire.content_type == CONTENT_TYPE else wire.content_type
    return frames.message(method, wire.body, wire.headers, str(message.event_id), kind)


def write_frames(connection: kombu.Connection, frames: list[bytes]) -> None:
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
