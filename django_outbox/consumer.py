"""The kombu consumer loop behind ``run_outbox_consumer``.

:class:`InboxConsumer` reads one queue and runs a handler for each event through
the inbox (:func:`~django_outbox.inbox.process_once`), so a redelivered event
is acknowledged without running the handler again. Per message:

* **decodes** JSON only (``accept=["json"]``: a pickled message is refused, never
  unpickled); a body that does not decode or carries no event id is
  **rejected** without requeue, so the broker's dead-letter policy applies;
* **handles** it in one transaction with the inbox mark, then **acks**; a
  duplicate is acked at once;
* on a handler error, counts the failed delivery in
  :class:`~django_outbox.models.InboxFailure` and **requeues** it, until
  ``max_deliveries`` is reached: then the message is **parked** (body and
  headers kept in that row) and rejected, instead of looping forever;
* when the database itself is unreachable, requeues without counting and
  backs off, so an outage parks nothing.

Prefetch is bounded, so a stopped or killed consumer leaves at most
``prefetch`` messages unacked, and the broker redelivers them. A lost broker
connection is retried with backoff. :meth:`InboxConsumer.run` returns when its
stop event is set (after the message in hand) or after ``idle_timeout``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kombu
import kombu.exceptions
from django.db import DatabaseError, close_old_connections, connections

from .conf import outbox_settings
from .envelope import ReceivedEvent
from .exceptions import InvalidMessage
from .inbox import process_once, record_failure
from .outage import Outage
from .redact import SecretFilter
from .transports.kombu import CONNECT_TIMEOUT, declare, refusal_errors, transient_errors

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

DEFAULT_PREFETCH = 100
DEFAULT_MAX_DELIVERIES = 5
#: How long one wait for a message lasts, so a stop request is seen promptly.
DRAIN_TIMEOUT = 1.0
#: Errors kombu raises when a message cannot be decoded or is of a refused type.
DECODE_ERRORS = (
    kombu.exceptions.ContentDisallowed,
    kombu.exceptions.DecodeError,
    UnicodeError,
    InvalidMessage,
)

Handler = Callable[[ReceivedEvent], object]


@dataclasses.dataclass
class ConsumerStats:
    """What a consumer did with the messages it received."""

    received: int = 0
    handled: int = 0  # the handler ran and its transaction committed
    duplicates: int = 0  # already in the inbox: acked, handler not run
    failed: int = 0  # the handler raised: requeued for another delivery
    parked: int = 0  # failed max_deliveries times: kept in InboxFailure, rejected
    rejected: int = 0  # not decodable as an outbox event: rejected
    elapsed: float = 0.0  # seconds the consumer ran
    busy: float = 0.0  # seconds from the first message received to the last one settled

    def summary(self) -> str:
        rate = self.received / self.busy if self.busy else 0.0
        return (
            f"received {self.received}: handled {self.handled}, duplicates {self.duplicates}, "
            f"failed {self.failed}, parked {self.parked}, rejected {self.rejected} "
            f"in {self.elapsed:.1f}s ({rate:.0f} messages/s while busy)"
        )


class InboxConsumer:
    """Consume ``queue`` and run ``handler`` once per event for ``consumer``."""

    def __init__(
        self,
        queue: str,
        handler: Handler,
        consumer: str,
        *,
        using: str = "default",
        prefetch: int = DEFAULT_PREFETCH,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        url: str | None = None,
        transport_options: dict[str, Any] | None = None,
    ) -> None:
        self.queue = queue
        self.handler = handler
        self.consumer = consumer
        self.using = using
        self.prefetch = prefetch
        self.max_deliveries = max_deliveries
        self.url = outbox_settings.require_broker_url(url)
        if transport_options is None:
            transport_options = outbox_settings.BROKER_TRANSPORT_OPTIONS
        self.transport_options = transport_options
        self.route = outbox_settings.route_for_queue(queue)
        self.stats = ConsumerStats()
        self._transient = transient_errors(kombu.Connection(self.url))
        self._outage = Outage()
        self._stop = threading.Event()
        self._first_message_at: float | None = None

    def run(self, stop: threading.Event, *, idle_timeout: float | None = None) -> ConsumerStats:
        """Consume until ``stop`` is set, or until no message came for ``idle_timeout``
        seconds. Returns the totals."""
        self._stop = stop
        started = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    if self._consume(idle_timeout):
                        break
                except self._transient as exc:
                    self._outage.broker_suspect()  # each logs only at an outage's start
                    self._outage.broker_failed(exc)
                    stop.wait(self._outage.backoff())
        finally:
            self.stats.elapsed = time.monotonic() - started
        return self.stats

    def _consume(self, idle_timeout: float | None) -> bool:
        """One connection's life. True when done (stopped or idle), on a broker
        error it raises one of the transient errors."""
        connection = kombu.Connection(
            self.url, transport_options=self.transport_options, connect_timeout=CONNECT_TIMEOUT
        )
        try:
            connection.connect()
            channel = connection.channel()
            queue = self._declare(connection, channel)
            if self._outage.broker_down:
                self._outage.broker_recovered()
            logger.info(
                "consuming %s as %r (prefetch %d)",
                self.queue,
                self.consumer,
                self.prefetch,
                extra={"action": "inbox.consuming", "queue": self.queue},
            )
            with kombu.Consumer(
                channel,
                queues=[queue],
                accept=["json"],
                on_message=self._on_message,
                on_decode_error=self._on_undecodable,
                prefetch_count=self.prefetch,
                auto_declare=False,
            ):
                idle = 0.0
                while not self._stop.is_set():
                    try:
                        connection.drain_events(timeout=DRAIN_TIMEOUT)
                    except TimeoutError:
                        connection.heartbeat_check()
                        idle += DRAIN_TIMEOUT
                        if idle_timeout is not None and idle >= idle_timeout:
                            return True
                        close_old_connections()  # honours CONN_MAX_AGE between idle spells
                    else:
                        idle = 0.0
            return True
        finally:
            try:
                connection.release()
            except Exception:  # the connection is already broken; nothing to save
                logger.debug("error closing a broken broker connection", exc_info=True)

    def _declare(self, connection: kombu.Connection, channel: Any) -> kombu.Queue:
        # A refusal (e.g. the queue exists with other arguments) raises DeclareRefused,
        # an OutboxConfigurationError with the relay's wording: retrying cannot help.
        queue = declare(channel, self.route, refused=refusal_errors(connection))
        assert queue is not None  # route_for_queue() always names the queue
        return queue

    # -- one message ----------------------------------------------------------------

    def _on_message(self, message: Any) -> None:
        if self._first_message_at is None:
            self._first_message_at = time.monotonic()
        try:
            self._handle(message)
        finally:
            self.stats.busy = time.monotonic() - self._first_message_at

    def _handle(self, message: Any) -> None:
        self.stats.received += 1
        try:
            event = ReceivedEvent.from_wire(
                message.decode(), message.headers, message.properties.get("message_id")
            )
        except DECODE_ERRORS as exc:
            self._reject(message, exc)
            return
        try:
            with process_once(self.consumer, event.event_id, self.using) as new:
                if new:
                    self.handler(event)
        except DatabaseError as exc:
            if self._database_unusable():
                self._database_down(message, exc)
                return
            self._failed(message, event, exc)
            return
        except Exception as exc:
            self._failed(message, event, exc)
            return
        self._outage.database_recovered(self.using)
        message.ack()
        if new:
            self.stats.handled += 1
        else:
            self.stats.duplicates += 1

    def _on_undecodable(self, message: Any, exc: Exception) -> None:
        """kombu could not even turn the frame into a message (e.g. bad compression)."""
        self.stats.received += 1
        self._reject(message, exc)

    def _reject(self, message: Any, exc: Exception) -> None:
        self.stats.rejected += 1
        logger.error(
            "rejected a message from %s that is not an outbox event (%s: %s); "
            "the broker's dead-letter policy applies",
            self.queue,
            type(exc).__name__,
            exc,
            extra={
                "action": "inbox.rejected",
                "queue": self.queue,
                "message_id": message.properties.get("message_id"),
                "content_type": message.content_type,
            },
        )
        message.reject(requeue=False)

    def _failed(self, message: Any, event: ReceivedEvent, exc: Exception) -> None:
        error = outbox_settings.redact(f"{type(exc).__name__}: {exc}")  # shown by the admin
        extra = {"queue": self.queue, "consumer": self.consumer, "event_id": str(event.event_id)}
        try:
            deliveries, parked = record_failure(
                self.consumer,
                event,
                error=error,
                queue=self.queue,
                body=_text(message.body),
                broker_deliveries=_broker_deliveries(message.headers),
                park_after=self.max_deliveries,
                using=self.using,
            )
        except DatabaseError as db_exc:
            self._database_down(message, db_exc)
            return
        if parked:
            self.stats.parked += 1
            logger.error(
                "%s: event %s failed %d deliveries and is parked (%s); "
                "see InboxFailure in the admin",
                self.consumer,
                event.event_id,
                deliveries,
                error,
                extra={"action": "inbox.parked", "deliveries": deliveries, **extra},
            )
            message.reject(requeue=False)
            return
        self.stats.failed += 1
        logger.warning(
            "%s: handler failed on event %s (delivery %d%s); requeued",
            self.consumer,
            event.event_id,
            deliveries,
            f" of {self.max_deliveries}" if self.max_deliveries else "",
            exc_info=exc,
            extra={"action": "inbox.handler_failed", "deliveries": deliveries, **extra},
        )
        message.requeue()

    def _database_unusable(self) -> bool:
        connection = connections[self.using]
        return connection.connection is None or not connection.is_usable()

    def _database_down(self, message: Any, exc: Exception) -> None:
        """The database is gone: the message goes back uncounted, and the consumer
        waits before taking the next one."""
        message.requeue()
        self._outage.database_failed(self.using, exc)
        connections[self.using].close()
        self._stop.wait(self._outage.backoff())


def _broker_deliveries(headers: dict[str, Any] | None) -> int:
    """Deliveries so far by the broker's own count (RabbitMQ quorum queues' header
    ``x-delivery-count`` counts earlier deliveries), or 0 where it keeps none."""
    count = (headers or {}).get("x-delivery-count")
    return count + 1 if isinstance(count, int) and not isinstance(count, bool) else 0


def _text(body: bytes | str) -> str:
    return body if isinstance(body, str) else body.decode("utf-8", errors="replace")
