"""Apache Kafka (issue 41): the relay against confluent-kafka alone on the same cluster.

The ceiling (:func:`raw_batches`) is confluent-kafka's producer as the relay builds it
(idempotent, ``acks=all``, Java's murmur2 partitioner, ``linger.ms`` 5) publishing the
relay's messages (the same body, the same record headers encoded in the timed loop as
RabbitMQ's ceiling encodes its own, no key) to a topic of three
partitions and three replicas, ``batch`` produced at once and their delivery reports
awaited together (``flush()``), from one Python thread: what the relay does, without the
database and the outbox's rows. The relay drains to its default route, whose topic
(:func:`create_topic`, as the ceiling's) the runner makes before each drain and deletes
after it. Runs only when ``OUTBOX_KAFKA_URL`` names a cluster (``scripts/services kafka
start``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from django_outbox.conf.brokers import kafka_bootstrap
from django_outbox.transports.kafka import DEFAULTS, REQUIRED, record_headers

from .common import BODY, CpuMeter, cpu_figures, median, wire_headers

#: The topics of the scenario: partitions and replicas (the cluster's defaults).
PARTITIONS = 3
REPLICAS = 3
#: Seconds an admin request (create, delete) may take.
ADMIN_TIMEOUT = 30.0


def _admin(url: str) -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": kafka_bootstrap(url)})


def create_topic(url: str, topic: str) -> None:
    """Create ``topic`` (:data:`PARTITIONS`, :data:`REPLICAS`) and wait until every
    broker knows its leaders, so that no drain starts on a topic still being made."""
    from confluent_kafka.admin import NewTopic

    admin = _admin(url)
    new = NewTopic(topic, num_partitions=PARTITIONS, replication_factor=REPLICAS)
    admin.create_topics([new])[topic].result(timeout=ADMIN_TIMEOUT)
    deadline = time.monotonic() + ADMIN_TIMEOUT
    while time.monotonic() < deadline:
        found = admin.list_topics(topic, timeout=ADMIN_TIMEOUT).topics.get(topic)
        if found is not None and found.error is None and len(found.partitions) == PARTITIONS:
            if all(part.leader >= 0 for part in found.partitions.values()):
                return
        time.sleep(0.1)
    raise RuntimeError(f"topic {topic!r} has no leaders after {ADMIN_TIMEOUT:g} s")


def delete_topic(url: str, topic: str) -> None:
    """Delete ``topic``: clean-up only, so one that is gone already, or whose deletion a
    busy cluster has not confirmed within :data:`ADMIN_TIMEOUT`, is fine."""
    from confluent_kafka import KafkaException

    admin = _admin(url)  # held until the future resolves: a collected client fails it
    try:
        admin.delete_topics([topic])[topic].result(timeout=ADMIN_TIMEOUT)
    except (KafkaException, TimeoutError):
        pass


def end_to_end(
    env: dict[str, str], url: str, *, rate: float, seconds: float, per_commit: int
) -> dict[str, float]:
    """Commit-to-consumer latency through Kafka at ``rate`` events/s, ``per_commit`` a
    transaction: figures ``kafka_e2e_1000_*`` (see
    :func:`benchmarks.scenarios.end_to_end`). The topic (the default route's: named as the
    destination, :data:`PARTITIONS` and :data:`REPLICAS`) is made beforehand, so the
    consumer can be assigned its partitions."""
    from . import scenarios

    to = scenarios.destination("kafka_e2e")
    return scenarios.consumed_end_to_end(
        env, url, to, "consume-kafka", (create_topic, delete_topic),
        rate=rate, seconds=seconds, name="kafka_e2e_1000", per_commit=per_commit,
    )  # fmt: skip


def raw_batches(url: str, count: int, batch: int) -> dict[str, Any]:
    """confluent-kafka alone: ``count`` records, ``batch`` produced at once and their
    delivery reports awaited together. Returns ``msgs_per_s``, this thread's CPU per
    record (``cpu_us_per_msg``, µs), and :class:`~benchmarks.common.CpuMeter`'s: the
    process's (librdkafka's threads too) and the brokers'. Raises if a report says an
    error."""
    from confluent_kafka import Producer

    topic = f"bench-raw-{uuid.uuid4().hex[:8]}"
    create_topic(url, topic)
    producer = Producer({**DEFAULTS, **REQUIRED, "bootstrap.servers": kafka_bootstrap(url)})
    producer.produce(topic, BODY, None)  # connected, with its producer id, as the relay's is
    producer.flush(ADMIN_TIMEOUT)
    headers = [wire_headers() for _ in range(count)]  # encoded in the loop, as RabbitMQ's
    failed: list[Any] = []

    def report(error: Any, record: Any) -> None:
        if error is not None:
            failed.append(error)

    meter = CpuMeter(url)
    started, cpu_started = time.perf_counter(), time.thread_time()
    for start in range(0, count, batch):
        for header in headers[start : start + batch]:
            encoded = record_headers(header, "application/json")
            producer.produce(topic, BODY, None, headers=encoded, on_delivery=report)
        producer.flush(ADMIN_TIMEOUT)
    rate = count / (time.perf_counter() - started)
    cpu = (time.thread_time() - cpu_started) / count * 1e6
    spent = meter.per_message(count)
    delete_topic(url, topic)
    if failed or len(producer):
        raise RuntimeError(f"raw Kafka: {len(failed)} failed, {len(producer)} unreported")
    return {"msgs_per_s": rate, "cpu_us_per_msg": cpu, **spent}


#: One round: the ceiling (:func:`raw_batches`), a plain drain, a transactional one.
Round = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]


def figures(rounds: list[Round]) -> dict[str, Any]:
    """The figures of (ceiling, plain relay drain, transactional relay drain) rounds."""
    ratios = [plain["events_per_s"] / top["msgs_per_s"] for top, plain, _ in rounds]
    transactional = [eos["events_per_s"] / plain["events_per_s"] for _, plain, eos in rounds]
    return {
        "raw_kafka_msgs_per_s": median(top["msgs_per_s"] for top, _, _ in rounds),
        "raw_kafka_cpu_us_per_msg": median(top["cpu_us_per_msg"] for top, _, _ in rounds),
        "relay_kafka_ev_per_s": median(p["events_per_s"] for _, p, _ in rounds),
        "relay_kafka_cpu_us_per_event": median(p["cpu_us_per_event"] for _, p, _ in rounds),
        "kafka_vs_raw": median(ratios),
        "kafka_vs_raw_rounds": ratios,
        **cpu_figures("kafka", [(top, plain) for top, plain, _ in rounds]),
        "relay_kafka_transactional_ev_per_s": median(e["events_per_s"] for _, _, e in rounds),
        "kafka_transactional_vs_plain": median(transactional),
        "kafka_transactional_vs_plain_rounds": transactional,
    }
