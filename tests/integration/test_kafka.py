"""Kafka as a broker of the outbox, on the real three-node KRaft cluster that
``scripts/services kafka start`` runs (``min.insync.replicas=2``; scripts/test starts it
for this layer and exports ``OUTBOX_KAFKA_URL``, as ``scripts/services env`` prints it).
Three tests stop nodes and are slow (about 25, 40 and 40 s); the others take about 30 s.

What reaches the topics is read back with Apache Kafka's own Java consumer, from the
broker's jars (``tests/support/KafkaRead.java`` run as a Java single-file program against
``kafka-clients``): a client nobody here wrote, whose ``Utils.murmur2`` also says which
partition a JVM producer would have picked for each key.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import re
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import connection, transaction
from django.test.utils import override_settings

from django_outbox import stage
from django_outbox.conf.routes import Route
from django_outbox.envelope import ClaimedMessage
from django_outbox.models import OutboxMessage
from django_outbox.relay.loop import Relay
from django_outbox.transports.kafka import KafkaTransport
from tests.support import (
    refused_port,
    services_output,
    stage_events,
    start_relay,
    stop,
    wait_until,
)

KAFKA_URL = os.environ.get("OUTBOX_KAFKA_URL", "")
KAFKA_LIB = os.environ.get("OUTBOX_KAFKA_LIB") or str(
    Path(__file__).resolve().parents[2] / ".services" / "kafka-4.4.0"
)
READER = Path(__file__).resolve().parents[1] / "support" / "KafkaRead.java"
Status = OutboxMessage.Status

#: Skips a test where no cluster runs (scripts/test starts one).
NEEDS_KAFKA = pytest.mark.skipif(
    not KAFKA_URL,
    reason="no Kafka cluster: OUTBOX_KAFKA_URL is unset; run scripts/services kafka start "
    'and eval "$(scripts/services env)" (scripts/test does)',
)
pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.kafka,
    # Every test here shares the cluster that some stop nodes of: scripts/test runs them
    # in its chain of disrupting tests, never beside them.
    pytest.mark.disrupts,
    NEEDS_KAFKA,
]


def outbox(topic: str, **route: Any) -> dict[str, Any]:
    """The relay's OUTBOX: the Kafka cluster as the default broker, ``topic``'s route."""
    return {
        **settings.OUTBOX,
        "BROKER_URL": None,
        "BROKERS": {"default": {"URL": KAFKA_URL}},
        "ROUTES": {topic: {"topic": topic, **route}},
        "RETRY_BASE_DELAY": 0.1,
        "RETRY_MAX_DELAY": 0.5,
    }


def drain(*, timeout: float = 60) -> None:
    """Run the relay in this process until no row waits (published or abandoned)."""
    with Relay() as relay:

        def settled() -> bool:
            relay.run_once()
            return not OutboxMessage.objects.filter(
                status__in=[Status.PENDING, Status.PROCESSING, Status.FAILED]
            ).exists()

        wait_until(settled, timeout=timeout, interval=0.05, what="every row settled")


def read(
    topic: str, count: int, idle: float = 15, isolation: str = "read_committed"
) -> list[dict[str, Any]]:
    """``count`` records of ``topic`` (fewer if no more come for ``idle`` seconds), in
    partition and offset order, as Kafka's Java consumer reads them (``isolation``:
    ``read_uncommitted`` reads the records of aborted transactions too)."""
    bootstrap = KAFKA_URL.partition("://")[2]
    idle_ms = str(int(idle * 1000))
    run = subprocess.run(
        [
            *("java", "-cp", f"{KAFKA_LIB}/*", str(READER), bootstrap, topic, str(count)),
            *(idle_ms, isolation),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    records = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return sorted(records, key=lambda r: (r["partition"], r["offset"]))


def new_topic() -> str:
    return f"outbox-{uuid.uuid4().hex[:12]}"


def test_events_over_many_keys_arrive_with_keys_headers_and_javas_partitions():
    topic = new_topic()
    settings_ = outbox(topic, partitions=6, replication_factor=3, ordered=True)
    settings_["ROUTES"]["plain"] = {"topic": topic}  # unordered: keyless events go too
    with override_settings(OUTBOX=settings_):
        ids = stage_events(600, topic, keys=40)
        with transaction.atomic():
            keyless = stage(
                "test.keyless", {"n": -1}, destination="plain", headers={"tenant": "t1"}
            )
        drain()
    assert OutboxMessage.objects.filter(status=Status.PUBLISHED).count() == 601

    records = read(topic, 601)
    assert sorted(r["headers"]["event_id"] for r in records) == sorted(
        [*ids, str(keyless.event_id)]
    )
    by_key = collections.defaultdict(list)
    for record in records:
        headers, payload = record["headers"], json.loads(record["value"])
        assert headers["content_type"] == "application/json"
        assert headers["event_type"] in ("test.event", "test.keyless")
        assert {"occurred_at", "correlation_id", "causation_id"} <= set(headers)
        if record["key"] is None:
            assert headers["tenant"] == "t1" and payload == {"n": -1}
            continue
        assert record["key"] == headers["ordering_key"] == f"k{payload['n'] % 40}"
        assert record["partition"] == record["java_partition"], record
        by_key[record["key"]].append((int(headers["sequence"]), payload["n"]))
    assert len(by_key) == 40
    assert len({r["partition"] for r in records if r["key"]}) == 6
    for key, seen in by_key.items():  # one key, one partition: read in offset order
        assert seen == sorted(seen), key
        assert [s for s, _ in seen] == list(range(1, len(seen) + 1)), key  # gap-free


def test_a_missing_topic_is_created_only_when_the_route_says_how():
    topic, unrouted = new_topic(), new_topic()  # the second is in no route: the default's
    stage_events(3, topic)
    stage_events(1, unrouted)
    with override_settings(OUTBOX=outbox(topic)), Relay() as relay:
        relay.run_once()
    rows = list(OutboxMessage.objects.all())
    assert {row.status for row in rows} == {Status.FAILED}
    assert {row.attempts for row in rows} == {0}  # a configuration error: no attempt
    errors = {row.destination: row.last_error for row in rows}
    assert errors[topic].startswith(f"topic {topic!r} does not exist on kafka://")
    assert errors[unrouted].startswith(f"topic {unrouted!r} does not exist on kafka://")
    OutboxMessage.objects.filter(destination=unrouted).delete()
    OutboxMessage.objects.update(available_at=rows[0].created_at)  # due again now
    route = {"partitions": 2, "replication_factor": 3, "topic_config": {"retention.ms": "3600000"}}
    with override_settings(OUTBOX=outbox(topic, **route)):
        drain()
    assert OutboxMessage.objects.filter(status=Status.PUBLISHED).count() == 3
    assert len(read(topic, 3)) == 3


def test_a_topic_the_cluster_cannot_have_fails_its_own_rows_only():
    """An invalid topic name is refused for good; a topic the relay cannot create (more
    replicas than brokers) waits, named, no attempt spent; the other route publishes."""
    good, bad, big = new_topic(), "no such topic!", new_topic()
    routes = {
        good: {"topic": good, "partitions": 1},
        "bad": {"topic": bad, "partitions": 1},
        "big": {"topic": big, "partitions": 1, "replication_factor": 5},
    }
    with override_settings(OUTBOX={**outbox(good), "ROUTES": routes}):
        stage_events(2, good)
        stage_events(2, "bad")
        stage_events(2, "big")
        with Relay() as relay:
            relay.run_once()
    rows = {row.destination: row for row in OutboxMessage.objects.all()}
    assert rows[good].status == Status.PUBLISHED
    assert (rows["bad"].status, rows["bad"].attempts) == (Status.ABANDONED, 1)
    assert "TOPIC_EXCEPTION" in rows["bad"].last_error, rows["bad"].last_error
    assert (rows["big"].status, rows["big"].attempts) == (Status.FAILED, 0)
    assert rows["big"].last_error.startswith(
        f"creating topic {big!r} failed: KafkaError INVALID_REPLICATION_FACTOR"
    ), rows["big"].last_error


def test_a_too_large_record_fails_alone_while_its_neighbours_publish():
    topic = new_topic()
    with transaction.atomic():
        before = stage("test.small", {"n": 1}, destination=topic, key="k")
        big = stage("test.big", {"blob": "x" * 50_000}, destination=topic, key="k")
        after = stage("test.small", {"n": 2}, destination=topic, key="other")
    route = {
        "partitions": 1,
        "replication_factor": 3,
        "topic_config": {"max.message.bytes": "20000"},
    }
    with override_settings(OUTBOX=outbox(topic, **route)):
        drain()
    big.refresh_from_db()
    assert big.status == Status.ABANDONED
    assert "MSG_SIZE_TOO_LARGE" in big.last_error
    assert big.attempts == 1
    published = OutboxMessage.objects.filter(status=Status.PUBLISHED)
    assert sorted(published.values_list("pk", flat=True)) == sorted([before.pk, after.pk])
    assert sorted(r["headers"]["event_type"] for r in read(topic, 2)) == ["test.small"] * 2


def test_records_too_large_only_together_are_each_published():
    """30 records of about 1 kB on a topic capped at 20,000 bytes: librdkafka batches them
    over the cap and the broker refuses the batch; each goes again alone in the same
    publish (they came back not attempted, to be re-claimed, batched and refused again)."""
    topic = new_topic()
    route = Route(topic, topic=topic, partitions=1, topic_config=(("max.message.bytes", 20000),))
    now = dt.datetime.now(dt.UTC)
    batch = [
        ClaimedMessage(
            n, uuid.uuid4(), "t.e", topic, json.dumps({"blob": "x" * 1000}), {}, "", 0, now
        )
        for n in range(30)
    ]
    kafka = KafkaTransport(KAFKA_URL)
    try:
        assert kafka.publish(route, batch) == [None] * 30
    finally:
        kafka.close()
    assert len(read(topic, 30, idle=5)) == 30


def test_a_topic_deleted_under_a_running_relay_makes_its_rows_wait():
    """The relay knows the topic; an operator deletes it: its rows cost no attempt, and
    the next publish finds it missing (the relay kept it as known, and the records came
    back _UNKNOWN_TOPIC, an attempt each, or timed out, an outage, for ever)."""
    from confluent_kafka.admin import AdminClient

    topic = new_topic()
    now = dt.datetime.now(dt.UTC)
    batch = [ClaimedMessage(n, uuid.uuid4(), "t.e", topic, "{}", {}, "", 0, now) for n in range(3)]
    kafka = KafkaTransport(KAFKA_URL)
    try:
        assert kafka.publish(Route(topic, topic=topic, partitions=1), batch) == [None] * 3
        admin = AdminClient({"bootstrap.servers": KAFKA_URL.partition("://")[2]})
        admin.delete_topics([topic])[topic].result(timeout=30)
        waiting = Route(topic, topic=topic)  # no partitions: a missing topic is not created
        outcomes = [kafka.publish(waiting, batch) for _ in range(2)]
    finally:
        kafka.close()
    assert all(not o.counts for o in outcomes[0]), outcomes[0]
    assert outcomes[1][0].error.startswith(f"topic {topic!r} does not exist on kafka://")


def test_an_ordered_route_writes_nothing_of_a_key_after_its_refused_record():
    """k2 is refused for good (too large): k3, staged after it, must not reach the topic
    ahead of it (idempotence alone would write it in the same batch); key j is untouched."""
    topic = new_topic()
    route = {"partitions": 1, "ordered": True, "topic_config": {"max.message.bytes": "20000"}}
    with override_settings(OUTBOX=outbox(topic, **route)):
        with transaction.atomic():
            for key, payload in [("k", {"n": 1}), ("j", {"n": 1}), ("k", {"blob": "x" * 50_000})]:
                stage("test.e", payload, destination=topic, key=key)
            for key in ("k", "j"):
                stage("test.e", {"n": 3 if key == "k" else 2}, destination=topic, key=key)
        with Relay() as relay:
            for _ in range(3):
                relay.run_once()
    rows = {(r.ordering_key, r.sequence): r.status for r in OutboxMessage.objects.all()}
    assert rows[("k", 1)] == rows[("j", 1)] == rows[("j", 2)] == Status.PUBLISHED
    assert rows[("k", 2)] == Status.ABANDONED  # it blocks its key until an operator acts
    assert rows[("k", 3)] != Status.PUBLISHED
    written = [(r["key"], r["headers"]["sequence"]) for r in read(topic, 4, idle=3)]
    assert sorted(written) == [("j", "1"), ("j", "2"), ("k", "1")]


def test_an_unreachable_cluster_is_an_outage_that_spends_no_attempt():
    topic = new_topic()
    stage_events(5, topic)
    unreachable = {
        **outbox(topic, partitions=1),
        "BROKERS": {"default": {"URL": f"kafka://127.0.0.1:{refused_port()}"}},
    }
    with override_settings(OUTBOX=unreachable), Relay() as relay:
        relay.run_once()
    rows = list(OutboxMessage.objects.all())
    assert {(row.status, row.attempts) for row in rows} == {(Status.FAILED, 0)}
    assert "KafkaError" in rows[0].last_error, rows[0].last_error


def kafka(*args: str) -> str:
    return services_output("kafka", *args, timeout=180)


@pytest.mark.slow
def test_too_few_in_sync_replicas_is_an_outage_that_spends_no_attempt():
    """A topic that needs all three replicas in sync while node 3 is stopped: the
    cluster answers and refuses every write (NOT_ENOUGH_REPLICAS, retried by the producer
    until its message timeout); the rows wait, no attempt spent, and go once it is back."""
    topic = new_topic()
    route = {"partitions": 1, "replication_factor": 3, "topic_config": {"min.insync.replicas": "3"}}
    with override_settings(OUTBOX={**outbox(topic, **route), "LEASE_SECONDS": 9}):
        with Relay() as relay:  # creates the topic while all three are in sync
            stage_events(1, topic)
            assert relay.run_once().published == 1
        kafka("stop-node", "3")
        try:
            stage_events(5, topic)
            with Relay() as relay:
                relay.run_once()
            waiting = OutboxMessage.objects.exclude(status=Status.PUBLISHED)
            assert {(row.status, row.attempts) for row in waiting} == {(Status.FAILED, 0)}
            # librdkafka's timeout (_MSG_TIMED_OUT), or none by the publish's deadline
            assert re.match("KafkaError|no delivery report", waiting[0].last_error)
        finally:
            kafka("start-node", "3")
        OutboxMessage.objects.update(available_at=waiting[0].created_at)
        drain()
    assert OutboxMessage.objects.filter(status=Status.PUBLISHED).count() == 6
    assert len(read(topic, 6)) == 6


@pytest.mark.slow
def test_the_whole_cluster_down_is_an_outage_that_spends_no_attempt():
    """Every node stopped under a relay whose producer knows the topic: its records time
    out (message.timeout.ms, a third of LEASE_SECONDS), the rows wait with no attempt
    spent, and the same relay publishes them once the cluster is back."""
    topic = new_topic()
    route = {"partitions": 3, "replication_factor": 3}
    with override_settings(OUTBOX={**outbox(topic, **route), "LEASE_SECONDS": 9}):
        with Relay() as relay:
            stage_events(1, topic)
            assert relay.run_once().published == 1
            kafka("stop-nodes")
            try:
                ids = stage_events(20, topic)
                relay.run_once()
                waiting = OutboxMessage.objects.exclude(status=Status.PUBLISHED)
                assert {(row.status, row.attempts) for row in waiting} == {(Status.FAILED, 0)}
                error = waiting[0].last_error
                assert re.match("KafkaError _MSG_TIMED_OUT|no delivery report", error), error
            finally:
                kafka("start-nodes")
            OutboxMessage.objects.update(available_at=waiting[0].created_at)
            wait_until(lambda: relay.run_once() and published() == 21, timeout=60, what="back")
    assert OutboxMessage.objects.filter(attempts__gt=0).count() == 0
    assert set(ids) <= {r["headers"]["event_id"] for r in read(topic, 21)}


class Stager(threading.Thread):
    """Commits events over 20 keys to ``topic`` (chunks of 50, about every 200 ms)."""

    def __init__(self, topic: str) -> None:
        super().__init__(daemon=True)
        self.topic, self.ids, self.done = topic, [], threading.Event()

    def run(self) -> None:
        try:
            while not self.done.is_set():
                self.ids += stage_events(50, self.topic, keys=20)
                self.done.wait(0.2)
        finally:
            connection.close()

    def stop(self) -> list[str]:
        self.done.set()
        self.join(timeout=60)
        return self.ids


def published() -> int:
    return OutboxMessage.objects.filter(status=Status.PUBLISHED).count()


def published_everything(relay: subprocess.Popen[str], stager: Stager) -> None:
    """Stop node 2 while ``relay`` publishes what ``stager`` commits, start it again,
    and wait until every event is PUBLISHED; then stop the relay."""
    try:
        wait_until(lambda: published() >= 300, timeout=60, what="publishing under way")
        kafka("stop-node", "2")
        try:
            at = published()
            wait_until(lambda: published() >= at + 300, timeout=60, what="publishing on 2 nodes")
        finally:
            kafka("start-node", "2")
        ids = stager.stop()
        wait_until(lambda: published() == len(ids), timeout=120, what="every event published")
    finally:
        stager.stop()
        code, _out, err = stop(relay)
        print(err[-3000:])  # shown if the test fails
    assert code == 0, err


@pytest.mark.slow
def test_a_broker_stopped_while_publishing_loses_nothing():
    topic = new_topic()
    route = {"topic": topic, "partitions": 6, "replication_factor": 3, "ordered": True}
    overrides = {**outbox(topic), "ROUTES": {topic: route}}
    relay = start_relay(**{key: overrides[key] for key in OVERRIDDEN})
    stager = Stager(topic)
    with override_settings(OUTBOX=overrides):  # staged as ordered, with sequences
        stager.start()
        published_everything(relay, stager)
    assert OutboxMessage.objects.filter(attempts__gt=0).count() == 0  # outages only
    records = read(topic, len(stager.ids))
    counts = collections.Counter(r["headers"]["event_id"] for r in records)
    assert set(counts) == set(stager.ids), "every committed event reached the topic"
    print(f"kafka: {len(stager.ids)} events, {sum(counts.values()) - len(stager.ids)} duplicates")
    firsts = collections.defaultdict(list)  # each event's first record, per key
    seen = set()
    for record in records:  # one key, one partition: offset order
        if record["headers"]["event_id"] not in seen:
            seen.add(record["headers"]["event_id"])
            firsts[record["key"]].append(int(record["headers"]["sequence"]))
    assert len(firsts) == 20
    assert all(sequences == sorted(sequences) for sequences in firsts.values())


#: The OUTBOX keys a relay subprocess is given (the rest are the test settings').
OVERRIDDEN = ("BROKER_URL", "BROKERS", "ROUTES", "RETRY_BASE_DELAY", "RETRY_MAX_DELAY")
