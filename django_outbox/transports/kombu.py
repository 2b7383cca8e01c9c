"""The kombu transports: RabbitMQ with pipelined publisher confirms
(:class:`AmqpTransport`), Redis through one pipeline a batch (:class:`RedisTransport`),
and every other kombu transport (filesystem, memory; others untested) through its
producer (:class:`KombuTransport`).

Each keeps one connection and channel (:mod:`.connection`), declares a route's
topology once per connection (:mod:`.declare`), and writes a batch through its
broker's way (:mod:`.confirms` on RabbitMQ, :mod:`.writers` and :mod:`.redis_wire`
elsewhere).

On Redis a batch goes out as one pipeline in kombu's own message format, written
without kombu's producer (:mod:`.redis_wire`; a fanout exchange keeps the producer's
``Producer.batch()``), so kombu consumers read it; the exchange's bindings are read
once per batch instead of once per message. Each message counts as published when its
push was answered without an error; if the pipeline itself failed (the connection),
none of it does. A Redis that refuses writes for now (out of memory, read-only after a
failover, unable to persist: :func:`~.redis_wire.write_refusal`) is an outage, as
RabbitMQ's memory alarm is: no attempt counted, and the relay backs off until a probe
write (:meth:`RedisTransport._check_ready`) is accepted again.

No message counts as published unless it reached a queue: RabbitMQ returns an
unroutable message (``mandatory``); on kombu's virtual transports (Redis,
filesystem, memory ...), which would drop it, the relay looks the queues up in
the exchange's bindings first and does not send a message that would reach none.
Both fail it with the same :func:`~.base.unroutable` text.

A queue or exchange the broker refuses to declare (:class:`~.declare.DeclareRefused`)
fails its rows without counting an attempt; they are due again in
:data:`REFUSED_RETRY_DELAY`, and one ERROR per refusal and interval says why.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import kombu

from ..conf import outbox_settings
from ..conf.redact import SecretFilter, mask_url
from ..conf.routes import Route
from ..envelope import ClaimedMessage
from ..exceptions import BrokerUnreachable
from .base import Failure, Outcome, Transport
from .confirms import UNSETTLED, ConfirmedChannel, lease_confirm_timeout, nacked_whole
from .connection import (
    CONNECT_TIMEOUT,
    open_connection,
    release,
    transient_errors,
    transient_failure,
)
from .declare import DeclareRefused, declare, refusal_errors
from .redis_wire import RedisWire, probe_writes, refusing_writes
from .writers import Envelope, Writer, envelope_of, producer_writer, write_batch

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' and brokers' texts

#: Seconds until the rows of a route whose queue the broker refused are due again,
#: and between two ERROR records about the same refusal.
REFUSED_RETRY_DELAY = 30.0


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
        #: Default: derived from LEASE_SECONDS (:func:`~.confirms.lease_confirm_timeout`).
        self._confirm_timeout = (
            lease_confirm_timeout() if confirm_timeout is None else confirm_timeout
        )
        self._refused_retry_delay = refused_retry_delay
        #: refusal text -> when (monotonic) it may be logged again
        self._refusals_logged: dict[str, float] = {}
        self._connection: kombu.Connection | None = None
        self._channel: Any = None
        self._producer: kombu.Producer | None = None
        #: The confirm-mode channel (RabbitMQ): its tags, frames and blocked state.
        self._confirmed: ConfirmedChannel | None = None
        self._declared: set[Route] = set()
        # Building a Connection does not connect; it tells the driver's errors.
        probe = kombu.Connection(url)
        self._transient = transient_errors(probe)
        self._refused = refusal_errors(probe)

    # -- connection -----------------------------------------------------------------

    def _connect(self) -> kombu.Connection:
        if self._connection is None:
            # One attempt per address (the relay owns the backoff). A broker that stops
            # reading (a resource alarm, a silent network) fails a write or a reply's
            # wait instead of blocking the relay without end.
            waits = max(self._confirm_timeout, CONNECT_TIMEOUT)
            connection = open_connection(self._url, self._options, socket_timeout=waits)
            try:
                channel = connection.channel()
                confirmed = None
                if self.supports_confirms:  # py-amqp: hears connection.blocked, .unblocked
                    confirmed = ConfirmedChannel(connection, channel, self._confirm_timeout)
            except BaseException:
                connection.release()
                raise
            self._connection, self._channel, self._confirmed = connection, channel, confirmed
            self._producer = kombu.Producer(channel, auto_declare=False)
        return self._connection

    def check(self) -> None:
        """Connect (once) and, with publisher confirms, have a probe message confirmed
        (a broker that takes connections but blocks publishers is down too); an error
        names the broker's alias when it has one."""
        try:
            self._connect()
            self._check_ready()
            self._probe()
        except Exception as exc:
            error = refusing_writes(exc)
            if self.alias is None:
                raise error  # noqa: B904 (its cause is set: exc, or exc's)
            raise BrokerUnreachable(
                f"broker {self.alias!r} ({mask_url(self._url)}): {type(error).__name__}: {error}"
            ) from error

    def _check_ready(self) -> None:
        """What else the broker needs, once connected (a subclass's own check)."""

    def _probe(self) -> None:
        """With confirms: have a probe confirmed (:meth:`ConfirmedChannel.probe`), at
        most ``CONNECT_TIMEOUT``; raises :class:`~.connection.BrokerStalled` (the
        connection dropped) when it does not come. A broker that answers at all (a
        confirm, a nack, or a refusal of the probe, such as a user without write
        permission on the default exchange) is up."""
        if self._confirmed is None:
            return
        try:
            self._confirmed.probe(min(self._confirm_timeout, CONNECT_TIMEOUT))
        except self._refused:  # it answered: up; the refused channel is opened afresh
            self.close(graceful=False)
        except self._transient:
            self.close(graceful=False)
            raise

    def close(self, *, graceful: bool = True) -> None:
        """Drop the connection (see :func:`~.connection.release` for ``graceful``)."""
        connection, self._connection = self._connection, None
        self._channel = self._producer = self._confirmed = None
        self._declared.clear()
        if connection is not None:
            release(connection, logger, graceful=graceful)

    # -- publishing -----------------------------------------------------------------

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        outcomes: list[Outcome] = [UNSETTLED] * len(messages)
        try:
            self._connect()
            refusal = self._declare(route)
        except self._transient as exc:  # nothing sent (a broker that stopped answering: no attempt)
            self.close(graceful=False)
            return [transient_failure(exc)] * len(messages)
        if refusal is not None:
            return [refusal] * len(messages)
        confirmed = self._confirmed
        envelope = envelope_of(route, binary=self.cloudevents_binary)
        try:
            if confirmed is not None:
                confirmed.publish(route, messages, outcomes, envelope)
            else:
                writer = self._writer(route, len(messages), envelope)
                write_batch(writer, route, messages, outcomes)
        except self._transient as exc:
            # Whatever was not confirmed may or may not have reached the broker:
            # it is retried (at-least-once), and the channel starts afresh.
            self.close(graceful=False)
            failure = transient_failure(exc)
            outcomes = [failure if outcome is UNSETTLED else outcome for outcome in outcomes]
        if confirmed is not None and nacked_whole(outcomes):
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

    def _writer(
        self, route: Route, size: int, envelope: Envelope
    ) -> contextlib.AbstractContextManager[Writer]:
        """What writes the ``size`` messages of a batch for ``route`` in ``envelope``
        without confirms: kombu's producer (:func:`~.writers.producer_writer`), batched
        where the transport can defer writes."""
        assert self._producer is not None
        return producer_writer(
            self._producer, route, size, batch=self.supports_batch, envelope=envelope
        )


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

    def _writer(
        self, route: Route, size: int, envelope: Envelope
    ) -> contextlib.AbstractContextManager[Writer]:
        if self._wire_unusable() or not RedisWire.takes(self._channel, route.exchange):
            return super()._writer(route, size, envelope)
        return self._wire(route, envelope)

    @contextlib.contextmanager
    def _wire(self, route: Route, envelope: Envelope) -> Iterator[Writer]:
        """The relay's own Redis writer: the batch is sent as one pipeline at its end."""
        wire = RedisWire(self._channel, route.exchange, envelope)
        yield wire
        wire.send()

    def _check_ready(self) -> None:
        """Have Redis take a write (:func:`~.redis_wire.probe_writes`), so a relay backing
        off from a Redis that refuses writes resumes only once they are accepted again."""
        probe_writes(self._channel.client, self._refused)

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
