"""Exactly once into the topic: a Kafka route with ``"transactional": True``.

Each batch of such a route goes in one Kafka transaction of a transactional producer,
which also writes, to the compacted topic :data:`RECORD_TOPIC`, a record keyed by its
transactional id whose value lists the event ids it committed that their relay has not
yet seen marked PUBLISHED (as Kafka Connect's exactly-once sources keep their offsets
in the same transaction as their records). So the log says which events it holds even
when a relay dies between a commit and its database mark:

- before each batch the relay reads :data:`RECORD_TOPIC` to its end (``read_committed``:
  what committed transactions wrote) and does not send again an event that the latest
  record of any transactional id lists: it reports it published;
- a relay starting with the transactional id of one before it (the same process
  restarted) inherits that one's record (its next records keep listing those ids) and
  hands the ids to the relay, which marks their rows PUBLISHED before its first claim;
- ``init_transactions()`` bumps the transactional id's epoch: a zombie with the same id
  (paused, cut off) cannot commit any more, and its open transaction is aborted, so
  ``read_committed`` readers never see it. A fenced relay publishes no transactional
  batch again (another process has its id) until it is restarted.

The transactional id is ``OPTIONS["transactional.id"]`` when the broker's OPTIONS give
one (each relay process its own), else :func:`default_transactional_id`. See
docs/kafka.md#exactly-once for what this guarantees and what it does not.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..conf import outbox_settings
from ..conf.redact import SecretFilter
from ..envelope import ClaimedMessage
from .base import Failure, Outcome
from .connection import CONNECT_TIMEOUT

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))

#: The compacted topic of the transactions' records (one partition; created when missing).
RECORD_TOPIC = "django-outbox-transactions"
#: Its configuration: compacted (the latest record of each transactional id is what counts),
#: in segments small enough that compaction keeps a start's read short (a record per batch).
RECORD_TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.bytes": str(16 * 2**20)}
#: The error of a batch not sent because this relay's transactional id was fenced.
FENCED = (
    "not attempted: this relay's Kafka producer was fenced: another relay started with its "
    "transactional.id {tid!r} (this one is a zombie, or two relays share the id: give each "
    "its own OPTIONS['transactional.id']); restart it to publish transactional routes again"
)
#: Seconds until the rows of a fenced relay are due again (for the relay that has its id).
FENCED_RETRY_DELAY = 30.0
#: The error of every record of a transaction aborted because another of them failed.
ABORTED = "not attempted: the batch's Kafka transaction was aborted: {reason}"


def default_transactional_id() -> str:
    """``django-outbox-<host name>``: the same for a relay restarted on its host (it fences
    its own zombie), so several relays on one host each need OPTIONS' own."""
    return f"django-outbox-{socket.gethostname()}"


class TransactionLog:
    """The latest record of every transactional id in :data:`RECORD_TOPIC`, read with a
    ``read_committed`` consumer that keeps its place between reads. Every partition of
    the topic is read: the relay creates it with one, but a topic made by hand or by a
    broker's ``auto.create.topics.enable`` may have more, and a transactional id's record
    is in the partition its key hashes to."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        from confluent_kafka import Consumer

        self._consumer = Consumer(
            {
                **config,
                "group.id": "django-outbox-transaction-log",  # never joined, never committed
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 10,  # a read to the end waits for no more records
                "enable.partition.eof": True,  # the end (of what committed) is told
            }
        )
        self.latest: dict[str, frozenset[str]] = {}
        self.in_log: set[str] = set()
        #: Where each transactional id's latest record is: (partition, timestamp).
        self._where: dict[str, tuple[int, int]] = {}
        self._ends: dict[int, int] = {}  # per assigned partition, the end last reached

    def read_to_end(self, deadline: float) -> None:
        """Consume every committed record of every partition up to its end as of now;
        TimeoutError when ``deadline`` (monotonic) passes first."""
        from confluent_kafka import KafkaError, KafkaException

        ends = self._high_watermarks(deadline)
        while any(self._position(p) < end for p, end in ends.items()):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"reading {RECORD_TOPIC!r} to its end took too long")
            message = self._consumer.poll(min(0.05, _left(deadline)))
            if message is None:
                continue
            error = message.error()
            if error is None:
                self._learn(message)
            elif error.code() == KafkaError._PARTITION_EOF:
                partition = message.partition() or 0  # an EOF names its partition
                self._ends[partition] = max(self._ends[partition], message.offset() or 0)
            else:
                raise KafkaException(error)

    def _high_watermarks(self, deadline: float) -> dict[int, int]:
        """Each partition's high watermark, partitions new to this reader assigned from
        their start."""
        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        topics = self._consumer.list_topics(RECORD_TOPIC, timeout=_left(deadline)).topics
        found = topics.get(RECORD_TOPIC)
        if found is None or found.error is not None:  # an outage: rows wait
            raise KafkaException(found.error if found else KafkaError(KafkaError._UNKNOWN_TOPIC))
        new = [TopicPartition(RECORD_TOPIC, p, 0) for p in found.partitions if p not in self._ends]
        if new:
            self._consumer.incremental_assign(new)
            self._ends.update(dict.fromkeys((tp.partition for tp in new), 0))
        return {
            p: self._consumer.get_watermark_offsets(
                TopicPartition(RECORD_TOPIC, p), timeout=_left(deadline), cached=False
            )[1]
            for p in self._ends
        }

    def _position(self, partition: int) -> int:
        """Where the next read of ``partition`` starts: past its last record, or the end
        last reached (the markers of committed transactions after the last record are no
        records)."""
        from confluent_kafka import TopicPartition

        (found,) = self._consumer.position([TopicPartition(RECORD_TOPIC, partition)])
        return max(int(found.offset), self._ends[partition])

    def _learn(self, message: Any) -> None:
        """Take ``message`` as its transactional id's latest record unless a later one is
        known: in one partition the later offset is; across partitions (the topic's
        partitions were added to), the later timestamp."""
        key, value, partition = message.key(), message.value(), message.partition()
        if key is None:
            return
        tid, stamp = key.decode(), message.timestamp()[1]
        known = self._where.get(tid)
        if known is not None and known[0] != partition and known[1] > stamp:
            return
        self._where[tid] = (partition, stamp)
        self.latest[tid] = frozenset(json.loads(value)["event_ids"]) if value else frozenset()
        self.in_log = set().union(*self.latest.values())

    def close(self) -> None:
        self._consumer.close()


def _shortest(first: Any, second: Any) -> Any:
    """The shorter of two librdkafka durations (ms); ``first`` when either is no number
    (librdkafka then refuses to build the producer, and says why: E062)."""
    try:
        return min(int(first), int(second))
    except (TypeError, ValueError):
        return first


def _left(deadline: float) -> float:
    return max(0.05, deadline - time.monotonic())


class Transactions:
    """One relay's transactional producer and its record. ``settle`` may be called from
    the relay's finalize thread; everything else from the publishing thread."""

    def __init__(self, config: Mapping[str, Any], transactional_id: str) -> None:
        self.transactional_id = transactional_id
        #: A transaction outlives no publish: a zombie's is aborted by the coordinator.
        timeout = config.get("transaction.timeout.ms", config["message.timeout.ms"])
        self._config = {
            **config,
            "transactional.id": transactional_id,
            "transaction.timeout.ms": timeout,
            # librdkafka refuses a record that may outlive its transaction
            "message.timeout.ms": _shortest(config["message.timeout.ms"], timeout),
        }
        self._log_config = {
            k: v
            for k, v in config.items()
            if k in ("bootstrap.servers", "logger") or k.startswith(("security.", "sasl.", "ssl."))
        }
        self._producer: Any = None
        self._log: TransactionLog | None = None
        self._lock = threading.Lock()
        #: Event ids this producer committed that the relay has not marked PUBLISHED, with
        #: when they may leave the record (monotonic; inf: not yet marked).
        self._unsettled: dict[str, float] = {}
        self._recovered: list[str] = []  # inherited ids the relay has not been given yet
        self.fenced = False

    def start(self, deadline: float, create_log: Callable[[], None]) -> None:
        """Once: fence this id's zombies (``init_transactions``), read the record topic
        and inherit this id's record. Raises KafkaException or TimeoutError (the
        cluster's trouble): the next publish starts again."""
        if self._producer is not None:
            return
        from confluent_kafka import Producer

        create_log()
        producer = Producer(self._config)
        producer.init_transactions(_left(deadline))
        log = self._log or TransactionLog(self._log_config)
        self._log = log
        log.read_to_end(deadline)
        inherited = log.latest.get(self.transactional_id, frozenset())
        with self._lock:
            for event_id in inherited:
                self._unsettled.setdefault(event_id, float("inf"))
        self._recovered = sorted(inherited)
        self._producer = producer

    def recover(self, deadline: float, create_log: Callable[[], None]) -> list[str]:
        """:meth:`start`, then the event ids inherited from this id's record, once (the
        cluster's errors are left to the next publish, which starts it again)."""
        from confluent_kafka import KafkaException

        try:
            self.start(deadline, create_log)
        except (KafkaException, TimeoutError) as exc:
            logger.warning(
                "the Kafka transactions' record could not be read at start (%s): the first "
                "publish of a transactional route reads it",
                exc,
                extra={"action": "outbox.kafka_recover_failed"},
            )
            return []
        found, self._recovered = self._recovered, []
        return found

    def settle(self, event_ids: Iterable[str], linger: float = 0.0) -> None:
        """The rows of ``event_ids`` are marked PUBLISHED: they leave the record after
        ``linger`` seconds (a relay that claimed one before it was marked reads the
        record within its lease)."""
        until = time.monotonic() + linger
        with self._lock:
            for event_id in event_ids:
                if event_id in self._unsettled:
                    self._unsettled[event_id] = until

    def _record(self, batch: Sequence[str]) -> bytes:
        now = time.monotonic()
        with self._lock:
            for event_id in [e for e, until in self._unsettled.items() if until <= now]:
                del self._unsettled[event_id]
            listed = sorted({*self._unsettled, *batch})
        return json.dumps({"event_ids": listed}).encode()

    def run(
        self,
        messages: Sequence[ClaimedMessage],
        deadline: float,
        create_log: Callable[[], None],
        produce: Callable[[Any, Sequence[ClaimedMessage]], list[Any]],
        settle: Callable[[list[Any]], list[Outcome]],
    ) -> list[Outcome]:
        """Start if need be, then :meth:`publish`; the cluster's errors become outcomes."""
        from confluent_kafka import KafkaException

        if self.fenced:
            fenced = FENCED.format(tid=self.transactional_id)
            return [Failure.not_attempted(fenced, FENCED_RETRY_DELAY)] * len(messages)
        try:
            self.start(deadline, create_log)
            return self.publish(messages, deadline, produce, settle)
        except KafkaException as exc:
            return [self._failed(exc.args[0])] * len(messages)
        except TimeoutError as exc:
            self.close()
            failure = Failure.broker_down(f"Kafka transaction: {exc}", kind="kafka_unavailable")
            return [failure] * len(messages)

    def _failed(self, error: Any) -> Failure:
        """The outcome of a batch whose transaction raised ``error``: fenced (for good),
        or an outage (a new producer resolves the transaction: the next publish reads the
        record to learn whether it committed)."""
        from confluent_kafka import KafkaError

        if error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED):
            self.fenced = True
            text = FENCED.format(tid=self.transactional_id)
            logger.error(text, extra={"action": "outbox.kafka_fenced"})
            return Failure.not_attempted(text, FENCED_RETRY_DELAY)
        self.close()
        return Failure.broker_down(
            f"Kafka transaction failed: KafkaError {error.name()}: {error.str()}",
            kind="kafka_unavailable",
        )

    def publish(
        self,
        messages: Sequence[ClaimedMessage],
        deadline: float,
        produce: Callable[[Any, Sequence[ClaimedMessage]], list[Any]],
        settle: Callable[[list[Any]], list[Outcome]],
    ) -> list[Outcome]:
        """Publish ``messages`` in one transaction with this producer's record: those the
        log holds already are reported published unsent. ``produce(producer, messages)``
        hands them to the producer (their reports in the list it returns); ``settle``
        turns the reports into outcomes."""
        assert self._log is not None and self._producer is not None
        self._log.read_to_end(deadline)
        outcomes: list[Outcome] = [None] * len(messages)
        todo = [i for i, m in enumerate(messages) if str(m.event_id) not in self._log.in_log]
        if not todo:
            return outcomes
        batch = [str(messages[i].event_id) for i in todo]
        sent = self._transaction([messages[i] for i in todo], batch, deadline, produce, settle)
        for index, outcome in zip(todo, sent, strict=True):
            outcomes[index] = outcome
        return outcomes

    def _transaction(
        self,
        messages: Sequence[ClaimedMessage],
        batch: list[str],
        deadline: float,
        produce: Callable[[Any, Sequence[ClaimedMessage]], list[Any]],
        settle: Callable[[list[Any]], list[Outcome]],
    ) -> list[Outcome]:
        """Begin, produce, write the record, flush, then commit (or abort when a record
        failed or the deadline passed)."""
        producer = self._producer
        producer.begin_transaction()
        reports = produce(producer, messages)
        producer.produce(RECORD_TOPIC, self._record(batch), self.transactional_id.encode())
        producer.flush(_left(deadline))
        outcomes = settle(reports)
        failed = [o for o in outcomes if o is not None]
        if failed or time.monotonic() >= deadline:
            reason = failed[0].error if failed else "the publish's confirm budget ran out"
            self._abort(deadline)
            return [_aborted(outcome, reason) for outcome in outcomes]
        commit_transaction(producer, _left(deadline))
        with self._lock:
            self._unsettled.update(dict.fromkeys(batch, float("inf")))
        return outcomes

    def _abort(self, deadline: float) -> None:
        self._producer.abort_transaction(_left(deadline))

    def close(self) -> None:
        """Drop the producer (the next publish starts again: ``init_transactions``)."""
        self._producer = None


def create_record_topic(admin: Any) -> None:
    """Create :data:`RECORD_TOPIC` (compacted, one partition) unless it exists."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import NewTopic

    found = admin.list_topics(RECORD_TOPIC, timeout=CONNECT_TIMEOUT).topics.get(RECORD_TOPIC)
    if found is not None and found.error is None:
        return
    new = NewTopic(RECORD_TOPIC, num_partitions=1, config=RECORD_TOPIC_CONFIG)
    try:
        admin.create_topics([new])[RECORD_TOPIC].result(timeout=CONNECT_TIMEOUT * 2)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise


def commit_transaction(producer: Any, timeout: float) -> None:
    """``producer.commit_transaction(timeout)``: a function of its own, the moment between
    the commit and the relay's database mark (tests aim a SIGKILL there)."""
    producer.commit_transaction(timeout)


def _aborted(outcome: Outcome, reason: str) -> Failure:
    """The outcome of a record in an aborted transaction: its own failure (a refusal is
    its own), or, when it was fine, due again at once, no attempt counted."""
    if outcome is not None:
        return outcome
    return Failure.not_attempted(ABORTED.format(reason=reason), 0.0)
