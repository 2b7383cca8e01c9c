"""Consuming a NATS JetStream stream (``nats://`` brokers) through the kombu consumer's
pipeline.

A JetStream message is wrapped as the small part of a kombu message that
:mod:`.handling` and the modules behind it read (:class:`JetStreamMessage`): ``ack`` is
JetStream's ack, ``reject`` its ``term``, ``requeue`` its ``nak``; it is *redelivered*
when the server's delivery count is over 1, and that count is the broker's own
(``x-delivery-count``, as a RabbitMQ quorum queue's). So the inbox's dedupe, counting,
parking, signatures and per-key order are the same code on both brokers; what lives here
is the run (:class:`JetStreamRun`: the kombu run, whose every connection is a pull from
the stream), the pull loop (:class:`JetStreamSource`) and the durable consumer it binds.
(:mod:`.replay` sends parked messages back to the subject they came from.)

A failed delivery is not held unacked here: it is nak'd with its backoff delay at once
(:class:`Naks`), and the server delivers it again when the delay is over. An ordered
route's event that came early is held unacked as on the kombu brokers, and nak'd as soon
as its key's earlier event is handled.

nats-py is asyncio: each connection's life runs on an
:class:`~django_outbox.transports.nats.EventLoop` thread of its own, as the relay's
transport does, and the consumer's thread hands it each fetch and each ack.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import re
import time
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

from ..conf.brokers import nats_servers
from ..conf.redact import mask_url
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE, ORDERING_HEADERS
from ..exceptions import OutboxConfigurationError
from ..transports.nats import (
    MSG_ID,
    RESERVED_PREFIX,
    SERVER_CONNECT_TIMEOUT,
    EventLoop,
    close_client,
    cluster_errors,
    connect_options,
)
from .held import Held
from .loop import ConsumerRun, InboxConsumer

#: Seconds a message may stay unacked after its delivery before the server delivers it
#: again, for a durable this consumer creates (NATS's own default). A durable made
#: beforehand keeps its own.
ACK_WAIT = 30.0
#: Seconds one fetch waits for messages, so a stop request is seen promptly.
FETCH_WAIT = 1.0
#: Seconds the server may take to answer a request (stream or consumer info, an ack).
REQUEST_TIMEOUT = 5.0
#: The header a JetStream message's content type travels in (when not the envelope's).
CONTENT_TYPE_HEADER = "content-type"


class Run(Protocol):
    """What :meth:`JetStreamSource.consume` needs of the run it serves
    (:class:`~.loop.ConsumerRun`)."""

    @property
    def should_stop(self) -> bool: ...

    held: Held

    def ready(self) -> None: ...

    def idle(self) -> None: ...

    def on_message(self, queue: str, message: Any) -> None: ...


def durable_name(consumer: str) -> str:
    """The durable JetStream consumer of inbox consumer ``consumer``: its name with each
    character NATS refuses in a durable name (or that is not a letter, digit, ``_`` or
    ``-``) as ``_``, and then, when any was replaced, ``_`` and 8 hex digits of its
    SHA-1, so that two names never share a durable."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", consumer)
    if name == consumer:
        return name
    return f"{name}_{hashlib.sha1(consumer.encode()).hexdigest()[:8]}"


class JetStreamRun(ConsumerRun):
    """One run of an :class:`~.loop.InboxConsumer` on a NATS JetStream broker: the kombu
    run's loop, backoff and idle time, each connection's life a pull from the durable
    consumer (:class:`JetStreamSource`), failed messages nak'd with their delay
    (:class:`Naks`), and JetStream's delivery count the broker's own."""

    broker_counts = True

    def __init__(self, consumer: InboxConsumer, idle_timeout: float | None = None) -> None:
        self.source = JetStreamSource(
            consumer.url,
            consumer.transport_options,
            consumer.queue,
            consumer.consumer,
            consumer.prefetch,
        )
        super().__init__(consumer, idle_timeout)

    def broker_errors(self) -> tuple[type[BaseException], ...]:
        return self.source.transient

    def holding(self) -> Held:
        return Naks()

    def consume(self, *args: Any, **kwargs: Any) -> None:
        """One connection's life: see :meth:`JetStreamSource.consume`."""
        self._attempt = time.monotonic()
        self.source.consume(self)


class JetStreamSource:
    """Where a consumer of a ``nats://`` broker reads: ``queue`` (a stream's name, or a
    subject, which is read from the stream that takes it) through the durable pull
    consumer of ``consumer``, ``batch`` messages a fetch."""

    def __init__(
        self, url: str, options: Mapping[str, Any], queue: str, consumer: str, batch: int
    ) -> None:
        self.url, self.options, self.queue, self.batch = url, dict(options), queue, batch
        self.durable = durable_name(consumer)
        #: What nats-py raises when the cluster cannot be reached: an outage.
        self.transient = cluster_errors()

    def consume(self, run: Run) -> None:
        """One connection's life: connect, bind the durable consumer, hand each message
        to ``run`` until it stops; a cluster error raises one of :attr:`transient`."""
        from nats.aio.client import Client

        loop, client = EventLoop(), Client()
        try:
            options = connect_options("django_outbox consumer", self.options)
            connect_within = SERVER_CONNECT_TIMEOUT * 3 * len(nats_servers(self.url)) + 1
            loop.run(client.connect(nats_servers(self.url), **options), connect_within)
            subscription = loop.run(self._bind(client.jetstream()), REQUEST_TIMEOUT * 3)
            run.ready()
            self._pull(run, loop, client, subscription)
            run.held.requeue_all()  # stopping: the early events held go back at once
        finally:
            run.held.forget()  # on a lost connection the server delivers them again
            close_client(loop, client)

    def _pull(self, run: Run, loop: EventLoop, client: Any, subscription: Any) -> None:
        while not run.should_stop:
            run.held.requeue_due()
            wait = run.held.wait(FETCH_WAIT)
            try:
                fetched = loop.run(subscription.fetch(self.batch, timeout=wait), wait + 5)
            except TimeoutError:  # (nats-py's or asyncio's) nothing came, or the cluster
                # went silent: a ping answered tells (else a cluster error: an outage).
                loop.run(client.flush(SERVER_CONNECT_TIMEOUT), SERVER_CONNECT_TIMEOUT + 1)
                run.idle()
                continue
            for message in fetched:
                run.on_message(message.subject, JetStreamMessage(message, loop))

    async def _bind(self, js: Any) -> Any:
        """The pull subscription of the durable consumer on the stream ``queue`` names,
        created if missing; :class:`OutboxConfigurationError` when there is no such stream
        or the durable exists with settings this consumer cannot work with."""
        from nats.js.api import AckPolicy, ConsumerConfig
        from nats.js.errors import NotFoundError

        stream, subject = await self._stream(js)
        wanted = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT,
            max_deliver=-1,  # the inbox parks after --max-deliveries
            filter_subject=subject,
        )
        try:
            info = await js.consumer_info(stream, self.durable)
        except NotFoundError:
            await self._create(js, stream, wanted)
        else:
            self._require_fit(stream, info.config, subject)
        return await js.pull_subscribe_bind(durable=self.durable, stream=stream)

    async def _create(self, js: Any, stream: str, config: Any) -> None:
        """Create the durable; :class:`OutboxConfigurationError` when the server refuses
        it for itself (a stream without a leader is an outage)."""
        from nats.js.errors import APIError, ServiceUnavailableError

        try:
            await js.add_consumer(stream, config)
        except ServiceUnavailableError:
            raise
        except APIError as exc:
            raise OutboxConfigurationError(
                f"JetStream refused to create consumer {self.durable!r} on stream {stream!r}: "
                f"{exc.description or exc}"
            ) from None

    async def _stream(self, js: Any) -> tuple[str, str | None]:
        """The stream to read and the subject to filter on (None: all of it)."""
        from nats.js.errors import NotFoundError

        if re.fullmatch(r"[^.*>\s]+", self.queue):
            try:
                await js.stream_info(self.queue)
                return self.queue, None
            except NotFoundError:
                pass
        try:
            return await js.find_stream_name_by_subject(self.queue), self.queue
        except NotFoundError:
            raise OutboxConfigurationError(
                f"no JetStream stream is named {self.queue!r} or takes subject {self.queue!r} "
                f"on {mask_url(self.url)}: give --queue a stream or a subject of one (the relay "
                "creates its route's stream when it first publishes)"
            ) from None

    def _require_fit(self, stream: str, config: Any, subject: str | None) -> None:
        """:class:`OutboxConfigurationError` when the existing durable is not a pull
        consumer with explicit acks, unlimited deliveries and this consumer's filter."""
        from nats.js.api import AckPolicy

        misfits = []
        if config.deliver_subject:
            misfits.append(f"it is a push consumer (deliver_subject {config.deliver_subject!r})")
        if config.ack_policy not in (AckPolicy.EXPLICIT, "explicit"):
            misfits.append(f"ack_policy {config.ack_policy!s}, not explicit")
        if (config.max_deliver or -1) > 0:
            misfits.append(f"max_deliver {config.max_deliver}, not unlimited (-1)")
        if (config.filter_subject or None) != subject:
            misfits.append(f"filter_subject {config.filter_subject!r}, not {subject!r}")
        if misfits:
            raise OutboxConfigurationError(
                f"JetStream consumer {self.durable!r} of stream {stream!r} exists, but "
                f"{'; '.join(misfits)}: delete it (nats consumer rm {stream} {self.durable}) "
                "or consume under another --consumer name"
            )


class JetStreamMessage:
    """A JetStream message, as the kombu consumer's pipeline reads a message."""

    content_encoding = CONTENT_ENCODING

    def __init__(self, message: Any, loop: EventLoop) -> None:
        self._message, self._loop = message, loop
        raw = dict(message.headers or {})
        self.content_type = raw.get(CONTENT_TYPE_HEADER, CONTENT_TYPE)
        self.body: bytes = message.data
        delivered = message.metadata.num_delivered
        self.headers = received_headers(raw, delivered)
        self.properties = {"message_id": raw.get("event_id") or raw.get(MSG_ID)}
        self.delivery_info = {"redelivered": delivered > 1}

    def _settle(self, settling: Coroutine[Any, Any, None]) -> None:
        self._loop.run(settling, REQUEST_TIMEOUT)

    def ack(self) -> None:
        self._settle(self._message.ack())

    def reject(self, requeue: bool = False) -> None:
        """Not to be delivered again (JetStream's ``term``); ``requeue``: ``nak``."""
        self._settle(self._message.nak() if requeue else self._message.term())

    def requeue(self, delay: float | None = None) -> None:
        """Deliver again (``nak``): at once, or after ``delay`` seconds."""
        self._settle(self._message.nak(delay=delay))


def received_headers(raw: Mapping[str, str], delivered: int) -> dict[str, Any]:
    """A JetStream message's headers as the pipeline reads them: without JetStream's own
    (``Nats-...``) and the content type, the ordering headers the relay wrote as JSON
    read back as numbers and booleans (the others stay text), and the server's count of
    earlier deliveries as ``x-delivery-count``, as a quorum queue gives it."""
    headers: dict[str, Any] = {
        name: _ordering_value(value) if name in ORDERING_HEADERS else value
        for name, value in raw.items()
        if not name.lower().startswith(RESERVED_PREFIX) and name != CONTENT_TYPE_HEADER
    }
    headers["x-delivery-count"] = delivered - 1
    return headers


def _ordering_value(text: str) -> Any:
    """``sequence``'s whole number, ``skipped``'s boolean; anything else as it came (a
    sequence that is not a whole number is then refused as not the relay's)."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (bool, int)) else text


class Naks(Held):
    """A JetStream run's failed messages, each nak'd with its backoff delay at once (the
    server delivers it again then) and remembered until then only so that an
    ``idle_timeout`` does not end a run with messages still to come back; an ordered
    route's early events are held unacked here as on the kombu brokers, and nak'd (at
    once) when their predecessor is handled or their delay is over. (Nak'd with a delay
    instead, every later event of their key came early too, and was nak'd in turn.)

    A nak'd message's due time never shortens a fetch (:meth:`wait` is the held ones'
    only): the server then redelivers it while a pull request waits. A pull request
    that expired as the redelivery fell due made NATS servers before 2.10.14 lose the
    redelivery until the ack wait was over and send an acked message again
    (nats-server #5305); fetches timed to the delay hit that every few runs.
    """

    def __init__(self) -> None:
        super().__init__()
        self._coming: list[float] = []  # when each nak'd message is due back: a heap

    def __len__(self) -> int:
        self._forget_past()
        return super().__len__() + len(self._coming)

    def hold(self, message: Any, delay: float, scope: Any = None) -> None:
        if scope is not None:
            super().hold(message, delay, scope)
            return
        message.requeue(delay)
        heapq.heappush(self._coming, time.monotonic() + delay)

    def requeue_due(self) -> None:
        super().requeue_due()
        self._forget_past()

    def forget(self) -> None:
        super().forget()
        self._coming.clear()

    def _forget_past(self) -> None:
        now = time.monotonic()
        while self._coming and self._coming[0] <= now:
            heapq.heappop(self._coming)
