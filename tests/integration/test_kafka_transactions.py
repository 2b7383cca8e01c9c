"""Exactly once into the topic: a Kafka route with ``"transactional": True``, on the real
three-node cluster of ``scripts/services kafka start`` (docs/kafka.md#exactly-once).

The relays whose death or pause a test aims run in subprocesses that replace one
function of the package before they start (no hook in the package): ``store.record``,
the relay's database mark of a batch, to SIGKILL the relay right after its Kafka
transaction committed; ``kafka_transactions.commit_transaction`` to SIGSTOP it just
before its commit. What reaches the topic is read with Kafka's own Java consumer,
``read_committed`` as an exactly-once consumer reads (``read_uncommitted`` to see that
an aborted transaction's records were written all the same).
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.test.utils import override_settings

from django_outbox.models import OutboxMessage
from django_outbox.relay.loop import Relay
from django_outbox.state import store
from django_outbox.transports.kafka_transactions import RECORD_TOPIC, RECORD_TOPIC_CONFIG
from tests.integration.test_kafka import KAFKA_URL, new_topic, read
from tests.integration.test_kafka_consumer import partition_of
from tests.support import stage_events, wait_until
from tests.support.processes import REPO, relay_env

Status = OutboxMessage.Status

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.kafka,
    pytest.mark.disrupts,  # beside test_kafka.py, whose tests stop nodes of the cluster
    pytest.mark.skipif(
        not KAFKA_URL,
        reason="no Kafka cluster: OUTBOX_KAFKA_URL is unset; run scripts/services kafka start "
        'and eval "$(scripts/services env)" (scripts/test does)',
    ),
]

#: Seconds of a lease: a publish may take a third of it (init_transactions on a busy
#: machine takes seconds).
LEASE = 15
BATCH = 50

#: A relay that SIGKILLs itself when it starts marking a published batch: its Kafka
#: transaction committed, its database mark never happens.
KILLED_AFTER_COMMIT = """
import os, signal, sys, threading
import django
django.setup()
from django_outbox.relay import Relay
from django_outbox.state import store
record = store.record
def killed(using, token, *, published, **kwargs):
    if published:
        os.kill(os.getpid(), signal.SIGKILL)
    return record(using, token, published=published, **kwargs)
store.record = killed
Relay(batch_size=int(sys.argv[1])).run(threading.Event())
"""

#: A relay that stops itself (SIGSTOP) just before its first commit, and runs on when
#: continued (SIGCONT): a zombie.
PAUSED_BEFORE_COMMIT = """
import os, signal, sys, threading
import django
django.setup()
from django_outbox.relay import Relay
from django_outbox.transports import kafka_transactions
commit = kafka_transactions.commit_transaction
def paused(producer, timeout):
    os.kill(os.getpid(), signal.SIGSTOP)
    return commit(producer, timeout)
kafka_transactions.commit_transaction = paused
Relay(batch_size=int(sys.argv[1])).run(threading.Event())
"""


def outbox(topic: str, transactional_id: str) -> dict[str, Any]:
    """The Kafka cluster as the default broker (with ``transactional_id``), and
    ``topic``'s transactional route."""
    from django.conf import settings

    return {
        **settings.OUTBOX,
        "BROKER_URL": None,
        "BROKERS": {
            "default": {"URL": KAFKA_URL, "OPTIONS": {"transactional.id": transactional_id}}
        },
        "ROUTES": {
            topic: {"topic": topic, "transactional": True, "partitions": 3, "replication_factor": 3}
        },
        "LEASE_SECONDS": LEASE,
        "RETRY_BASE_DELAY": 0.1,
        "RETRY_MAX_DELAY": 0.5,
    }


def admin() -> Any:
    from confluent_kafka.admin import AdminClient

    return AdminClient({"bootstrap.servers": KAFKA_URL.partition("://")[2]})


def record_topic_partitions(count: int = 3) -> int:
    """The record topic with ``count`` partitions at least, as a broker that creates a topic
    on a look-up (``auto.create.topics.enable``, ``num.partitions=3`` here) or an operator
    makes it; returns how many it has."""
    from confluent_kafka.admin import NewPartitions, NewTopic

    # One client throughout: a client collected before its future resolves fails it
    # ("Broker handle destroyed for termination").
    client = admin()
    found = client.list_topics(timeout=30).topics.get(RECORD_TOPIC)  # all topics: creates none
    if found is None:
        new = NewTopic(RECORD_TOPIC, num_partitions=count, config=RECORD_TOPIC_CONFIG)
        client.create_topics([new])[RECORD_TOPIC].result(timeout=60)
        return count
    if len(found.partitions) < count:
        client.create_partitions([NewPartitions(RECORD_TOPIC, count)])[RECORD_TOPIC].result(60)
    return max(count, len(found.partitions))


def transactional_id(partitions: int) -> str:
    """A fresh transactional id whose record goes to a partition of the record topic other
    than its first (murmur2 of the key, as the relay's producer partitions)."""
    while partition_of(tid := f"test-{uuid.uuid4().hex[:8]}", partitions) == 0:
        pass
    return tid


def start(code: str, settings_: dict[str, Any]) -> subprocess.Popen[str]:
    """``code`` in a fresh interpreter with the test databases and ``settings_``."""
    return subprocess.Popen(
        [sys.executable, "-c", code, str(BATCH)],
        cwd=REPO,
        env=relay_env(**settings_),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def drain(timeout: float = 90) -> None:
    """A relay in this process (it starts as a restarted relay does) until every row is
    PUBLISHED."""
    with Relay(batch_size=BATCH) as relay:

        def settled() -> bool:
            relay.run_once()
            return not OutboxMessage.objects.exclude(status=Status.PUBLISHED).exists()

        wait_until(settled, timeout=timeout, interval=0.1, what="every row PUBLISHED")


def event_ids(topic: str, count: int, isolation: str = "read_committed") -> collections.Counter:
    """How many times each event id is in ``topic``."""
    records = read(topic, count, idle=8, isolation=isolation)
    return collections.Counter(record["headers"]["event_id"] for record in records)


def stopped(process: subprocess.Popen[str]) -> bool:
    """Whether ``process`` is stopped (SIGSTOP), by its state in /proc."""
    stat = Path(f"/proc/{process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def killed_after_commit(topic: str, settings_: dict[str, Any], count: int) -> list[str]:
    """Stage ``count`` events to ``topic`` and run a transactional relay (``settings_``,
    in force) that is SIGKILLed after its first Kafka commit, before its database mark:
    a batch's events are in the topic; returns every staged event's id."""
    ids = stage_events(count, topic)
    killed = start(KILLED_AFTER_COMMIT, settings_)
    _, err = killed.communicate(timeout=120)
    assert killed.returncode == -signal.SIGKILL, err[-2000:]
    assert sum(event_ids(topic, count).values()) >= BATCH
    return ids


def test_a_relay_killed_between_commit_and_mark_leaves_no_duplicate_and_its_rows_end_published():
    # Its record in the record topic's second or third partition: the restarted relay read
    # the first alone, found no record, and sent the committed batch again.
    topic, tid = new_topic(), transactional_id(record_topic_partitions())
    settings_ = outbox(topic, tid)
    with override_settings(OUTBOX=settings_):
        ids = killed_after_commit(topic, settings_, 300)
        # The kill came after a commit: the log holds events whose rows are unmarked.
        unmarked = OutboxMessage.objects.filter(status=Status.PROCESSING).count()
        assert unmarked >= BATCH, unmarked
        assert not OutboxMessage.objects.filter(status=Status.PUBLISHED).exists()

        drain()  # the same transactional id, restarted

    found = event_ids(topic, 400)
    assert sorted(found) == sorted(ids)
    assert set(found.values()) == {1}, [e for e, n in found.items() if n > 1][:5]
    assert OutboxMessage.objects.filter(status=Status.PUBLISHED).count() == 300


def test_a_row_reclaimed_after_its_lease_by_another_relay_is_not_sent_again():
    topic, tid = new_topic(), transactional_id(record_topic_partitions())
    settings_ = outbox(topic, tid)
    with override_settings(OUTBOX=settings_):
        ids = killed_after_commit(topic, settings_, 120)
        # Another relay (its own transactional id) once the dead relay's leases ran out.
        OutboxMessage.objects.filter(status=Status.PROCESSING).update(
            locked_until="2000-01-01T00:00:00Z"
        )
        other = outbox(topic, f"other-{uuid.uuid4().hex[:8]}")
        with override_settings(OUTBOX=other):
            drain()

    found = event_ids(topic, 200)
    assert sorted(found) == sorted(ids)
    assert set(found.values()) == {1}, [e for e, n in found.items() if n > 1][:5]
    assert OutboxMessage.objects.filter(status=Status.PUBLISHED).count() == 120


def test_a_fenced_zombies_batch_is_not_in_the_topic_and_its_rows_are_not_marked_by_it():
    topic, tid = new_topic(), f"test-{uuid.uuid4().hex[:8]}"
    settings_ = outbox(topic, tid)
    with override_settings(OUTBOX=settings_):
        ids = stage_events(BATCH, topic)
        zombie = start(PAUSED_BEFORE_COMMIT, settings_)
        try:
            wait_until(
                lambda: stopped(zombie), timeout=90, what="the zombie paused before its commit"
            )
            with Relay(batch_size=BATCH) as successor:
                successor.recover()  # the same transactional id: fences the zombie
            os.kill(zombie.pid, signal.SIGCONT)
            fenced = Status.FAILED
            wait_until(
                lambda: OutboxMessage.objects.filter(status=fenced).count() == BATCH,
                timeout=60,
                what="the zombie's rows failed as fenced",
                process=zombie,
            )
        finally:
            zombie.kill()
            _, err = zombie.communicate(timeout=30)
        errors = set(OutboxMessage.objects.values_list("last_error", flat=True))
        assert len(errors) == 1 and "fenced" in errors.pop(), errors
        assert "was fenced" in err  # its ERROR, once
        assert not event_ids(topic, BATCH, isolation="read_committed")
        # The zombie did write its batch: an aborted transaction's records.
        assert sorted(event_ids(topic, BATCH, isolation="read_uncommitted")) == sorted(ids)

        store.requeue("default")
        drain()

    found = event_ids(topic, 2 * BATCH)
    assert sorted(found) == sorted(ids)
    assert set(found.values()) == {1}


def test_the_relays_topic_look_ups_create_no_topic():
    """The record topic was looked up with an admin client that let the broker create a
    topic on a look-up: with the broker's ``num.partitions`` (3 here) and no compaction,
    instead of the one compacted partition the relay creates it with."""
    topic, tid = new_topic(), f"test-{uuid.uuid4().hex[:8]}"
    missing, control = new_topic(), new_topic()
    with override_settings(OUTBOX=outbox(topic, tid)), Relay(batch_size=BATCH) as relay:
        relay.recover()  # the transactional producer started, the record topic made sure of
        (transport,) = relay.publisher.transactional()
        found = transport._admin.list_topics(missing, timeout=30).topics[missing]
        assert found.error is not None and found.error.name() == "UNKNOWN_TOPIC_OR_PART"
    # This broker does create a topic a plain client looks up (after the one above: the
    # controller creates them in turn), so the relay's look-up would have created its own.
    admin().list_topics(control, timeout=30)
    wait_until(lambda: control in admin().list_topics(timeout=30).topics, timeout=60)
    assert missing not in admin().list_topics(timeout=30).topics
    client = admin()
    client.delete_topics([control])[control].result(timeout=60)
