"""The chaos suite on a three-node RabbitMQ cluster (``scripts/services cluster``).

The destination ``CLUSTERED`` is a quorum queue on the cluster (broker alias ``cluster``,
its URL kombu's failover list of the three nodes; see chaos.settings): one producer
stages its keyless events there, a second consumer handles them with the same handler,
and a tap (a quorum queue too, so that no copy is lost while a node is down) counts
what the cluster received, as the single node's tap does.

The faults stop one node and start it again: the node holding the queue's leader (the
relays connected to it lose their connection and go on through another node, and the
queue elects a new leader) or a follower (the leader keeps its majority). Once the
node is down, the runner commits an order of its own with its event to ``CLUSTERED``
and waits up to ``FAILOVER_WAIT`` seconds for the relays to publish it through the
other nodes, before it starts the node again: an event not published by then is the
audit's "cluster node restarts with nothing published through the other nodes" (the
producers' own events are too bursty to tell). The runner declares ``CLUSTERED`` itself, through
the first node, so that its leader starts there (RabbitMQ places a quorum queue's leader
on the declaring client's node); ``--sabotage failover`` pins the relays to that node.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import kombu

from benchmarks.services import Services
from django_outbox.conf import outbox_settings
from django_outbox.conf.routes import Route
from django_outbox.transports.declare import declare

from .destinations import CLUSTERED

KINDS = ("cluster_leader_restart", "cluster_follower_restart")
QUORUM = {"x-queue-type": "quorum"}
#: Seconds the runner's own event may take to be published while a node is down.
FAILOVER_WAIT = 20.0
TAP = "chaos.tap"
NODES = (1, 2, 3)


def tap_route(exchange: str) -> Route:
    return Route(
        CLUSTERED, exchange, "topic", CLUSTERED, TAP, queue_arguments=tuple(QUORUM.items())
    )


def reset_queues(url: str, exchange: str) -> None:
    """Delete what an earlier run left on the cluster, bind a fresh tap, and declare
    ``CLUSTERED`` as the relays do, through the first node (its leader's home)."""
    with kombu.Connection(url.split(";")[0], connect_timeout=10) as connection:
        channel = connection.channel()
        for name in (CLUSTERED, TAP):
            kombu.Queue(name, channel=channel).delete()
        declare(channel, tap_route(exchange))
        route = outbox_settings.route_for(CLUSTERED)
        assert route is not None, f"chaos.settings routes {CLUSTERED} when the cluster runs"
        declare(channel, route)


def leader(services: Services) -> int:
    """The node (1-3) holding ``CLUSTERED``'s leader, asked of a running node."""
    for node in NODES:
        try:
            table = services.run(
                "cluster", "rabbitmqctl", str(node), "list_queues", "name", "leader", "-s"
            )
        except RuntimeError:  # that node is down; ask the next
            continue
        names = dict(line.split() for line in table.splitlines() if len(line.split()) == 2)
        return int(names[CLUSTERED].split("@")[0].removeprefix("outbox-c"))
    raise RuntimeError("no node of the cluster answers")


def node_restart(
    services: Services, rng: random.Random, *, leader_node: bool
) -> tuple[str, float, Callable[[], str], float | None]:
    """Stop the leader's node (or a follower's), see an event published through the
    others, and start it again; returns the target, when it ended, the facts and the
    seconds the event took (None: not within ``FAILOVER_WAIT``), for ``Done``."""
    from . import database as db  # its models need Django set up; the runner imports this first

    was = leader(services)
    node = was if leader_node else rng.choice([n for n in NODES if n != was])
    began = time.monotonic()
    services.run("cluster", "stop-node", str(node))
    stopped = time.monotonic()
    failover = db.published_within(db.stage_order(CLUSTERED), FAILOVER_WAIT)
    services.run("cluster", "start-node", str(node))
    ended = time.monotonic()
    role = "the leader" if leader_node else "a follower"
    now = leader(services)
    seen = (
        f"not published within {FAILOVER_WAIT:.0f}s"
        if failover is None
        else f"published through the other nodes in {failover:.1f}s"
    )
    facts = (
        f"outbox-c{node} ({role} of {CLUSTERED}) stopped in {stopped - began:.1f}s; an event "
        f"staged then was {seen}; started in {ended - stopped - (failover or 0):.1f}s; "
        f"the leader is now on outbox-c{now}"
    )
    return f"c{node}", ended, lambda: facts, failover
