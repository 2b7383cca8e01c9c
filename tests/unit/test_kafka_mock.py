"""The Kafka transport's outcomes against librdkafka's in-process mock cluster: three mock
brokers on loopback ports, driven through the mock API the bundled librdkafka exports (the
Python binding has no class for it, so ctypes calls it; the API is experimental, hence
the skip when a symbol is missing). Fast checks of the error mapping only: the mock is no
broker (the proof is tests/integration/test_kafka.py's, on a real cluster)."""

from __future__ import annotations

import ctypes
import dataclasses
import datetime as dt
import glob
import json
import os
import re
import uuid
from collections.abc import Iterator

import confluent_kafka
import pytest
from confluent_kafka import Consumer, TopicPartition
from django.test.utils import override_settings

from django_outbox.conf.routes import Route
from django_outbox.envelope import ClaimedMessage
from django_outbox.exceptions import BrokerUnreachable
from django_outbox.transports.kafka import KafkaTransport, record_of

PRODUCE, CREATE_TOPICS, INIT_PRODUCER_ID = 0, 19, 22  # Kafka's api keys of requests
MSG_SIZE_TOO_LARGE, NOT_ENOUGH_REPLICAS, TOPIC_AUTHORIZATION_FAILED = 10, 19, 29
CLUSTER_AUTHORIZATION_FAILED = 31


class MockCluster:
    """A mock cluster of three brokers, and the calls the tests make to it."""

    def __init__(self) -> None:
        folder = os.path.join(os.path.dirname(confluent_kafka.__file__), "..")
        found = glob.glob(os.path.join(folder, "confluent_kafka.libs", "librdkafka*.so*"))
        if not found or not hasattr(lib := ctypes.CDLL(found[0]), "rd_kafka_mock_cluster_new"):
            pytest.skip("this confluent-kafka wheel bundles no librdkafka with the mock API")
        lib.rd_kafka_conf_new.restype = ctypes.c_void_p
        lib.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, *[ctypes.c_char_p] * 3, ctypes.c_size_t]
        lib.rd_kafka_new.restype = ctypes.c_void_p
        lib.rd_kafka_new.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.rd_kafka_destroy.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_mock_cluster_new.restype = ctypes.c_void_p
        lib.rd_kafka_mock_cluster_new.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.rd_kafka_mock_cluster_destroy.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_mock_cluster_bootstraps.restype = ctypes.c_char_p
        lib.rd_kafka_mock_cluster_bootstraps.argtypes = [ctypes.c_void_p]
        lib.rd_kafka_mock_topic_create.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_int,
        ]
        errors = [ctypes.c_void_p, ctypes.c_int16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)]
        lib.rd_kafka_mock_push_request_errors_array.argtypes = errors
        lib.rd_kafka_mock_broker_set_down.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        lib.rd_kafka_mock_topic_set_error.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        lib.rd_kafka_mock_broker_set_rtt.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int]
        self.lib, errbuf = lib, ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        lib.rd_kafka_conf_set(conf, b"log_level", b"0", errbuf, 512)  # no CONFWARN on stderr
        self.handle = lib.rd_kafka_new(1, conf, errbuf, 512)  # a consumer handle to own it
        self.cluster = lib.rd_kafka_mock_cluster_new(self.handle, 3)
        self.url = "kafka://" + lib.rd_kafka_mock_cluster_bootstraps(self.cluster).decode()

    def topic(self, name: str, partitions: int = 1) -> None:
        assert self.lib.rd_kafka_mock_topic_create(self.cluster, name.encode(), partitions, 3) == 0

    def fail_produce(self, *codes: int) -> None:
        """The next Produce requests (one each) answer ``codes``."""
        self.fail_request(PRODUCE, *codes)

    def fail_request(self, api_key: int, *codes: int) -> None:
        """The next requests of ``api_key`` (one each) answer ``codes``."""
        array = (ctypes.c_int * len(codes))(*codes)
        self.lib.rd_kafka_mock_push_request_errors_array(self.cluster, api_key, len(codes), array)

    def all_down(self) -> None:
        for broker in (1, 2, 3):
            self.lib.rd_kafka_mock_broker_set_down(self.cluster, broker)

    def topic_error(self, name: str, code: int) -> None:
        """Metadata responses give ``code`` as the topic's error."""
        self.lib.rd_kafka_mock_topic_set_error(self.cluster, name.encode(), code)

    def delay(self, api_key: int, rtt_ms: int) -> None:
        """Every broker answers its next request of ``api_key`` ``rtt_ms`` late."""
        for broker in (1, 2, 3):
            self.lib.rd_kafka_mock_broker_push_request_error_rtts(  # varargs: no argtypes
                ctypes.c_void_p(self.cluster),
                ctypes.c_int32(broker),
                ctypes.c_int(api_key),  # an int16_t, promoted as a variadic C call does
                ctypes.c_size_t(1),
                ctypes.c_int(0),
                ctypes.c_int(rtt_ms),
            )

    def slow(self, rtt_ms: int) -> None:
        """Every broker answers ``rtt_ms`` late."""
        for broker in (1, 2, 3):
            self.lib.rd_kafka_mock_broker_set_rtt(self.cluster, broker, rtt_ms)

    def close(self) -> None:
        self.lib.rd_kafka_mock_cluster_destroy(self.cluster)
        self.lib.rd_kafka_destroy(self.handle)


@pytest.fixture
def mock() -> Iterator[MockCluster]:
    cluster = MockCluster()
    yield cluster
    cluster.close()


def messages(count: int, topic: str) -> list[ClaimedMessage]:
    now = dt.datetime.now(dt.UTC)
    return [
        ClaimedMessage(n, uuid.uuid4(), "t.e", topic, f'{{"n": {n}}}', {}, "k", 0, now)
        for n in range(count)
    ]


def transport(mock: MockCluster, timeout_ms: int = 15_000) -> KafkaTransport:
    """A transport whose records time out after ``timeout_ms``: long where a record must
    be delivered (a busy machine's mock can take seconds), short where it must time out."""
    quiet = {"log_level": 0, "message.timeout.ms": timeout_ms, "retry.backoff.ms": 10}
    return KafkaTransport(mock.url, quiet)


def read(mock: MockCluster, topic: str, count: int) -> list[bytes]:
    """Up to ``count`` values of ``topic``'s partition 0, from its start (10 s at most)."""
    consumer = Consumer({"bootstrap.servers": mock.url[8:], "group.id": "t", "log_level": 0})
    consumer.assign([TopicPartition(topic, 0, 0)])
    values: list[bytes] = []
    for _ in range(20):
        values += [m.value() for m in consumer.consume(count, timeout=0.5) if m.error() is None]
        if len(values) >= count:
            break
    consumer.close()
    return values


def test_too_few_replicas_for_a_while_is_retried_by_the_producer_in_order(mock):
    mock.topic("orders")
    mock.fail_produce(NOT_ENOUGH_REPLICAS, NOT_ENOUGH_REPLICAS)
    kafka = transport(mock)
    assert kafka.publish(Route("orders"), messages(5, "orders")) == [None] * 5
    kafka.close()
    assert read(mock, "orders", 5) == [f'{{"n": {n}}}'.encode() for n in range(5)]


def test_a_topic_the_user_may_not_write_fails_its_records_for_good(mock):
    mock.topic("orders")
    mock.fail_produce(TOPIC_AUTHORIZATION_FAILED)
    outcomes = transport(mock).publish(Route("orders"), messages(1, "orders"))
    assert [(o.permanent, o.counts, o.outage) for o in outcomes] == [(True, True, False)]
    assert outcomes[0].error.startswith("KafkaError TOPIC_AUTHORIZATION_FAILED")


def test_every_broker_down_is_an_outage_that_spends_no_attempt(mock):
    mock.topic("orders")
    up = transport(mock)  # the cluster took a record: it was up
    assert up.publish(Route("orders"), messages(1, "orders")) == [None]
    up.close()
    mock.all_down()
    # Records time out after 1 s: a producer on a busy machine may take longer than that
    # to reach a mock broker that is up, hence a transport of its own for the outage.
    outcomes = transport(mock, timeout_ms=1000).publish(Route("orders"), messages(3, "orders"))
    assert [(o.outage, o.counts) for o in outcomes] == [(True, False)] * 3
    # No broker answers its metadata request (_TRANSPORT), or none takes the records
    # before they time out (_MSG_TIMED_OUT): which comes first is librdkafka's timing.
    assert re.match(r"KafkaError (_TRANSPORT|_MSG_TIMED_OUT): ", outcomes[0].error)


def test_a_missing_topic_without_partitions_waits_and_names_it(mock):
    (outcome,) = transport(mock).publish(Route("nowhere"), messages(1, "nowhere"))
    assert not outcome.counts and not outcome.outage
    assert outcome.error.startswith("topic 'nowhere' does not exist on kafka://127.0.0.1:")


def test_records_refused_as_too_large_together_go_again_one_at_a_time(mock):
    """A Produce request refused as too large (the topic's max.message.bytes weighs the
    batch librdkafka made, not each record): each record goes again alone in the same
    publish and is published, in order; none waits to be refused again for ever."""
    mock.topic("orders")
    mock.fail_produce(MSG_SIZE_TOO_LARGE)
    kafka = transport(mock)
    assert kafka.publish(Route("orders"), messages(5, "orders")) == [None] * 5
    kafka.close()
    assert read(mock, "orders", 5) == [f'{{"n": {n}}}'.encode() for n in range(5)]


def test_a_record_refused_as_too_large_alone_fails_for_good(mock):
    mock.topic("orders")
    mock.fail_produce(MSG_SIZE_TOO_LARGE)
    (outcome,) = transport(mock).publish(Route("orders"), messages(1, "orders"))
    assert (outcome.permanent, outcome.counts) == (True, True)
    assert outcome.error.startswith("KafkaError MSG_SIZE_TOO_LARGE")


def test_waves_past_the_confirm_budget_are_not_attempted(mock, settings):
    """LEASE_SECONDS = 9: a publish has 3 s (a third of the lease); each wave of an ordered
    batch (a key of six events) takes a round trip of at least 1.5 s, so the third wave
    starts past the budget, or the second's wait ends at it (no report: an outage): from
    the third on none is sent, where all six were published in 9 s or more."""
    mock.topic("orders")
    kafka = transport(mock)  # records time out after 15 s: a busy machine's first is slow
    assert kafka.publish(Route("orders"), messages(1, "orders")) == [None]  # warm
    mock.slow(1500)
    with override_settings(OUTBOX={**settings.OUTBOX, "LEASE_SECONDS": 9}):
        batch = [dataclasses.replace(m, sequence=m.id + 1) for m in messages(6, "orders")]
        outcomes = kafka.publish(Route("orders", ordered=True), batch)
    assert outcomes[0] is None
    late = outcomes[2:]
    assert all(o is not None and not o.counts and not o.outage for o in late), outcomes


def test_a_fatal_producer_error_is_an_outage_logged_and_the_producer_rebuilt(mock, caplog):
    """The cluster refuses the idempotent producer its id (CLUSTER_AUTHORIZATION_FAILED:
    a user without the IdempotentWrite ACL), which librdkafka makes fatal: the rows wait
    (an outage, no attempt), an ERROR gives the reason, check() fails for a while, and
    the next publish builds a new producer (it raised a SystemError out of publish, an
    attempt counted on every row, the reason logged at DEBUG only)."""
    mock.topic("orders")
    mock.fail_request(INIT_PRODUCER_ID, CLUSTER_AUTHORIZATION_FAILED)
    kafka = transport(mock)
    outcomes = kafka.publish(Route("orders"), messages(2, "orders"))
    assert [(o.outage, o.counts) for o in outcomes] == [(True, False)] * 2, outcomes
    # The reason when flush() raises it; "_FATAL" when librdkafka went fatal before a
    # produce() (its timing). Either way the ERROR below names the reason.
    assert re.search(r"CLUSTER_AUTHORIZATION_FAILED|KafkaError _FATAL", outcomes[0].error)
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert error.action == "outbox.kafka_fatal"
    assert "Cluster authorization failed" in error.getMessage()
    with pytest.raises(BrokerUnreachable, match="fatal producer error: KafkaError "):
        kafka.check()
    assert kafka.publish(Route("orders"), messages(2, "orders")) == [None] * 2


def test_a_topic_this_user_may_not_describe_waits_with_an_error(mock, caplog):
    """TOPIC_AUTHORIZATION_FAILED in the topic's metadata: an ACL granted late must not
    cost the backlog, so the rows wait (no attempt) and one ERROR says why (they were
    abandoned)."""
    mock.topic("orders")
    mock.topic_error("orders", TOPIC_AUTHORIZATION_FAILED)
    kafka = transport(mock)
    for _ in range(2):
        outcomes = kafka.publish(Route("orders"), messages(2, "orders"))
        assert [(o.permanent, o.counts, o.outage) for o in outcomes] == [(False, False, False)] * 2
    assert "TOPIC_AUTHORIZATION_FAILED" in outcomes[0].error
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert error.getMessage() == outcomes[0].error


def test_a_topic_creation_unanswered_within_the_budget_waits(mock, settings):
    """CreateTopics answered 5 s late, a budget of 2 s (LEASE_SECONDS = 6): the rows wait,
    no attempt (concurrent.futures' TimeoutError escaped publish: an attempt each)."""
    mock.delay(CREATE_TOPICS, 5000)
    with override_settings(OUTBOX={**settings.OUTBOX, "LEASE_SECONDS": 6}):
        route = Route("orders", partitions=1)
        outcomes = transport(mock).publish(route, messages(2, "orders"))
    assert [(o.permanent, o.counts, o.outage) for o in outcomes] == [(False, False, False)] * 2
    assert outcomes[0].error.startswith("creating topic 'orders' got no answer within ")


def test_a_record_larger_than_the_producers_whole_queue_fails_for_good(mock):
    """queue.buffering.max.kbytes = 1 and a record of 2 kB: produce() raises BufferError
    with nothing queued, which serving reports never cures (publish spun for ever)."""
    mock.topic("orders")
    kafka = KafkaTransport(mock.url, {"log_level": 0, "queue.buffering.max.kbytes": 1})
    big = dataclasses.replace(messages(1, "orders")[0], payload=json.dumps("x" * 2000))
    small, big_outcome = kafka.publish(Route("orders"), [*messages(1, "orders"), big])
    assert small is None
    assert (big_outcome.permanent, big_outcome.counts) == (True, True)
    assert "queue.buffering.max.kbytes" in big_outcome.error


def test_a_record_encoded_ahead_is_the_one_the_publish_sends(mock):
    """What the relay's claim thread prepares is what the publish would build, and the
    publish sends it as prepared (a form put there by hand shows it) without building
    it again; the messages not prepared are built at the publish."""
    mock.topic("orders")
    kafka, route, batch = transport(mock), Route("orders"), messages(4, "orders")
    kafka.prepare(route, batch[:3])
    build = record_of(route)
    assert [m.encoded[2] for m in batch[:3]] == [build(m) for m in batch[:3]]
    assert batch[3].encoded is None
    _, key, headers = batch[1].encoded[2]
    batch[1].encoded = (route, kafka, (b'"as prepared"', key, headers))
    assert kafka.publish(route, batch) == [None] * 4
    assert read(mock, "orders", 4) == [b'{"n": 0}', b'"as prepared"', b'{"n": 2}', b'{"n": 3}']
