"""A three-node RabbitMQ cluster (``scripts/services cluster start``; scripts/test starts
it before this layer): the relay is given all three nodes as a kombu failover list
(``OUTBOX_CLUSTER_URL``) and publishes with confirms to a quorum queue while the node
holding the queue's leader is stopped and started again. Nothing is lost, the relay
goes on through another node, and the duplicates stay within the bound below.

The bound: a connection lost mid-publish fails every message sent on it and not yet
confirmed, and those rows are published again. The relay has at most two batches in
flight (the one waiting for its confirms and the claim made ahead), so one node stop
republishes at most ``2 * BATCH_SIZE`` messages (one lost connection; a second one
while reconnecting would add as much again, hence the test's ``4 * BATCH_SIZE``).
"""

from __future__ import annotations

import collections
import os

import kombu
import pytest

from django_outbox.models import OutboxMessage
from tests.support import (
    Producer,
    consume,
    delete_queue,
    services_output,
    stage_events,
    start_relay,
    stop,
    unique_destination,
    wait_until,
)

CLUSTER_URL = os.environ.get("OUTBOX_CLUSTER_URL", "")
BATCH_SIZE = 100
DUPLICATES_BOUND = 4 * BATCH_SIZE

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.disrupts,
    pytest.mark.skipif(
        not CLUSTER_URL,
        reason="no RabbitMQ cluster: run scripts/services cluster start (scripts/test does)",
    ),
]


def cluster(*args: str) -> str:
    """``scripts/services cluster ARGS``; its stdout."""
    return services_output("cluster", *args, timeout=180)


def running_nodes() -> list[int]:
    status = cluster("status").splitlines()
    return [int(line.split()[2].rstrip(":")) for line in status if ": running" in line]


def leader(queue: str) -> int:
    """The number (1-3) of the node holding ``queue``'s leader, asked of a running node."""
    node = str(running_nodes()[0])
    table = cluster("rabbitmqctl", node, "list_queues", "name", "leader", "--no-table-headers")
    names = dict(line.split() for line in table.splitlines() if len(line.split()) == 2)
    return int(names[queue].split("@")[0].removeprefix("outbox-c"))


def connected_nodes() -> set[int]:
    """The nodes (1-3) holding a client connection, cluster-wide."""
    # A connection's pid is <outbox-cN@localhost.a.b.c>: the node serving it.
    table = cluster("rabbitmqctl", str(running_nodes()[0]), "list_connections", "pid", "-s")
    return {int(pid.split("@")[0].removeprefix("<outbox-c")) for pid in table.split()}


def quorum(queue: str) -> kombu.Queue:
    """``queue`` as the relay declares it: a reader must declare it alike."""
    return kombu.Queue(queue, routing_key=queue, queue_arguments={"x-queue-type": "quorum"})


def published() -> int:
    return OutboxMessage.objects.filter(status=OutboxMessage.Status.PUBLISHED).count()


def more_published(count: int, what: str) -> None:
    at = published()
    wait_until(lambda: published() >= at + count, timeout=120, what=what)


@pytest.fixture
def quorum_route():
    """A destination on a quorum queue of the cluster, and the relay's OUTBOX overrides."""
    destination = unique_destination("cluster")
    outbox = {
        "BROKER_URL": None,  # the test settings' single node; the cluster is the default
        "BROKERS": {"default": {"URL": CLUSTER_URL}},
        "ROUTES": {
            destination: {
                "queue": destination,
                "routing_key": destination,
                "queue_type": "quorum",
            }
        },
        "BATCH_SIZE": BATCH_SIZE,
        "RETRY_BASE_DELAY": 0.2,
        "RETRY_MAX_DELAY": 2,
        "MAX_ATTEMPTS": 1000,
    }
    yield destination, outbox
    assert sorted(running_nodes()) == [1, 2, 3], "the test left a node stopped"
    delete_queue(destination, url=CLUSTER_URL)


def test_the_leader_node_stops_and_starts_while_the_relay_publishes(quorum_route):
    destination, outbox = quorum_route
    first = stage_events(BATCH_SIZE, destination)
    relay = start_relay(**outbox)
    producer = Producer(destination)
    try:
        wait_until(lambda: published() == len(first), timeout=60, what="the first batch")
        stopped = leader(destination)
        assert stopped in connected_nodes(), "the queue's leader is where the relay declared it"
        producer.start()
        more_published(500, "publishing under way")
        cluster("stop-node", str(stopped))
        try:
            # Through another node, to the queue's new leader, while the old one is down.
            more_published(500, "publishing resumed")
            assert stopped not in connected_nodes()
            new_leader = leader(destination)
        finally:
            cluster("start-node", str(stopped))
        more_published(500, "publishing after the node's return")
        ids = first + producer.stop()
        wait_until(lambda: published() == len(ids), timeout=180, what="every event published")
    finally:
        producer.stop()  # a failure above must not leave it staging under the next tests
        code, _out, err = stop(relay)
        print(err)  # shown if the test fails
    assert code == 0, err
    assert new_leader != stopped

    counts = collections.Counter(
        m.headers["event_id"] for m in consume(quorum(destination), len(ids), url=CLUSTER_URL)
    )
    assert set(counts) == set(ids), "every committed event reached the quorum queue"
    duplicates = sum(counts.values()) - len(ids)
    print(f"cluster: {len(ids)} events, {duplicates} duplicates (bound {DUPLICATES_BOUND})")
    assert duplicates <= DUPLICATES_BOUND
    assert OutboxMessage.objects.exclude(status=OutboxMessage.Status.PUBLISHED).count() == 0


def test_the_relay_starts_with_the_first_node_down(quorum_route):
    """A failover list whose first address is a stopped node: the relay connects to the
    next one at once, without an outage."""
    destination, outbox = quorum_route
    ids = stage_events(300, destination)
    cluster("stop-node", "1")
    try:
        relay = start_relay(**outbox)
        try:
            wait_until(lambda: published() == len(ids), timeout=60, what="every event published")
        finally:
            code, _out, err = stop(relay)
            print(err)  # shown if the test fails
    finally:
        cluster("start-node", "1")
    assert code == 0, err
    assert "unreachable" not in err, err  # no outage: the next node answered at once
    received = consume(quorum(destination), len(ids), url=CLUSTER_URL)
    assert sorted(m.headers["event_id"] for m in received) == sorted(ids)
