"""Apache Kafka (``kafka://host:port[,host:port...]``) through confluent-kafka's idempotent
producer (``acks=all``), partitioned as Kafka's Java client partitions (murmur2).

Each message becomes one record of its route's topic (:attr:`Route.topic_name`): key =
its ordering key (UTF-8; none without one), value = its body (the payload's JSON),
headers = its wire headers and ``content_type``. A message counts as published only
when its own delivery report says the cluster has it (every in-sync replica, with
``acks=all``). A publish has one deadline for all of it, the lease's confirm budget
(:func:`~.confirms.lease_confirm_timeout`, as RabbitMQ's confirms have), and
``message.timeout.ms`` is capped at that budget.

What a delivery report's error means for its row:

- the cluster unreachable, a timeout, too few in-sync replicas, a leader being elected,
  a fatal producer error: an outage (:meth:`Failure.broker_down`), no attempt counted;
  a fatal error is logged (ERROR), fails :meth:`~KafkaTransport.check` for
  :data:`FATAL_RETRY_DELAY`, and rebuilds the producer; the rows not acknowledged go again;
- a record the cluster refuses for itself (larger than the topic's ``max.message.bytes``,
  a topic this user may not write, an invalid topic name): that row fails alone,
  permanently, with the reason. A record refused as too large in a batch of several
  goes again alone within the same publish, and only a refusal of it alone is its own;
- anything else: a failure that counts an attempt, retried with backoff.

On an ordered route a batch goes in waves (each key's first record, then its second ...),
each wave once the one before is acknowledged, and a key whose record failed gets no more
records in that batch: nothing of a key reaches the topic after a failed record of it.

A missing topic is created with the route's ``partitions``, ``replication_factor`` and
``topic_config`` when it names any of them; otherwise its rows wait (no attempt) and
one ERROR per interval names the topic. So do the rows of a topic this user may not
describe, or whose creation got no answer; a topic deleted while the relay runs is
forgotten, and looked up again by the next publish.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from ..conf import CHECK_IDS, Broker, Problem, kafka_bootstrap, outbox_settings
from ..conf.redact import SecretFilter, mask_url
from ..conf.routes import Route
from ..envelope import ClaimedMessage
from ..exceptions import BrokerUnreachable, OutboxConfigurationError
from .base import MAX_ERROR_LENGTH, Failure, Outcome, Transport
from .confirms import lease_confirm_timeout
from .connection import CONNECT_TIMEOUT
from .kafka_transactions import Transactions, create_record_topic, default_transactional_id
from .writers import ENCODE_ERRORS, envelope_of

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))
#: librdkafka's own log lines (a broker refusing connections while the cluster is down,
#: retries), on a logger of their own that a project can quiet.
_librdkafka = logging.getLogger(f"{__name__}.librdkafka")
_librdkafka.addFilter(SecretFilter(outbox_settings.redact))
LIBRDKAFKA_LOG = logging.LoggerAdapter(_librdkafka, {"action": "outbox.librdkafka"})

#: Producer properties the relay's guarantees rest on: OPTIONS cannot change them.
REQUIRED = {
    "enable.idempotence": True,
    "acks": "all",
    "partitioner": "murmur2_random",  # Java's: JVM producers and consumers agree
    "allow.auto.create.topics": False,  # a missing topic is the route's to create
}
#: Producer properties OPTIONS may change.
DEFAULTS = {"linger.ms": 5, "socket.connection.setup.timeout.ms": 5000}
#: What a message's slot holds during a publish: False until its delivery report comes,
#: then None (delivered) or ``(KafkaError,)``; or a Failure decided before it was sent.
_Report = Failure | None | Literal[False] | tuple[Any]
#: A message as a record: its value, its key and its headers.
_Record = tuple[bytes, bytes | None, list[tuple[str, bytes | None]]]
#: On an ordered route, the outcome of a record not sent because one of its key before it
#: failed in the same batch (the relay sends it again after that one).
HELD_BACK = Failure.not_attempted("not attempted: an earlier event of its key failed", 0.0)
#: The outcome of a wave whose turn came after the publish's deadline (the lease's
#: confirm budget, :func:`~.confirms.lease_confirm_timeout`): due again at once.
LATE = Failure.not_attempted(
    "not attempted: the publish used its confirm budget (a third of LEASE_SECONDS, at most "
    "30 s) before this record's turn",
    0.0,
)
#: The error of a record with no delivery report by the publish's deadline: its
#: message.timeout.ms ends there too, and librdkafka may report the timeout a moment late.
NO_REPORT = (
    "no delivery report within the publish's confirm budget (a third of LEASE_SECONDS, at "
    "most 30 s; message.timeout.ms): brokers down, too few in-sync replicas, or a leader "
    "being elected"
)
#: Seconds after a fatal producer error during which :meth:`KafkaTransport.check` fails,
#: before a new producer is tried.
FATAL_RETRY_DELAY = 30.0
#: Seconds until the rows of a missing topic (or of a producer OPTIONS cannot build) are
#: due again, and between two ERRORs about it.
MISSING_TOPIC_RETRY_DELAY = 30.0


@functools.cache
def _codes() -> tuple[frozenset[int], frozenset[int]]:
    """(outage codes, refused codes) of librdkafka's errors."""
    from confluent_kafka import KafkaError as E

    outage = {
        *(E._MSG_TIMED_OUT, E._TIMED_OUT, E._TRANSPORT, E._ALL_BROKERS_DOWN, E._RESOLVE),
        *(E.NOT_ENOUGH_REPLICAS, E.NOT_ENOUGH_REPLICAS_AFTER_APPEND, E.REQUEST_TIMED_OUT),
        *(E.NETWORK_EXCEPTION, E.LEADER_NOT_AVAILABLE, E.NOT_LEADER_FOR_PARTITION),
        *(E.BROKER_NOT_AVAILABLE, E._PURGE_QUEUE, E._PURGE_INFLIGHT, E._FATAL),
        *(E.KAFKA_STORAGE_ERROR, E._UNKNOWN_PARTITION),
    }
    refused = {E.MSG_SIZE_TOO_LARGE, E.TOPIC_AUTHORIZATION_FAILED, E.TOPIC_EXCEPTION}
    refused |= {E.INVALID_RECORD, E.RECORD_LIST_TOO_LARGE, E._INVALID_ARG}
    return frozenset(outage), frozenset(refused)


def record_headers(headers: Mapping[str, Any], content_type: str) -> list[tuple[str, bytes | None]]:
    """Kafka record headers: text as UTF-8, None as a null value, others as JSON."""
    found: list[tuple[str, bytes | None]] = [("content_type", content_type.encode())]
    for name, value in headers.items():
        if value is None or isinstance(value, str):
            found.append((name, None if value is None else value.encode()))
        else:
            found.append((name, json.dumps(value).encode()))
    return found


def record_of(route: Route) -> Callable[[ClaimedMessage], _Record]:
    """A function giving a message of ``route`` as a record: its value, key and headers."""
    from .. import cloudevents

    envelope = envelope_of(route, binary=False)

    def record(message: ClaimedMessage) -> _Record:
        wire = cloudevents.wire(message, *envelope)
        key = message.ordering_key.encode() if message.ordering_key else None
        return wire.body, key, record_headers(wire.headers, wire.content_type)

    return record


def failure_of(error: Any) -> Failure:
    """The outcome of a delivery report's (or ``produce()``'s) KafkaError ``error``."""
    from confluent_kafka import KafkaError

    outage, refused = _codes()
    text = f"KafkaError {error.name()}: {error.str()}"
    code = error.code()
    if code == KafkaError._MSG_TIMED_OUT:
        text += (
            " (no acknowledgement from the in-sync replicas within message.timeout.ms: "
            "brokers down, too few in-sync replicas, or a leader being elected)"
        )
    if code in outage:
        return Failure.broker_down(text, kind="kafka_unavailable")
    if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
        return Failure.not_attempted(f"not attempted: {text} (the topic is gone?)", 0.0)
    if code in refused:
        text = outbox_settings.redact(text)[:MAX_ERROR_LENGTH]
        return Failure(text, permanent=True, kind="kafka_refused")
    return Failure(outbox_settings.redact(text)[:MAX_ERROR_LENGTH], kind="kafka_error")


def options_error(options: Mapping[str, Any]) -> str | None:
    """What librdkafka says of a producer built from ``options`` (an unknown property, a
    bad value, a missing ``ssl.*`` file), or None when it builds. Offline: the producer
    is given no broker to reach, and dropped at once."""
    from confluent_kafka import KafkaException, Producer

    quiet = logging.getLogger(f"{__name__}.check")
    quiet.propagate = False  # librdkafka warns of the missing bootstrap.servers
    try:
        Producer({**DEFAULTS, **options, **REQUIRED, "logger": quiet})
    except KafkaException as exc:
        return str(outbox_settings.redact(exc.args[0].str()))
    except (TypeError, ValueError) as exc:  # refused by the binding before librdkafka
        return str(outbox_settings.redact(f"{type(exc).__name__}: {exc}"))
    return None


class KafkaTransport(Transport):
    """One idempotent producer per relay (rebuilt after a fatal error or ``close()``),
    and an admin client for the topics' metadata and creation."""

    supports_confirms = True
    supports_batch = True

    def __init__(
        self, url: str, options: Mapping[str, Any] | None = None, *, alias: str | None = None
    ) -> None:
        self._url, self.alias = url, alias
        options = dict(options or {})
        #: The transactional producer's id (a transactional route's; docs/kafka.md).
        self.transactional_id = str(options.pop("transactional.id", default_transactional_id()))
        self.config: dict[str, Any] = {
            **DEFAULTS,
            **options,
            "message.timeout.ms": _message_timeout_ms(options or {}),
            **REQUIRED,
            "bootstrap.servers": kafka_bootstrap(url),
            "error_cb": self._cluster_error,
            "logger": LIBRDKAFKA_LOG,  # librdkafka's own log lines, redacted, not on stderr
        }
        self._producer: Any = None
        self._admin: Any = None
        self._topics: set[str] = set()  # topics known to exist
        self._logged: dict[str, float] = {}  # ERROR text -> when it may be logged again
        self._fatal_until, self._fatal_text = 0.0, ""  # check() fails until then (monotonic)
        #: A transactional route's producer (none is built without one).
        self._transactions = Transactions(self.config, self.transactional_id)

    def _fatal(self, error: Any) -> Failure:
        """A fatal producer error (an idempotent producer the cluster refuses, such as a
        user without the IdempotentWrite ACL): one ERROR with its reason, the producer
        dropped (the next publish builds another), :meth:`check` failing meanwhile."""
        text = f"KafkaError {error.name()}: {error.str()}"
        if self._fatal_until <= time.monotonic():
            logger.error(
                "the Kafka producer hit a fatal error (%s): a new one is built in %g s",
                text,
                FATAL_RETRY_DELAY,
                extra={"action": "outbox.kafka_fatal"},
            )
        self._fatal_until, self._fatal_text = time.monotonic() + FATAL_RETRY_DELAY, text
        self.close()
        return Failure.broker_down(f"fatal producer error: {text}", kind="kafka_unavailable")

    def _cluster_error(self, error: Any) -> None:
        """librdkafka's cluster-level trouble (brokers down): it retries by itself."""
        logger.debug("kafka: %s", error, extra={"action": "outbox.kafka_cluster_error"})

    @classmethod
    def problems(cls, broker: Broker) -> list[Problem]:
        """E062: ``OPTIONS`` librdkafka refuses, found by building a producer offline;
        E064, E065: OPTIONS a transactional route cannot work with."""
        found = _transaction_problems(broker)
        error = options_error(broker.options)
        if error is not None:
            found.append(
                Problem(
                    CHECK_IDS["kafka_options"],
                    f"{broker.options_setting} cannot build a Kafka producer: {error}",
                    "Fix or remove that property (librdkafka's CONFIGURATION.md lists them); "
                    "a file it names must exist where the relay runs.",
                )
            )
        return found

    def _client(self) -> Any:
        if self._producer is None:
            from confluent_kafka import KafkaException, Producer
            from confluent_kafka.admin import AdminClient

            try:
                self._producer = Producer(self.config)
            except KafkaException as exc:
                raise ProducerRefused(self.alias, exc.args[0].str()) from exc
            except (TypeError, ValueError) as exc:  # refused by the binding before librdkafka
                raise ProducerRefused(self.alias, f"{type(exc).__name__}: {exc}") from exc
            admin = {k: v for k, v in self.config.items() if k not in REQUIRED}
            admin = {k: v for k, v in admin.items() if k not in DEFAULTS}
            admin.pop("message.timeout.ms", None)
            admin["allow.auto.create.topics"] = False  # a look-up creates no topic
            admin["logger"] = LIBRDKAFKA_LOG
            self._admin = AdminClient(admin)
        return self._producer

    def target(self, route: Route) -> str:
        return f"topic {route.topic_name!r}"

    def check(self) -> None:
        """Read the cluster's metadata (any broker answering); :class:`BrokerUnreachable`
        naming the broker when none does."""
        try:
            if self._fatal_until > time.monotonic():
                raise RuntimeError(f"fatal producer error: {self._fatal_text}")
            self._client().list_topics(timeout=CONNECT_TIMEOUT)
        except Exception as exc:
            name = f"broker {self.alias!r} " if self.alias else ""
            raise BrokerUnreachable(
                f"{name}({mask_url(self._url)}): {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Drop the producer (the next publish builds another); its unsent records are
        left to time out unacknowledged."""
        self._producer = self._admin = None
        self._topics.clear()
        self._transactions.close()

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        from confluent_kafka import KafkaException

        topic, deadline = route.topic_name, time.monotonic() + lease_confirm_timeout()
        try:
            producer = self._client()
            missing = self._ensure_topic(route, topic, deadline)
        except KafkaException as exc:
            return [failure_of(exc.args[0])] * len(messages)
        except ProducerRefused as exc:  # the settings' fault: no row loses an attempt
            self._log_error(str(exc), extra={"action": "outbox.kafka_options_refused"})
            return [Failure.not_attempted(str(exc), MISSING_TOPIC_RETRY_DELAY)] * len(messages)
        if missing is not None:
            return [missing] * len(messages)
        if route.transactional:
            return self._publish_transaction(route, messages, deadline)
        wave = functools.partial(self._publish_wave, producer, route, topic, deadline)
        return _in_waves(wave, messages) if route.ordered else wave(messages)

    def recover(self) -> list[str]:
        """Start the transactional producer; the ids its record listed before this relay."""
        try:
            self._client()
        except ProducerRefused:  # said by every publish
            return []
        create = functools.partial(create_record_topic, self._admin)
        return self._transactions.recover(time.monotonic() + lease_confirm_timeout(), create)

    def settle(self, event_ids: Iterable[str], linger: float = 0.0) -> None:
        self._transactions.settle(event_ids, linger)

    def _publish_transaction(
        self, route: Route, messages: Sequence[ClaimedMessage], deadline: float
    ) -> list[Outcome]:
        """``messages`` in one Kafka transaction with this relay's record
        (:mod:`.kafka_transactions`); a record the log holds already is not sent again."""
        topic = route.topic_name

        def produce(producer: Any, batch: Sequence[ClaimedMessage]) -> list[_Report]:
            outcomes: list[_Report] = [False] * len(batch)
            self._produce(producer, route, topic, batch, outcomes, deadline)
            return outcomes

        create = functools.partial(create_record_topic, self._admin)
        return self._transactions.run(messages, deadline, create, produce, _settle)

    def _publish_wave(
        self,
        producer: Any,
        route: Route,
        topic: str,
        deadline: float,
        messages: Sequence[ClaimedMessage],
    ) -> list[Outcome]:
        """Produce ``messages`` and wait for their reports; their outcomes. librdkafka
        batches records without knowing the topic's ``max.message.bytes``: records refused
        as too large in a batch of several go again one at a time, so each is then
        published or refused for its own size."""
        from confluent_kafka import KafkaError

        if time.monotonic() >= deadline:
            return [LATE] * len(messages)
        outcomes: list[_Report] = [False] * len(messages)  # False: no report yet
        self._produce(producer, route, topic, messages, outcomes, deadline)
        fatal = _flush(producer, max(0.0, deadline - time.monotonic()))
        if fatal is not None:  # what it did not deliver (purged) goes again, by a new producer
            failure = self._fatal(fatal)
            outcomes = [failure if o is False or isinstance(o, tuple) else o for o in outcomes]
        settled = _settle(outcomes)
        for index, outcome in enumerate(outcomes):
            if len(messages) > 1 and _code(outcome) == KafkaError.MSG_SIZE_TOO_LARGE:
                alone = [messages[index]]
                (settled[index],) = self._publish_wave(producer, route, topic, deadline, alone)
        if any(outcome is not None and not outcome.counts for outcome in settled):
            self._topics.discard(topic)  # deleted meanwhile? the next publish looks again
        return settled

    def _produce(
        self,
        producer: Any,
        route: Route,
        topic: str,
        messages: Sequence[ClaimedMessage],
        outcomes: list[_Report],
        deadline: float,
    ) -> None:
        """Hand each message to the producer; its report fills ``outcomes``."""
        from confluent_kafka import KafkaException

        encode = self.encoder(route)
        for index, message in enumerate(messages):
            report = functools.partial(_delivered, outcomes, index)
            try:
                body, key, headers = self.encoded(route, message, encode)
                refused = _send(producer, deadline, topic, body, key, headers, report)
                if refused is not None:
                    outcomes[index] = refused
            except ENCODE_ERRORS as exc:
                outcomes[index] = Failure.from_exception(exc, permanent=True)
            except KafkaException as exc:  # refused before it left (too large for the client)
                outcomes[index] = failure_of(exc.args[0])

    def encoder(self, route: Route) -> Callable[[ClaimedMessage], _Record]:
        return record_of(route)

    def _ensure_topic(self, route: Route, topic: str, deadline: float) -> Failure | None:
        """None when ``topic`` exists (or its metadata says anything but that it is
        missing or refused: produce() reports that per record) or was just created; else
        the failure of its rows: for good when its name is invalid, else they wait (a
        missing topic, one this user may not see, a creation refused or unanswered: a
        configuration error, no attempt) and one ERROR per interval says why."""
        from confluent_kafka import KafkaError

        if topic in self._topics:
            return None
        found = self._producer.list_topics(topic, timeout=CONNECT_TIMEOUT).topics.get(topic)
        code = None if found is None or found.error is None else found.error.code()
        if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            text = (
                f"topic {topic!r} on {mask_url(self._url)}: this user may not describe it "
                "(TOPIC_AUTHORIZATION_FAILED): grant it Describe and Write on the topic (its "
                "rows wait, attempts unchanged)"
            )
        elif code in _codes()[1]:
            return failure_of(found.error)  # an invalid name: for good
        elif found is None or code == KafkaError.UNKNOWN_TOPIC_OR_PART:
            text = self._missing(route, topic, deadline)
        else:
            text = ""
        if not text:
            self._topics.add(topic)
            return None
        self._log_error(text, extra={"action": "outbox.kafka_missing_topic", "topic": topic})
        return Failure.not_attempted(text, MISSING_TOPIC_RETRY_DELAY)

    def _missing(self, route: Route, topic: str, deadline: float) -> str:
        """Why the rows of missing ``topic`` wait, or "" once it is created."""
        from confluent_kafka import KafkaException

        if not (route.partitions or route.replication_factor or route.topic_config):
            return (
                f"topic {topic!r} does not exist on {mask_url(self._url)}: create it, or give "
                f"route {route.destination!r} partitions (replication_factor, topic_config) to "
                "have it created (its rows wait, attempts unchanged)"
            )
        timeout = max(0.0, min(CONNECT_TIMEOUT * 2, deadline - time.monotonic()))
        try:
            self._create(route, topic, timeout)
        except KafkaException as exc:
            error = exc.args[0]
            if failure_of(error).outage:
                raise  # the cluster, not the topic: an outage
            return f"creating topic {topic!r} failed: KafkaError {error.name()}: {error.str()}"
        except TimeoutError:  # concurrent.futures': the cluster may create it yet
            return (
                f"creating topic {topic!r} got no answer within {timeout:g} s (its rows wait, "
                "attempts unchanged)"
            )
        return ""

    def _log_error(self, text: str, *, extra: dict[str, str]) -> None:
        """One ERROR per text and retry interval, however many batches it fails."""
        now = time.monotonic()
        if self._logged.get(text, 0.0) <= now:
            self._logged[text] = now + MISSING_TOPIC_RETRY_DELAY
            logger.error(text, extra=extra)

    def _create(self, route: Route, topic: str, timeout: float) -> None:
        """Create ``topic`` as ``route`` says (a topic created meanwhile is fine)."""
        from confluent_kafka import KafkaError, KafkaException
        from confluent_kafka.admin import NewTopic

        new = NewTopic(
            topic,
            num_partitions=route.partitions or -1,
            replication_factor=route.replication_factor or -1,
            config={name: str(value) for name, value in route.topic_config},
        )
        try:
            self._admin.create_topics([new])[topic].result(timeout=timeout)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
        logger.info(
            "created topic %r",
            topic,
            extra={"action": "outbox.kafka_topic_created", "topic": topic},
        )


def _transaction_problems(broker: Broker) -> list[Problem]:
    """E064: a ``transactional.id`` that is no text; E065: a ``transaction.timeout.ms``
    longer than a publish may take (a zombie's transaction could commit after its rows'
    lease ran out and another relay sent them)."""
    found = []
    options, setting = broker.options, broker.options_setting
    given = options.get("transactional.id")
    if given is not None and (not isinstance(given, str) or not given.strip()):
        found.append(
            Problem(
                CHECK_IDS["kafka_transactional_id"],
                f'{setting}["transactional.id"] must be a non-empty string; got {given!r}',
                "Give each relay process its own id (e.g. from an environment variable), or "
                "drop it for django-outbox-<host name> (docs/kafka.md#exactly-once).",
            )
        )
    budget = int(lease_confirm_timeout() * 1000)
    timeout = options.get("transaction.timeout.ms")
    if timeout is not None and (not isinstance(timeout, int) or timeout > budget):
        found.append(
            Problem(
                CHECK_IDS["kafka_transaction_timeout"],
                f'{setting}["transaction.timeout.ms"] must be an int of at most {budget} (the '
                f"publish's confirm budget: a third of LEASE_SECONDS, at most 30 s); got "
                f"{timeout!r}",
                "Drop it (it defaults to that budget) or raise LEASE_SECONDS: a zombie "
                "relay's transaction must end before its rows' lease does.",
            )
        )
    return found


class ProducerRefused(OutboxConfigurationError):
    """librdkafka cannot build a producer from the broker's ``OPTIONS``."""

    def __init__(self, alias: str | None, error: str) -> None:
        setting = f'OUTBOX["BROKERS"][{alias!r}]["OPTIONS"]' if alias else "the broker's OPTIONS"
        error = outbox_settings.redact(error)
        super().__init__(
            f"{setting} cannot build a Kafka producer: {error} (its rows wait, attempts "
            "unchanged; manage.py check reports it as django_outbox.E062)"
        )


def _send(
    producer: Any, deadline: float, topic: str, body: bytes, key: Any, headers: list, report: Any
) -> Failure | None:
    """``produce()``, serving reports while librdkafka's queue is full, until ``deadline``
    (then :data:`LATE`); a record the empty queue cannot take fails for good."""
    while True:
        try:
            producer.produce(topic, body, key, headers=headers, on_delivery=report)
            return None
        except BufferError:
            if len(producer) == 0:
                return Failure(
                    f"a record of {len(body)} bytes is larger than the producer's whole queue "
                    "(OPTIONS' queue.buffering.max.kbytes)",
                    permanent=True,
                    kind="kafka_refused",
                )
            if time.monotonic() >= deadline:
                return LATE
            producer.poll(0.1)


def _flush(producer: Any, timeout: float) -> Any:
    """``flush()``; the fatal KafkaError it raises, or None. confluent-kafka raises a
    fatal error from the next flush (error_cb never sees it); when a delivery report is
    served in the same call, the binding turns it into a SystemError caused by it."""
    from confluent_kafka import KafkaException

    try:
        producer.flush(timeout)
    except KafkaException as exc:
        return exc.args[0]
    except SystemError as exc:
        if not isinstance(exc.__cause__, KafkaException):
            raise
        return exc.__cause__.args[0]
    return None


def _settle(outcomes: list[_Report]) -> list[Outcome]:
    """The outcomes, once reported: a message with no report in time is an outage (it
    may still arrive: it goes again, at least once)."""
    settled: list[Outcome] = []
    for outcome in outcomes:
        if outcome is False:
            outcome = Failure.broker_down(NO_REPORT, kind="kafka_unavailable")
        elif isinstance(outcome, tuple):  # (KafkaError,) from the report
            outcome = failure_of(outcome[0])
        settled.append(outcome)
    return settled


def _code(report: _Report) -> int | None:
    """The error code of a delivery report's KafkaError (None for any other outcome)."""
    return report[0].code() if isinstance(report, tuple) else None


def _message_timeout_ms(options: Mapping[str, Any]) -> Any:
    """``message.timeout.ms``: the lease's confirm budget, or OPTIONS' value capped at it
    (a record must not outlive the lease of its row)."""
    budget = int(lease_confirm_timeout() * 1000)
    given = options.get("message.timeout.ms", budget)
    try:
        return min(int(given), budget)
    except (TypeError, ValueError):
        return given  # librdkafka refuses it: ProducerRefused quotes its reason


def _in_waves(
    publish: Callable[[Sequence[ClaimedMessage]], list[Outcome]],
    messages: Sequence[ClaimedMessage],
) -> list[Outcome]:
    """Ordered: a key's n-th record goes only once its (n-1)-th is acknowledged, so no
    record of a key is ever written after one of its key that failed."""
    outcomes: list[Outcome] = [HELD_BACK] * len(messages)
    failed: set[str] = set()
    for wave in _waves(messages):
        todo = [i for i in wave if messages[i].ordering_key not in failed]
        settled = publish([messages[i] for i in todo])
        for index, outcome in zip(todo, settled, strict=True):
            outcomes[index] = outcome
            if outcome is not None:
                failed.add(messages[index].ordering_key)
    return outcomes


def _waves(messages: Sequence[ClaimedMessage]) -> list[list[int]]:
    """The indices of ``messages`` in waves: the first of each key's, then the second ...;
    every message without a key (or a sequence) in the first: none waits for another."""
    waves: list[list[int]] = []
    seen: collections.Counter[str] = collections.Counter()
    for index, message in enumerate(messages):
        independent = not message.ordering_key or message.sequence is None
        place = 0 if independent else seen[message.ordering_key]
        seen[message.ordering_key] += not independent
        if place == len(waves):
            waves.append([])
        waves[place].append(index)
    return waves


def _delivered(outcomes: list[_Report], index: int, error: Any, record: Any) -> None:
    """A delivery report: None (the cluster has it) or ``(error,)``, settled later."""
    outcomes[index] = None if error is None else (error,)
