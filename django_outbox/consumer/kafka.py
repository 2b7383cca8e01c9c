"""The Kafka consumer behind ``run_outbox_consumer --broker ALIAS`` of a ``kafka://`` broker.

:class:`KafkaRun` is one run of an :class:`~.loop.InboxConsumer` whose broker is a Kafka
cluster: a confluent-kafka consumer of the group named after the consumer, subscribed to
the topic (``--queue``), with ``enable.auto.commit`` off. Each record becomes a
:class:`KafkaRecord`, which answers the small message interface the kombu consumer's
pipeline uses (``ack``, ``reject``, ``requeue``, ``headers``, ``body`` ...), so a record
goes through the same :class:`~.handling.Handling` as a RabbitMQ message: decoding,
signatures, the inbox's dedupe, ordered turns, counted deliveries, parking. What those
verbs mean on a partitioned log:

* **ack** and **reject** (a record handled, a duplicate, ignored, parked, not an outbox
  event): its offset becomes committable; the next offset is committed (asynchronously
  after each record, synchronously when a partition is given up or the run ends). The
  handler's transaction, and the inbox mark in it, committed before.
* **hold** (a failed delivery for its backoff delay, an ordered event held back): the
  partition is sought back to the record and paused, so nothing after it on that
  partition is handled meanwhile (its keys keep their order) while other partitions flow;
  **requeue** when the delay is over resumes the partition, and the record comes again,
  marked redelivered.
* a partition's first record after it is assigned may have been in hand when its last
  owner died: it is marked redelivered too, so the inbox counts it before its handler
  runs (a record that kills every consumer is parked, as on RabbitMQ).

A partition is consumed one record at a time, in offset order, and rebalance callbacks
run only between records (inside ``poll``), so a partition given up (``on_revoke``) has
no record in hand: its committable offset is committed before it goes. A cluster that
cannot be reached is waited for (librdkafka reconnects; the run probes the topic's
metadata with the broker outage's backoff) and ``idle_timeout`` counts the time without
it, as the kombu run does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from django.db import close_old_connections

from ..conf import kafka_bootstrap, outbox_settings
from ..conf.redact import mask_url
from ..envelope import CONTENT_ENCODING, ORDERING_HEADERS, ReceivedEvent
from ..exceptions import BrokerUnreachable, OutboxConfigurationError
from ..inbox.records import Scope
from ..transports.connection import CONNECT_TIMEOUT
from ..transports.kafka import LIBRDKAFKA_LOG
from ..workers.outage import broker_outage
from .context import ConsumerStats, Context
from .held import Held
from .ordered import Ordered
from .outages import DatabaseOutage

if TYPE_CHECKING:
    from .handling import Handling
    from .loop import InboxConsumer

logger = logging.getLogger("django_outbox.consumer")

#: Consumer properties the run's guarantees rest on: OPTIONS cannot change them.
REQUIRED = {"enable.auto.commit": False, "enable.auto.offset.store": False}
#: Consumer properties OPTIONS may change: a topic read from its start by a new group,
#: and a consumer that died noticed by its group within 10 s (librdkafka's 45 s
#: otherwise), so its partitions go to the others (the idempotence of the inbox covers
#: a consumer taken for dead while it lives on).
DEFAULTS = {
    "auto.offset.reset": "earliest",
    "session.timeout.ms": 10000,
    "socket.connection.setup.timeout.ms": 5000,
}
#: How long one wait for a record lasts, so a stop request is seen promptly.
POLL_TIMEOUT = 1.0


def record_headers(pairs: Iterable[tuple[str, bytes | None]] | None) -> dict[str, Any]:
    """A record's headers as the relay wrote them (:func:`~django_outbox.transports.kafka.
    record_headers`): text, None for a null value; ``sequence`` and ``skipped``, which the
    relay writes as JSON, read back as numbers and booleans."""
    headers: dict[str, Any] = {}
    for name, raw in pairs or ():
        value = None if raw is None else raw.decode(CONTENT_ENCODING, "replace")
        if value is not None and name in ORDERING_HEADERS and name != "destination":
            try:
                value = json.loads(value)
            except ValueError:
                pass  # not the relay's: the envelope refuses it
        headers[name] = value
    return headers


class KafkaRecord:
    """One Kafka record as the consumer's pipeline reads a message. Its verbs go to the
    run's :class:`Partitions`, and do nothing once its partition was given up."""

    content_encoding = CONTENT_ENCODING

    def __init__(self, record: Any, partitions: Partitions, redelivered: bool) -> None:
        self.record, self._partitions = record, partitions
        self.partition, self.offset = record.partition(), record.offset()
        self.generation = partitions.generation.get(self.partition, 0)
        self.headers = record_headers(record.headers())
        self.content_type = self.headers.pop("content_type", None)
        self.body: bytes = record.value() or b""
        self.properties: dict[str, Any] = {}
        self.delivery_info = {"redelivered": redelivered}
        self.outbox_payload: str | None = None  # a CloudEvent's payload (see decode.text)

    def ack(self) -> None:
        self._partitions.settled(self)

    def reject(self, requeue: bool = False) -> None:
        if requeue:
            self.requeue()
        else:
            self._partitions.settled(self)

    def requeue(self) -> None:
        self._partitions.rewind(self, pause=False)

    def pause(self) -> None:
        self._partitions.rewind(self, pause=True)


class PausingHeld(Held):
    """:class:`~.held.Held` for records: holding one pauses its partition at it."""

    def hold(self, message: Any, delay: float, scope: Any = None) -> None:
        message.pause()
        super().hold(message, delay, scope)


class KafkaOrdered(Ordered):
    """An ordered route's events on Kafka. Nothing of a key comes before an earlier event
    of its key on its partition, so one whose predecessor is not handled can never become
    due there: that one was parked (or lost). Held back, it would stop its partition for
    good, the replayed predecessor waiting behind it; it is parked unrun instead, and
    ``outbox_replay_parked`` sends both back in their order."""

    def _hold_back(self, message: Any, event: ReceivedEvent, scope: Scope) -> None:
        def reason() -> str:
            return (
                f"an earlier event of key {event.ordering_key!r} than sequence "
                f"{event.sequence} is not handled (parked?): replay it, then this one"
            )

        self._parking.refuse(message, event, reason, "inbox.early_parked")


class Partitions:
    """The partitions of one consumer client: what each may commit, which are paused at a
    held record, and which records come again (redelivered)."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self.client: Any = None
        #: partition -> bumped each time it is assigned or given up: older records are stale.
        self.generation: dict[int, int] = {}
        self.due: dict[int, int] = {}  # partition -> the offset to commit (next to read)
        self.paused: set[int] = set()
        self.again: set[tuple[int, int]] = set()  # (partition, offset) rewound: redelivered

    def _tp(self, partition: int, offset: int = -1001) -> Any:
        from confluent_kafka import TopicPartition

        return TopicPartition(self.topic, partition, offset)

    def current(self, record: KafkaRecord) -> bool:
        return self.generation.get(record.partition) == record.generation

    def settled(self, record: KafkaRecord) -> None:
        """``record`` is done with: its partition may commit past it, now."""
        if not self.current(record):
            return
        self.due[record.partition] = record.offset + 1
        self._commit([record.partition], asynchronous=True)

    def rewind(self, record: KafkaRecord, *, pause: bool) -> None:
        """Read ``record``'s partition again from ``record`` (redelivered); paused until a
        :meth:`rewind` without ``pause``."""
        if not self.current(record):
            return
        partition = self._tp(record.partition, record.offset)
        self.again.add((record.partition, record.offset))
        if pause:
            self.client.pause([partition])
            self.paused.add(record.partition)
        self.client.seek(partition)
        if not pause and record.partition in self.paused:
            self.paused.discard(record.partition)
            self.client.resume([partition])

    def assigned(self, partitions: Iterable[Any]) -> None:
        for tp in partitions:
            self.generation[tp.partition] = self.generation.get(tp.partition, 0) + 1
            self.again.add((tp.partition, -1))  # its first record: maybe in hand before

    def redelivered(self, partition: int, offset: int) -> bool:
        """Whether the record at ``offset`` comes again (rewound, or the first one since
        its partition was assigned)."""
        first = (partition, -1) in self.again
        self.again.discard((partition, -1))
        if (partition, offset) in self.again:
            self.again.discard((partition, offset))
            return True
        return first

    def commit(self, partitions: Iterable[int] | None = None) -> None:
        """Commit what is due of ``partitions`` (all) and wait for the answer; a failure is
        logged (the records come again to the next owner, and the inbox skips them)."""
        self._commit(self.due if partitions is None else partitions, asynchronous=False)

    def _commit(self, partitions: Iterable[int], *, asynchronous: bool) -> None:
        from confluent_kafka import KafkaException

        offsets = [self._tp(p, self.due[p]) for p in partitions if p in self.due]
        if not offsets:
            return
        try:
            self.client.commit(offsets=offsets, asynchronous=asynchronous)
        except KafkaException as exc:
            logger.warning(
                "could not commit the offsets of topic %s (%s): their records come again, "
                "and the inbox skips those already handled",
                self.topic,
                outbox_settings.redact(str(exc.args[0])),
                extra={"action": "inbox.kafka_commit_failed", "queue": self.topic},
            )

    def give_up(self, partitions: Iterable[Any], *, commit: bool) -> None:
        """``partitions`` go to another consumer (``commit``: committed first) or are lost."""
        numbers = [tp.partition for tp in partitions]
        if commit:
            self.commit(numbers)
        for number in numbers:
            self.generation[number] = self.generation.get(number, 0) + 1
            self.due.pop(number, None)
            self.paused.discard(number)
        self.again = {entry for entry in self.again if entry[0] not in numbers}


class KafkaRun:
    """One run of an :class:`~.loop.InboxConsumer` on a Kafka topic: the consumer client,
    the state kept between records, and the parts that handle them."""

    def __init__(
        self,
        consumer: InboxConsumer,
        idle_timeout: float | None,
        handling: Callable[[Context, Held, DatabaseOutage, type[Ordered]], Handling],
        heartbeat: Callable[[Callable[[], float]], Any],
    ) -> None:
        self.consumer, self.idle_timeout = consumer, idle_timeout
        self.stats: ConsumerStats = consumer.stats
        self._broker = broker_outage()
        self._probe_at = 0.0  # monotonic time of the next probe of an unreachable cluster
        self._first_message_at: float | None = None
        self._last_message = 0.0
        self.partitions = Partitions(consumer.queue)
        self.context = Context(
            consumer.consumer, consumer.using, consumer.event_types, self.stats, consumer.queue
        )
        self.held = PausingHeld()
        self.outage = DatabaseOutage(consumer.using, consumer.stop)
        self.handling = handling(self.context, self.held, self.outage, KafkaOrdered)
        self._heartbeat = heartbeat(lambda: self._last_message)

    def config(self) -> dict[str, Any]:
        """The client's librdkafka properties: the broker's OPTIONS and the run's own."""
        consumer = self.consumer
        return {
            **DEFAULTS,
            **consumer.transport_options,
            **REQUIRED,
            "group.id": consumer.consumer,
            "bootstrap.servers": kafka_bootstrap(consumer.url),
            "error_cb": self._cluster_error,
            "logger": LIBRDKAFKA_LOG,
        }

    def run(self) -> ConsumerStats:
        """See :meth:`~.loop.InboxConsumer.run`."""
        started = self._last_message = time.monotonic()
        self._heartbeat.start()
        try:
            self._consume(self._client())
        finally:
            self.stats.elapsed = time.monotonic() - started
            self._heartbeat.stop()
        return self.stats

    def _client(self) -> Any:
        """A consumer client subscribed to the topic; OPTIONS librdkafka refuses raise
        :class:`OutboxConfigurationError`."""
        from confluent_kafka import Consumer, KafkaException

        try:
            client = Consumer(self.config())
        except (KafkaException, TypeError, ValueError) as exc:
            error = exc.args[0].str() if isinstance(exc, KafkaException) else exc
            raise OutboxConfigurationError(
                f"the OPTIONS of {mask_url(self.consumer.url)} cannot build a Kafka consumer: "
                f"{outbox_settings.redact(str(error))}"
            ) from None
        self.partitions.client = client
        client.subscribe(
            [self.consumer.queue],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        return client

    def _consume(self, client: Any) -> None:
        """Handle records until stopped or idle; then commit what is due and leave the
        group (the held records' offsets stay uncommitted: they come again)."""
        stop = self.consumer.stop
        self._probe(client)
        try:
            while not stop.is_set():
                self.held.requeue_due()
                record = client.poll(self.held.wait(POLL_TIMEOUT))
                if record is None:
                    if self._idle(client):
                        break
                    close_old_connections()  # honours CONN_MAX_AGE between idle spells
                elif record.error() is not None:
                    self._record_error(record.error())
                elif self.partitions.generation.get(record.partition()) is not None:
                    self._on_record(record)
        finally:
            self.held.forget()
            self.partitions.commit()
            client.close()

    def _on_record(self, raw: Any) -> None:
        partition = raw.partition()
        if partition in self.partitions.paused:
            return  # fetched before its partition was paused: it comes again
        redelivered = self.partitions.redelivered(partition, raw.offset())
        record = KafkaRecord(raw, self.partitions, redelivered)
        now = time.monotonic()
        if self._first_message_at is None:
            self._first_message_at = now
        self._last_message = now
        self._broker.recovered()
        self._broker.forget_downtime()
        try:
            self.handling.handle(record)
        finally:
            self.stats.busy = time.monotonic() - self._first_message_at

    def _idle(self, client: Any) -> bool:
        """Whether the run is done: idle for ``idle_timeout`` with nothing held and the
        cluster reachable. Probes an unreachable cluster when its backoff is over;
        :class:`BrokerUnreachable` once ``idle_timeout`` went by without it."""
        if self._broker.down and time.monotonic() >= self._probe_at:
            self._probe(client)
        timeout = self.idle_timeout
        if timeout is None:
            return False
        if self._broker.down and self._broker.downtime() >= timeout:
            raise BrokerUnreachable(
                f"gave up after {timeout:g}s without a broker: "
                f"{mask_url(self.consumer.url)} unreachable"
            )
        idle = time.monotonic() - self._last_message
        return idle >= timeout and not self.held and not self._broker.down

    def _probe(self, client: Any) -> None:
        """Ask the cluster for the topic's metadata: an outage ends or goes on."""
        from confluent_kafka import KafkaException

        try:
            client.list_topics(self.consumer.queue, timeout=CONNECT_TIMEOUT)
        except KafkaException as exc:
            self._broker.failed(_Unreachable(exc.args[0]))
            self._probe_at = time.monotonic() + self._broker.backoff()
            return
        self._broker.recovered()

    def _cluster_error(self, error: Any) -> None:
        """librdkafka's cluster-level trouble (it reconnects by itself): every broker
        down starts an outage, which the run probes with backoff until it ends."""
        from confluent_kafka import KafkaError

        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self._broker.failed(_Unreachable(error))
            self._probe_at = time.monotonic() + self._broker.backoff()

    def _record_error(self, error: Any) -> None:
        """An error the client hands over in place of a record (a missing topic ...)."""
        logger.warning(
            "%s: Kafka reports on topic %s: %s",
            self.consumer.consumer,
            self.consumer.queue,
            outbox_settings.redact(f"KafkaError {error.name()}: {error.str()}"),
            extra={"action": "inbox.kafka_error", "queue": self.consumer.queue},
        )

    # -- the group's rebalance callbacks, served inside poll(): no record is in hand ----

    def _on_assign(self, client: Any, partitions: list[Any]) -> None:
        self.partitions.assigned(partitions)
        logger.info(
            "consuming topic %s as group %r (partitions %s)",
            self.consumer.queue,
            self.consumer.consumer,
            ", ".join(str(tp.partition) for tp in partitions) or "none",
            extra={"action": "inbox.consuming", "queue": self.consumer.queue},
        )

    def _on_revoke(self, client: Any, partitions: list[Any]) -> None:
        self.partitions.give_up(partitions, commit=True)

    def _on_lost(self, client: Any, partitions: list[Any]) -> None:
        self.partitions.give_up(partitions, commit=False)


class _Unreachable(Exception):
    """A KafkaError as the broker outage logs it."""

    def __init__(self, error: Any) -> None:
        super().__init__(outbox_settings.redact(f"KafkaError {error.name()}: {error.str()}"))
