"""The chaos suite on the three-node Kafka cluster (``scripts/services kafka``): the
``kafka`` profile.

Two destinations publish to one topic, a plain route (not transactional: at least once),
six partitions, three replicas, ``min.insync.replicas=2``: ``KAFKA``, keyless, and
``KAFKA_ORDERED``, an ordered route (broker alias ``kafka``; see chaos.settings). A third,
``KAFKA_TRANSACTIONAL``, a transactional and ordered route (exactly once into the topic),
publishes to a topic of its own, made alike (the first's name and :data:`TRANSACTIONAL`).
The runner names the topics afresh each run (``chaos.kafka.<time>``, deleting an earlier
run's) and creates them; a producer stages its events to each, and a consumer of each
topic (``run_outbox_consumer --broker kafka``) handles them with the other consumers'
handler, through the inbox. At the end :func:`read` reads each topic back from its
beginning, with a ``read_committed`` consumer of its own, into the audit's ``BrokerCopy``
and ``OrderedCopy`` (partition by partition, in offset order: a key's records are in one
partition, so its order there is the order a consumer sees; a key spread over several is
out of order).

The faults (one at a time, as every other): the broker leading most of the topic's
partitions SIGKILLed, then started again (the runner stages an event once it is down and
waits for it to be published through the other two: leaders elected elsewhere); that
broker frozen (SIGSTOP) for a few seconds, then SIGCONT; the whole cluster stopped for a
few seconds, its data kept, and started again; two brokers stopped at once, so that no
partition has ``min.insync.replicas`` in-sync replicas (the runner stages events then,
to the plain and the transactional routes, and none may be published before the brokers
are back). None of them is a publish
failure of a row: each measures the attempts spent, as the broker faults do
(:func:`chaos.broker.spell`). The relay's SIGKILL between publish and mark is
chaos.faults' ``relay_kill`` aimed at Kafka rows the consumer already handled: for the
plain routes the next relay publishes them again, so the topic holds them twice (a plain
route is at least once) and the inbox must handle each once; for the transactional route
(aimed at its rows: committed, not marked) the restarted relay finds them in its record
and marks them, or the relay that reclaims them finds them there and does not send them:
its topic holds each once.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from django_outbox.conf.brokers import kafka_bootstrap

from .destinations import KAFKA, KAFKA_TRANSACTIONAL

if TYPE_CHECKING:
    from .faults import Done, Injector

KINDS = ("kafka_broker_kill", "kafka_broker_freeze", "kafka_down", "kafka_isr_below_min")
#: The runner's topics: ``PREFIX`` and the run's time; the transactional route's, that and
#: ``TRANSACTIONAL``.
PREFIX = "chaos.kafka."
TRANSACTIONAL = ".transactional"
PARTITIONS = 6
#: Seconds the runner's own event may take to be published while a broker is down: the
#: controller fences a dead broker after its session timeout (9 s), then elects leaders.
FAILOVER_WAIT = 40.0
#: Seconds a broker stays frozen: around the broker session timeout (9 s), so that some
#: freezes end before the controller fences it and some after.
FREEZE = (4.0, 12.0)
#: Seconds two brokers stay down, and the events the runner stages meanwhile.
SHORT = (3.0, 6.0)
SHORT_EVENTS = 10
#: Seconds a relay_kill aimed at Kafka rows leaves the relay frozen before it looks: the
#: consumer's fetches wait up to 0.5 s, so it needs that long to read what the relay sent.
SETTLE = 1.0
#: Seconds a relay_kill aimed at the transactional route's rows holds their mark back
#: (chaos.faults' ``_kill_after_commit``) for the consumer to read them: a
#: ``read_committed`` consumer reads a committed batch once the coordinator has written its
#: commit markers, after the commit returned (a median 1.3 s after the rows' mark, on a
#: loaded machine).
TX_SETTLE = 3.0
TIMEOUT = 10.0


def _config(url: str, **more: Any) -> dict[str, Any]:
    return {"bootstrap.servers": kafka_bootstrap(url), "socket.timeout.ms": 10000, **more}


def reset_topics(url: str, topics: list[str]) -> None:
    """Delete the topics earlier runs left, and create ``topics``; wait until every
    partition has a leader."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(_config(url))
    old = [name for name in admin.list_topics(timeout=TIMEOUT).topics if name.startswith(PREFIX)]
    for future in admin.delete_topics(old, operation_timeout=TIMEOUT).values() if old else ():
        future.result(3 * TIMEOUT)
    new = [NewTopic(t, PARTITIONS, 3, config={"min.insync.replicas": "2"}) for t in topics]
    for future in admin.create_topics(new, operation_timeout=TIMEOUT).values():
        future.result(3 * TIMEOUT)
    deadline = time.monotonic() + 3 * TIMEOUT
    for topic in topics:
        while sum(leaders(url, topic).values()) < PARTITIONS:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the partitions of {topic} have no leader after {3 * TIMEOUT:g}s"
                )
            time.sleep(0.2)


def leaders(url: str, topic: str) -> collections.Counter[int]:
    """Broker id (1-3) -> the partitions of ``topic`` it leads (a partition without a
    leader is in none); empty when the cluster does not answer."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    try:
        meta = AdminClient(_config(url)).list_topics(topic, timeout=TIMEOUT)
    except KafkaException:
        return collections.Counter()
    parts = meta.topics[topic].partitions.values() if topic in meta.topics else []
    return collections.Counter(part.leader for part in parts if part.leader >= 0)


def read(url: str, topic: str) -> int:
    """Read ``topic`` from its beginning to its end (``read_committed``) into the audit's
    copies (:func:`chaos.audit.record_read`), partition by partition in offset order; the
    records read."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    from .audit import record_read

    consumer = Consumer(
        _config(
            url,
            **{"group.id": "chaos-audit-read", "isolation.level": "read_committed"},
            **{"enable.auto.commit": False, "enable.partition.eof": True},
        )
    )
    found: list[tuple[int, int, dict[str, str]]] = []
    try:
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        left = set(range(PARTITIONS))
        while left:
            record = consumer.poll(3 * TIMEOUT)
            if record is None:
                raise RuntimeError(f"no record of {topic} within {3 * TIMEOUT:g}s")
            if record.error() is not None:
                if record.error().code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(f"reading {topic}: {record.error()}")
                left.discard(record.partition())
                continue
            headers = {name: value.decode() for name, value in record.headers() or [] if value}
            found.append((record.partition(), record.offset(), headers))
    finally:
        consumer.close()
    record_read([headers for _, _, headers in sorted(found, key=lambda f: f[:2])])
    return len(found)


def _topic() -> str:
    """The run's topic: the runner sets ``CHAOS_KAFKA_TOPIC`` in its own environment, as
    in its processes'."""
    return os.environ["CHAOS_KAFKA_TOPIC"]


def _busiest(injector: Injector) -> tuple[int, str]:
    """The broker leading most of the topic's partitions (any, if none answers), and
    what it leads."""
    led = leaders(injector.services.kafka_url, _topic())
    if not led:
        return int(injector.rng.choice("123")), "the leaders unknown"
    node, count = led.most_common(1)[0]
    return node, f"leading {count} of the topic's {PARTITIONS} partitions"


def _now_leading(injector: Injector) -> str:
    led = leaders(injector.services.kafka_url, _topic())
    return ", ".join(f"k{node} {n}" for node, n in sorted(led.items())) or "nobody"


def broker_kill(injector: Injector) -> Done:
    """SIGKILL the broker leading most partitions and stage an event of the runner's; a
    few seconds later wait for that event to be published (leaders elected on the other
    two), then start the broker again."""
    from .broker import node_kill

    node, leading = _busiest(injector)

    def now() -> str:
        return f"partitions led now: {_now_leading(injector)}"

    return node_kill(injector, "kafka", node, KAFKA, FAILOVER_WAIT, role=leading, now=now)


def broker_freeze(injector: Injector) -> Done:
    """SIGSTOP the broker leading most partitions for a few seconds, then SIGCONT it."""
    from .broker import node_pid, spell, with_facts

    node, leading = _busiest(injector)
    pid = node_pid(injector, "kafka", node)
    hold = injector.rng.uniform(*FREEZE)
    done = spell(
        injector,
        "kafka",
        lambda: os.kill(pid, signal.SIGSTOP),
        lambda: os.kill(pid, signal.SIGCONT),
        hold,
        f"k{node} ({leading}) frozen (SIGSTOP) for {hold:.1f}s",
    )
    return with_facts(
        done,
        lambda facts: f"{facts}; partitions led now: {_now_leading(injector)}",
        target=f"k{node}",
    )


def cluster_down(injector: Injector) -> Done:
    """Stop every broker (their data kept) for a few seconds, then start them together."""
    import dataclasses

    from .broker import cluster_down as down

    return dataclasses.replace(down(injector, "kafka"), target="kafka")


def isr_below_min(injector: Injector) -> Done:
    """Stop two brokers (controlled shutdowns, one after the other): every partition is
    left with fewer in-sync replicas than ``min.insync.replicas`` (2), and a record sent
    with ``acks=all`` cannot be acknowledged (nor a transaction committed). The runner
    stages events then, every other one to the transactional route; none may be PUBLISHED
    before the brokers are back (started together)."""
    from . import database as db
    from .broker import spell, with_facts

    services = injector.services
    first, _ = _busiest(injector)
    second = injector.rng.choice([n for n in (1, 2, 3) if n != first])
    hold = injector.rng.uniform(*SHORT)
    staged: list[str] = []
    early: list[int] = []

    def on() -> None:
        for node in (first, second):
            services.run("kafka", "stop-node", str(node))
        staged.extend(_stage_short(i) for i in range(SHORT_EVENTS))

    def off() -> None:
        early.append(db.published_among(staged))
        services.run("kafka", "start-nodes")

    what = f"k{first} and k{second} stopped (one in-sync replica left) for {hold:.1f}s"
    done = spell(injector, "kafka", on, off, hold, what)
    return with_facts(
        done,
        lambda facts: (
            f"{facts}; of {SHORT_EVENTS} events staged once they were down, {early[0]} "
            f"published before they were back"
        ),
        target=f"k{first}+k{second}",
        short=early[0],
    )


def _stage_short(n: int) -> str:
    """The runner's ``n``th event while two brokers are down: to the plain keyless route,
    or (every other one) to the transactional route, ordered, with a key."""
    from . import database as db

    if n % 2:
        return db.stage_order(KAFKA_TRANSACTIONAL, f"account-{n:02d}")
    return db.stage_order(KAFKA)
