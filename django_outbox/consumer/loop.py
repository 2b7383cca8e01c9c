"""The kombu consumer loop behind ``run_outbox_consumer``.

:class:`InboxConsumer` reads one queue and runs a handler for each event through
the inbox (:func:`~django_outbox.inbox.process_once`), so a redelivered event
is acknowledged without running the handler again. Per message:

* **decodes** ``application/json`` only (a pickled message is refused, never
  unpickled, and kombu's raw ``application/data`` and text types are refused
  too); a message of another content type, a body that does not decode or one
  that carries no event id is **rejected** without requeue, so the broker's
  dead-letter policy applies;
* **rejects** a message with a ``compression`` header as kombu builds it, without
  inflating its body (:func:`_uninflated`);
* with signatures verified (``verify_signatures``, ``OUTBOX["VERIFY_SIGNATURES"]``),
  **parks** unrun a message that is not signed by one of ``OUTBOX["SIGNING_KEYS"]``
  (:mod:`django_outbox.signing`), before anything else is believed of it;
* **ignores** an event whose type is not one of ``event_types`` (when given):
  acked at once, no handler call, no inbox row;
* **handles** it in one transaction with the inbox mark, then **acks**; a
  duplicate is acked at once;
* an event of an ordered route (it carries a ``sequence``) runs only in its
  key's turn (:func:`~django_outbox.inbox.records.process_in_order`): one already handled
  (its event id in the inbox) is acked, one whose predecessor is not handled yet
  is **held back** (requeued once that one is handled here, or after a backoff),
  a skip marker moves its key
  on without the handler, and another event claiming a handled sequence (or a
  handled one claiming another) is **parked** as a conflict (see
  docs/ordered-consumption.md);
* on a handler error, counts the failed delivery in
  :class:`~django_outbox.models.InboxFailure`, keeps the message unacked for a
  backoff delay (doubling, capped, with jitter) while it goes on with other
  messages, then **requeues** it, until ``max_deliveries`` is reached: then
  the message is **parked** (body and headers kept in that row) and rejected,
  instead of looping forever;
* counts a delivery the broker marks *redelivered* before its handler runs, so
  a message whose handler kills the consumer (SIGKILL, out of memory) is
  counted too, and parked without running once ``max_deliveries`` is reached;
* when the database itself is unreachable, requeues without counting and
  backs off, so an outage parks nothing;
* on a quorum queue, takes the broker's ``x-delivery-count`` of a redelivery into
  the count too (nowhere else: there the header is the publisher's),
  less its own requeues while the database was down, and not at all for an event
  of an ordered route, whose held-back requeues it counts as well.

The queue of a route with partitions is consumed as its partition queues (all,
or those given), one kombu consumer each.

Prefetch is bounded, so a stopped or killed consumer leaves at most
``prefetch`` messages unacked, and the broker redelivers them. A lost broker
connection is retried with backoff. :meth:`InboxConsumer.run` returns when its
stop event is set (after the message in hand) or after ``idle_timeout``; with an
``idle_timeout``, it gives up (:class:`~django_outbox.exceptions.BrokerUnreachable`)
once that long went by without a broker since the last message.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime as dt
import functools
import heapq
import itertools
import json
import logging
import reprlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import kombu
from django.db import DatabaseError, close_old_connections, connections
from django.utils import timezone
from kombu.mixins import ConsumerMixin

from .. import tracing
from ..conf import outbox_settings
from ..envelope import COMPRESSION_HEADER, CONTENT_ENCODING, CONTENT_TYPE, ReceivedEvent
from ..exceptions import BrokerUnreachable, InvalidMessage, OutboxConfigurationError
from ..inbox.records import (
    UNACKED_ERROR,
    Scope,
    Turn,
    conflict_reason,
    forget_redelivery,
    handled_types,
    handles,
    park_refused,
    peek_turn,
    process_in_order,
    process_once,
    record_failure,
    record_redelivery,
    sequence_scope,
)
from ..models import WorkerKind
from ..redact import SecretFilter, mask_url
from ..routes import Route
from ..signing import SIGNATURE_HEADER, Keyring
from ..state.retry import RetryPolicy
from ..transports.connection import (
    CONNECT_TIMEOUT,
    bound_socket_waits,
    connect,
    new_connection,
    transient_errors,
)
from ..transports.declare import declare, refusal_errors
from ..workers.heartbeat import Heartbeat, HeartbeatThread, process_name
from ..workers.outage import broker_outage, database_outage

logger = logging.getLogger("django_outbox.consumer")
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

DEFAULT_PREFETCH = 100
DEFAULT_MAX_DELIVERIES = 5
#: Backoff before a failed message is requeued: about 1, 2, 4, 8 s ... capped at
#: 30 s, each shortened by up to half at random (so five deliveries span 7.5-15 s).
DEFAULT_RETRY_DELAY = 1.0
DEFAULT_RETRY_MAX_DELAY = 30.0
RETRY_JITTER = 0.5
#: How long one wait for a message lasts, so a stop request is seen promptly.
DRAIN_TIMEOUT = 1.0
#: The shortest wait before an event held back for its key's earlier event is requeued.
EARLY_MIN_DELAY = 0.1
#: An event held back this many times (and each further multiple) is logged at WARNING.
EARLY_WARN_EVERY = 10
#: The most messages whose requeues during a database outage are remembered.
MAX_UNCOUNTED = 100_000
Handler = Callable[[ReceivedEvent], object]
R = TypeVar("R")


@dataclasses.dataclass
class ConsumerStats:
    """What a consumer did with the messages it received."""

    received: int = 0
    handled: int = 0  # the handler ran and its transaction committed
    duplicates: int = 0  # already in the inbox: acked, handler not run
    ignored: int = 0  # an event type the handler does not handle: acked, handler not run
    failed: int = 0  # the handler raised: requeued after a backoff delay
    held: int = 0  # ordered, an earlier event of its key not handled yet: requeued later
    parked: int = 0  # failed max_deliveries times: kept in InboxFailure, rejected
    rejected: int = 0  # not decodable as an outbox event: rejected
    elapsed: float = 0.0  # seconds the consumer ran
    busy: float = 0.0  # seconds from the first message received to the last one settled

    def summary(self) -> str:
        rate = self.received / self.busy if self.busy else 0.0
        return (
            f"received {self.received}: handled {self.handled}, duplicates {self.duplicates}, "
            f"ignored {self.ignored}, failed {self.failed}, parked {self.parked}, "
            f"rejected {self.rejected}{f', held back {self.held}' if self.held else ''} "
            f"in {self.elapsed:.1f}s ({rate:.0f} messages/s while busy)"
        )


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
    if transport_options is None:
        transport_options = outbox_settings.BROKER_TRANSPORT_OPTIONS
    return outbox_settings.require_broker_url(url), transport_options


class InboxConsumer(ConsumerMixin):
    """Consume ``queue`` and run ``handler`` once per event for ``consumer``.

    Built on kombu's :class:`~kombu.mixins.ConsumerMixin`: its consumer context
    (connection, consumers, cancel) and hooks (``get_consumers``,
    ``on_consume_ready``, ``on_decode_error``). ``run()`` and ``consume()`` are this
    class's own, for the reasons said at each.
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
        self.retry = _retry_policy(retry_delay, retry_max_delay, max_deliveries)
        self.url, self.transport_options = _broker_for(queue, url, broker, transport_options)
        self.route = outbox_settings.route_for_queue(queue)
        #: Whether the broker counts deliveries in ``x-delivery-count`` (a quorum queue).
        self._broker_counts = self.route.queue_type == "quorum"
        self.queues = _queues_to_take(self.route, queue, partitions)
        #: The keys a message's signature must be made with; None: not verified.
        self.keys = _verifying_keys(verify_signatures)
        self._current = queue  # the queue of the message in hand
        self._early: dict[Any, int] = {}  # event id -> times held back for its key
        self._uncounted: collections.Counter[Any] = collections.Counter()  # see _broker_count
        self.stats = ConsumerStats()
        #: The attributes of every ``process`` span but the queue and the message id.
        self._span_attributes = tracing.broker_attributes(self.url)
        self._span_attributes["messaging.consumer.group.name"] = consumer
        self._transient = transient_errors(kombu.Connection(self.url))
        #: Set it (e.g. from a signal handler) to stop after the message in hand.
        self.stop = stop if stop is not None else threading.Event()
        #: The broker's outages; its downtime is what ``idle_timeout`` counts.
        self._broker = broker_outage()
        self._database = database_outage(using)
        self._new_run()

    def _new_run(self) -> None:
        """The state a run keeps between messages, as it starts."""
        self._attempt: float | None = None  # when the connection attempt under way began
        self._first_message_at: float | None = None
        self._last_message = 0.0  # monotonic time of the last message (or the start)
        self._held = _Held()
        self._idle = False  # idle for idle_timeout: done
        self._idle_timeout: float | None = None
        self._connection: kombu.Connection | None = None  # the one being set up or used

    def run(self, *, idle_timeout: float | None = None) -> ConsumerStats:  # type: ignore[override]
        """Consume until :attr:`stop` is set, or until no message came for
        ``idle_timeout`` seconds. Returns the totals (also in :attr:`stats`).

        Without ``idle_timeout`` an unreachable broker is waited for without end.
        With it, the time without a broker since the last message (or the start) is
        counted too: once it reaches ``idle_timeout``, :class:`BrokerUnreachable`
        is raised."""
        # Not ConsumerMixin.run(): it reconnects through Connection.ensure_connection,
        # with kombu's own intervals, deaf to the stop event and blind to the time
        # without a broker that idle_timeout counts. This loop backs off through the
        # broker's OutageTracker instead, and waits on the stop event.
        self._idle_timeout = idle_timeout
        started = self._last_message = time.monotonic()
        beating = self._heartbeat()
        beating.start()
        try:
            while not self.should_stop:
                try:
                    self.consume()
                except self._transient as exc:
                    # An outage begins when the connection attempt that failed began (or
                    # now, when a working connection failed); logged at its start only.
                    self._broker.failed(exc, since=self._attempt)
                    self._attempt = None
                    self._wait_for_broker(exc, idle_timeout)
        finally:
            self.stats.elapsed = time.monotonic() - started
            beating.stop()
        return self.stats

    def _heartbeat(self) -> HeartbeatThread:
        """This run's heartbeat: ``host:pid``, named ``consumer@queue``."""
        name = f"{self.consumer}@{self.queue}"
        beat = Heartbeat(WorkerKind.CONSUMER, process_name(), self.using, name=name)
        return HeartbeatThread(beat, self._snapshot)

    def _snapshot(self) -> tuple[dict[str, int], dt.datetime | None]:
        """The totals and the last message's time, for the heartbeat (told from the
        monotonic time of the last message, which the loop keeps anyway)."""
        counts = dataclasses.asdict(self.stats)
        last = None
        if self.stats.received:
            last = timezone.now() - dt.timedelta(seconds=time.monotonic() - self._last_message)
        return {k: v for k, v in counts.items() if isinstance(v, int)}, last

    @property
    def should_stop(self) -> bool:  # type: ignore[override]  # read by ConsumerMixin
        """Stop requested, or idle for ``idle_timeout`` with nothing held."""
        return self.stop.is_set() or self._idle

    def _wait_for_broker(self, exc: BaseException, idle_timeout: float | None) -> None:
        """Back off before the next attempt to reach the broker; give up (raise
        :class:`BrokerUnreachable`) once ``idle_timeout`` seconds went by without it."""
        without = self._broker.downtime()
        backoff = self._broker.backoff()
        if idle_timeout is not None:
            if without >= idle_timeout:
                raise BrokerUnreachable(
                    f"gave up after {idle_timeout:g}s without a broker: {mask_url(self.url)} "
                    f"unreachable ({outbox_settings.redact(f'{type(exc).__name__}: {exc}')})"
                )
            backoff = min(backoff, idle_timeout - without)
        self.stop.wait(backoff)

    # -- ConsumerMixin's hooks ------------------------------------------------------

    def consume(self, *args: Any, **kwargs: Any) -> None:
        """One connection's life: subscribe (ConsumerMixin's ``consumer_context``),
        handle messages until stopped or idle, then unsubscribe. A broker error raises
        one of the transient errors."""
        # Not ConsumerMixin.consume(): it drains with a fixed timeout, where a held
        # message must be requeued when its delay is over.
        with self.consumer_context(**kwargs) as (connection, _channel, _consumers):
            self._drain(connection)

    @contextlib.contextmanager
    def establish_connection(self) -> Iterator[kombu.Connection]:
        """A connection with bounded waits, made once: :meth:`run` retries (the
        mixin's own would retry through ``ensure_connection`` without end)."""
        connection = new_connection(self.url, self.transport_options)
        try:
            self._attempt = time.monotonic()
            connect(connection)
            # A reply the broker never sends (a silent network) fails the wait for it, so
            # neither subscribing, unsubscribing nor closing blocks a stopping consumer.
            bound_socket_waits(connection, CONNECT_TIMEOUT)
            self._connection = connection
            yield connection
            # Stopping (or idle), no longer subscribed: nothing held waits for its delay.
            self._held.requeue_all()
        finally:
            self._held.forget()  # on a lost connection the broker requeues them itself
            try:
                connection.release()
            except Exception:  # the connection is already broken; nothing to save
                logger.debug("error closing a broken broker connection", exc_info=True)

    def get_consumers(self, Consumer: Any, channel: Any) -> list[kombu.Consumer]:
        """The one consumer of the queue; a refusal to declare it (e.g. the queue exists
        with other arguments) raises DeclareRefused, an OutboxConfigurationError with
        the relay's wording: retrying cannot help."""
        assert self._connection is not None  # set by establish_connection()
        declared = declare(channel, self.route, refused=refusal_errors(self._connection))
        channel.Message = _uninflated(channel.Message)
        return [
            Consumer(
                queues=[queue],
                accept=["json"],
                on_message=functools.partial(self._on_message, queue.name),
                prefetch_count=self.prefetch,
                auto_declare=False,
            )
            for queue in declared
            if queue.name in self.queues
        ]

    def on_consume_ready(
        self, connection: Any, channel: Any, consumers: Any, **kwargs: Any
    ) -> None:
        """kombu's hook once consuming starts (again): the broker outage, if any, ends."""
        self._attempt = None
        self._broker.recovered()
        logger.info(
            "consuming %s as %r (prefetch %d)",
            ", ".join(self.queues),
            self.consumer,
            self.prefetch,
            extra={"action": "inbox.consuming", "queue": self.queue},
        )

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        """kombu could not even turn the frame into a message, or it was compressed
        (see :func:`_uninflated`)."""
        self._last_message = time.monotonic()
        self.stats.received += 1
        self._reject(message, exc)

    def _drain(self, connection: kombu.Connection) -> None:
        """Handle messages until stopped, or idle for ``idle_timeout`` with nothing held;
        requeue each held message when its delay is over. Idle time runs from the last
        message (or the start) over every connection: a broker whose connections drop
        now and then does not restart it."""
        while not self.should_stop:
            self._held.requeue_due()
            try:
                connection.drain_events(timeout=self._held.wait(DRAIN_TIMEOUT))
            except TimeoutError:
                connection.heartbeat_check()
                idle = time.monotonic() - self._last_message
                timeout = self._idle_timeout
                self._idle = timeout is not None and idle >= timeout and not self._held
                close_old_connections()  # honours CONN_MAX_AGE between idle spells

    # -- one message ----------------------------------------------------------------

    def _on_message(self, queue: str, message: Any) -> None:
        self._current = queue
        if self.stop.is_set():  # delivered while the consumer unsubscribes: not started
            message.requeue()
            return
        if self._first_message_at is None:
            self._first_message_at = time.monotonic()
        self._last_message = time.monotonic()
        self._broker.forget_downtime()
        try:
            self._handle(message)
        finally:
            self.stats.busy = time.monotonic() - self._first_message_at

    def _handle(self, message: Any) -> None:
        self.stats.received += 1
        try:
            event = _decode(message)
        except InvalidMessage as exc:
            self._reject(message, exc)
            return
        if self.keys is not None:
            # surrogatepass: a codec such as unicode_escape can decode a body to text
            # UTF-8 cannot hold; its signature fails instead of the encoding.
            body = _text(message).encode(CONTENT_ENCODING, "surrogatepass")
            problem = self.keys.problem(event.headers.get(SIGNATURE_HEADER), event.envelope(body))
            if problem is not None:
                self._refuse(message, event, lambda: problem, "inbox.unsigned")
                return
        if event.sequence is not None:
            self._handle_in_order(message, event)
            return
        if not self._handles(event):
            message.ack()
            self.stats.ignored += 1
            return
        counted = bool(message.delivery_info.get("redelivered"))
        if counted and not self._count_redelivery(message, event):
            return
        new = self._try(message, event, counted, functools.partial(self._once, event, counted))
        if new is None:
            return
        message.ack()
        self._uncounted.pop(_message_key(message), None)  # settled: never delivered again
        if new:
            self.stats.handled += 1
        else:
            self.stats.duplicates += 1

    def _handles(self, event: ReceivedEvent) -> bool:
        return self.event_types is None or handles(
            self.consumer, self.event_types, event.event_type, event.event_id
        )

    def _try(
        self, message: Any, event: ReceivedEvent, counted: bool, work: Callable[[], R]
    ) -> R | None:
        """``work()``'s result; None when it failed: then the message was held for a
        retry, parked, or (the database down) requeued."""
        try:
            with tracing.processing(self._current, event, self._span_attributes):
                result = work()
        except DatabaseError as exc:
            if self._database_unusable():
                self._database_down(message, event, exc)
            else:
                self._failed(message, event, exc, counted)
            return None
        except Exception as exc:
            self._failed(message, event, exc, counted)
            return None
        self._database.recovered()
        return result

    def _once(self, event: ReceivedEvent, counted: bool) -> bool:
        """Run the handler unless the inbox has the event; whether it ran."""
        with process_once(self.consumer, event.event_id, self.using) as new:
            if new:
                self.handler(event)
            if counted:
                forget_redelivery(self.consumer, event.event_id, self.using)
        return new

    # -- ordered events ---------------------------------------------------------------

    def _handle_in_order(self, message: Any, event: ReceivedEvent) -> None:
        """An event with a sequence: run in its key's turn, acked if handled already,
        held back while an earlier event of its key is not handled yet."""
        redelivered = bool(message.delivery_info.get("redelivered"))
        try:
            scope = sequence_scope(self.consumer, event)
            # A redelivery is counted before its handler runs, unless it is early or a
            # duplicate (no failure of its own): a look without the lock tells. A first
            # delivery goes straight to the locked check.
            turn = peek_turn(self.consumer, event, self.using) if redelivered else Turn.DUE
        except InvalidMessage as exc:
            self._reject(message, exc)
            return
        except DatabaseError as exc:
            self._database_down(message, event, exc)
            return
        counted = redelivered and turn is Turn.DUE
        if counted and not self._count_redelivery(message, event):
            return
        if turn is Turn.DUE:
            settled = self._try(
                message, event, counted, functools.partial(self._in_turn, event, counted)
            )
            if settled is None:
                return
            turn = settled
        self._settle_in_order(message, event, scope, turn)

    def _in_turn(self, event: ReceivedEvent, counted: bool) -> Turn:
        """Under the key's lock: run the handler if the event is (still) due."""
        with process_in_order(self.consumer, event, self.using) as turn:
            if turn is Turn.DUE:
                self._run_due(event)
                if counted:
                    forget_redelivery(self.consumer, event.event_id, self.using)
        return turn

    def _run_due(self, event: ReceivedEvent) -> None:
        """The handler, unless the event is a skip marker or of a type it does not
        handle: then the key just moves past its sequence."""
        if event.skipped:
            logger.warning(
                "%s: event %s (sequence %d of key %r) was skipped by an operator; "
                "the key moves past it without the handler",
                self.consumer,
                event.event_id,
                event.sequence,
                event.ordering_key,
                extra={
                    "action": "inbox.skip_marker",
                    "sequence": event.sequence,
                    **self._log_fields(event),
                },
            )
        elif self._handles(event):
            self.handler(event)

    def _settle_in_order(
        self, message: Any, event: ReceivedEvent, scope: Scope, turn: Turn
    ) -> None:
        if turn is Turn.EARLY:
            self._hold_back(message, event, scope)
            return
        if turn is Turn.CONFLICT:
            reason = functools.partial(conflict_reason, self.consumer, event, self.using)
            self._refuse(message, event, reason, "inbox.conflict")
            return
        message.ack()
        self._early.pop(event.event_id, None)
        if turn is Turn.DUPLICATE:
            self.stats.duplicates += 1
            return
        if event.skipped or (self.event_types and event.event_type not in self.event_types):
            self.stats.ignored += 1
        else:
            self.stats.handled += 1
        self._held.release(scope)  # its successors, held back, may be due now

    def _hold_back(self, message: Any, event: ReceivedEvent, scope: Scope) -> None:
        """Keep an event whose predecessor is not handled yet unacked for a while, then
        requeue it: at once when this consumer handles its predecessor, else after a
        backoff that doubles each time it comes back early. Not a failed delivery."""
        self.stats.held += 1
        times = self._early[event.event_id] = self._early.get(event.event_id, 0) + 1
        delay = max(self.retry.delay(times), EARLY_MIN_DELAY)
        # Every tenth time at WARNING: a key that waits this long needs a look.
        logger.log(
            logging.WARNING if times % EARLY_WARN_EVERY == 0 else logging.DEBUG,
            "%s: event %s (sequence %d of key %r) held back for %.1fs (time %d): an earlier "
            "event of its key is not handled yet (failing, parked, or not delivered here)",
            self.consumer,
            event.event_id,
            event.sequence,
            event.ordering_key,
            delay,
            times,
            extra={
                "action": "inbox.held_back",
                "sequence": event.sequence,
                "delay": delay,
                "times": times,
                **self._log_fields(event),
            },
        )
        self._held.hold(message, delay, scope)

    def _count_redelivery(self, message: Any, event: ReceivedEvent) -> bool:
        """Count a redelivered message before its handler runs (its last delivery may
        have killed a consumer). False when it was parked instead, or put back
        because the database is down: then the handler must not run."""
        try:
            deliveries, parked = record_redelivery(
                self.consumer,
                event,
                queue=self._current,
                body=_text(message),
                broker_deliveries=self._broker_count(message, event),
                park_after=self.max_deliveries,
                using=self.using,
            )
        except DatabaseError as exc:
            self._database_down(message, event, exc)
            return False
        if parked:
            self._park(message, event, deliveries, f"not run: {UNACKED_ERROR}")
        return not parked

    def _broker_count(self, message: Any, event: ReceivedEvent) -> int:
        """The broker's count of deliveries so far (a quorum queue's ``x-delivery-count``),
        less the requeues this consumer made while the database was down, which are no
        failed deliveries. 0 for an event of an ordered route: its held-back requeues
        count there too, so it is parked by the inbox's own count alone, which counts
        every redelivery in its key's turn before the handler runs.

        Read only where the broker writes it: on a quorum queue (the route's
        ``queue_type``; the consumer declares its queue with it, so the broker refuses
        a queue of another type), and on a redelivery, since a quorum queue leaves a
        publisher's own header in place on the first delivery. Anywhere else the
        header is the publisher's, and believing it would let anyone who can publish
        park an event after one failure."""
        if (
            event.sequence is not None
            or not self._broker_counts
            or not message.delivery_info.get("redelivered")
        ):
            return 0
        uncounted = self._uncounted.get(_message_key(message), 0)
        return max(_broker_deliveries(message.headers) - uncounted, 0)

    def _reject(self, message: Any, exc: Exception) -> None:
        self.stats.rejected += 1
        logger.error(
            "rejected a message from %s that is not an outbox event (%s: %s); "
            "the broker's dead-letter policy applies",
            self._current,
            type(exc).__name__,
            exc,
            extra={
                "action": "inbox.rejected",
                "queue": self._current,
                "message_id": message.properties.get("message_id"),
                "content_type": message.content_type,
            },
        )
        message.reject(requeue=False)

    def _failed(self, message: Any, event: ReceivedEvent, exc: Exception, counted: bool) -> None:
        error = outbox_settings.redact(f"{type(exc).__name__}: {exc}")  # shown by the admin
        try:
            deliveries, parked = record_failure(
                self.consumer,
                event,
                error=error,
                queue=self._current,
                body=_text(message),
                broker_deliveries=self._broker_count(message, event),
                park_after=self.max_deliveries,
                counted=counted,
                using=self.using,
            )
        except DatabaseError as db_exc:
            self._database_down(message, event, db_exc)
            return
        if parked:
            self._park(message, event, deliveries, error)
            return
        self.stats.failed += 1
        delay = self.retry.delay(deliveries)
        logger.warning(
            "%s: handler failed on event %s (delivery %d%s); requeued in %.1fs",
            self.consumer,
            event.event_id,
            deliveries,
            f" of {self.max_deliveries}" if self.max_deliveries else "",
            delay,
            exc_info=exc,
            extra={
                "action": "inbox.handler_failed",
                "deliveries": deliveries,
                "delay": delay,
                **self._log_fields(event),
            },
        )
        self._held.hold(message, delay)

    def _park(self, message: Any, event: ReceivedEvent, deliveries: int, error: str) -> None:
        self.stats.parked += 1
        logger.error(
            "%s: event %s failed %d deliveries and is parked (%s); see InboxFailure in the admin",
            self.consumer,
            event.event_id,
            deliveries,
            error,
            extra={"action": "inbox.parked", "deliveries": deliveries, **self._log_fields(event)},
        )
        message.reject(requeue=False)
        self._uncounted.pop(_message_key(message), None)

    def _refuse(
        self, message: Any, event: ReceivedEvent, reason: Callable[[], str], action: str
    ) -> None:
        """Park ``message`` without running the handler, for the one-line ``reason()``
        (a sequence conflict, a missing or wrong signature), and reject it."""
        try:
            error = reason()
            park_refused(
                self.consumer,
                event,
                error=error,
                queue=self._current,
                body=_text(message),
                using=self.using,
            )
        except DatabaseError as exc:
            self._database_down(message, event, exc)
            return
        self.stats.parked += 1
        self._early.pop(event.event_id, None)
        logger.error(
            "%s: event %s from %s is parked unrun: %s; see InboxFailure in the admin",
            self.consumer,
            event.event_id,
            self._current,
            error,
            extra={"action": action, **self._log_fields(event)},
        )
        message.reject(requeue=False)
        self._uncounted.pop(_message_key(message), None)

    def _log_fields(self, event: ReceivedEvent) -> dict[str, str]:
        return {"queue": self._current, "consumer": self.consumer, "event_id": str(event.event_id)}

    def _database_unusable(self) -> bool:
        connection = connections[self.using]
        return connection.connection is None or not connection.is_usable()

    def _database_down(self, message: Any, event: ReceivedEvent, exc: Exception) -> None:
        """The database is gone: the message goes back uncounted, and the consumer
        waits before taking the next one. (An ordered event's broker count is never
        read: see :meth:`_broker_count`.)"""
        message.requeue()
        if event.sequence is None:
            if len(self._uncounted) >= MAX_UNCOUNTED:
                self._uncounted.clear()  # an outage this long: the broker's count may park early
            self._uncounted[_message_key(message)] += 1
        self._database.failed(exc)
        connections[self.using].close()
        self.stop.wait(self._database.backoff())


class _Held:
    """Failed messages kept unacked until their backoff delay is over, soonest first.

    Each one occupies a prefetch slot meanwhile, so the consumer takes other
    messages while they wait; a message is requeued (to be delivered again,
    marked redelivered) when its time comes, or at once when the consumer stops.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any, Scope | None]] = []
        self._order = itertools.count()  # ties in due time: first held, first requeued

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, message: Any, delay: float, scope: Scope | None = None) -> None:
        """Hold ``message`` for ``delay`` seconds; an event held back for an earlier one
        of its key gives its ``scope``, which :meth:`release` requeues at once."""
        entry = (time.monotonic() + delay, next(self._order), message, scope)
        heapq.heappush(self._heap, entry)

    def release(self, scope: Scope) -> None:
        """Requeue now the messages held back for ``scope``, in the order they came."""
        due = sorted(entry for entry in self._heap if entry[3] == scope)
        if not due:
            return
        self._heap = [entry for entry in self._heap if entry[3] != scope]
        heapq.heapify(self._heap)
        for entry in sorted(due, key=lambda entry: entry[1]):
            entry[2].requeue()

    def wait(self, longest: float) -> float:
        """Seconds to wait for a message before the next held one is due, at most ``longest``."""
        if not self._heap:
            return longest
        return min(longest, max(self._heap[0][0] - time.monotonic(), 0.001))

    def requeue_due(self) -> None:
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            heapq.heappop(self._heap)[2].requeue()

    def requeue_all(self) -> None:
        while self._heap:
            heapq.heappop(self._heap)[2].requeue()

    def forget(self) -> None:
        self._heap.clear()


def _retry_policy(base: float, longest: float, max_deliveries: int | None) -> RetryPolicy:
    """The delays between a failing handler's deliveries (``max_deliveries`` of them)."""
    return RetryPolicy(
        base_delay=base, max_delay=longest, jitter=RETRY_JITTER, max_attempts=max_deliveries or 0
    )


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


@functools.cache
def _uninflated(message_class: type[kombu.Message]) -> type[kombu.Message]:
    """``message_class`` (a kombu transport's message), except that one whose headers ask
    for decompression is not inflated but refused as it is built, before the consumer
    sees it, through kombu's decode errors (:meth:`InboxConsumer.on_decode_error`).

    kombu inflates the body of any message with a ``compression`` header while it builds
    the message, before any callback and without a bound: 185 bytes of bzip2 become 200
    MB. The relay never compresses, and ``stage()`` refuses the header, so only a message
    from someone else has one. The headers are set just after ``errors`` and just before
    kombu reads ``compression``: recording an error there skips the inflating."""

    class Uninflated(message_class):  # type: ignore[misc,valid-type]
        @property
        def headers(self) -> dict[str, Any]:
            return self._outbox_headers

        @headers.setter
        def headers(self, value: dict[str, Any]) -> None:
            self._outbox_headers = value
            compression = value.get(COMPRESSION_HEADER) if value else None
            if compression and not self.errors:
                refused = InvalidMessage(
                    f"the message has a {COMPRESSION_HEADER} header "
                    f"({reprlib.repr(compression)}), and an outbox relay never compresses: "
                    "its body is not inflated"
                )
                self.errors.append((InvalidMessage, refused, None))

    Uninflated.__name__ = Uninflated.__qualname__ = f"Uninflated{message_class.__name__}"
    return Uninflated


def _decode(message: Any) -> ReceivedEvent:
    """The event in ``message``; :class:`InvalidMessage` if it is not an outbox event."""
    if message.content_type != CONTENT_TYPE:
        raise InvalidMessage(
            f"content type {message.content_type!r} is not {CONTENT_TYPE}: "
            "it was not published by an outbox relay"
        )
    return ReceivedEvent.from_wire(
        _json_body(message), message.headers, message.properties.get("message_id")
    )


def _json_body(message: Any) -> Any:
    """The body as plain JSON, exactly as the relay sent it. Not ``message.decode()``:
    kombu's JSON decoder turns an object with a ``__type__`` key into a datetime,
    Decimal or UUID, so a payload holding one would reach the handler changed."""
    try:
        return json.loads(_text(message))
    except (ValueError, LookupError) as exc:  # LookupError: an unknown content encoding
        raise InvalidMessage(f"the body is not JSON text: {exc}") from None


def _message_key(message: Any) -> Any:
    """What tells a message's deliveries apart from others': its message id (the relay
    makes it the event id), else its ``event_id`` header."""
    return message.properties.get("message_id") or (message.headers or {}).get("event_id")


def _broker_deliveries(headers: dict[str, Any] | None) -> int:
    """Deliveries so far by the broker's own count (RabbitMQ quorum queues' header
    ``x-delivery-count`` counts earlier deliveries), or 0 where it keeps none."""
    count = (headers or {}).get("x-delivery-count")
    return count + 1 if isinstance(count, int) and not isinstance(count, bool) else 0


def _text(message: Any) -> str:
    """The body as text, read by its content encoding (py-amqp hands it over decoded
    already, kombu's virtual transports as bytes)."""
    body = message.body
    return body if isinstance(body, str) else body.decode(message.content_encoding or "utf-8")
