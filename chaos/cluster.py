"""The chaos suite on a three-node RabbitMQ cluster (``scripts/services cluster``).

The destination ``CLUSTERED`` is a quorum queue on the cluster (broker alias ``cluster``,
its URL kombu's failover list of the three nodes; see chaos.settings): one producer
stages its keyless events there, a second consumer handles them with the same handler,
and a tap (a quorum queue too, so that no copy is lost while a node is down) counts
what the cluster received, as the single node's tap does.

The faults stop one node and start it again: the node holding the queue's leader (the
relays connected to it lose their connection and go on through another node, and the
queue elects a new leader) or a follower (the leader keeps its majority). Each counts
the rows of ``CLUSTERED`` published while its node was down: none means the relays did
not go on through the other nodes (the audit's "cluster node restarts with nothing
published through the other nodes"). The runner declares ``CLUSTERED`` itself, through
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
from django_outbox.routes import Route
from django_outbox.transports.kombu import declare

from .destinations import CLUSTERED

KINDS = ("cluster_leader_restart", "cluster_follower_restart")
QUORUM = {"x-queue-type": "quorum"}
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
) -> tuple[str, float, Callable[[], str], int]:
    """Stop the leader's node (or a follower's) and start it again; returns the target,
    when it ended, the facts and the rows of ``CLUSTERED`` published while the node was
    down, for the injector's ``Done``."""
    was = leader(services)
    node = was if leader_node else rng.choice([n for n in NODES if n != was])
    began = time.monotonic()
    services.run("cluster", "stop-node", str(node))
    stopped, down_since = time.monotonic(), time.time()
    services.run("cluster", "start-node", str(node))
    ended, down_until = time.monotonic(), time.time()
    through = published_between(down_since, down_until)
    role = "the leader" if leader_node else "a follower"
    now = leader(services)
    facts = (
        f"outbox-c{node} ({role} of {CLUSTERED}) stopped in {stopped - began:.1f}s and "
        f"started in {ended - stopped:.1f}s; {through} rows of {CLUSTERED} published "
        f"through the other nodes meanwhile; the leader is now on outbox-c{now}"
    )
    return f"c{node}", ended, lambda: facts, through


def published_between(since: float, until: float) -> int:
    """Rows of ``CLUSTERED`` marked PUBLISHED between two wall-clock times."""
    from . import database as db  # its models need Django set up; the runner imports this first

    return int(
        db.value(
            f"SELECT count(*) FROM {db.OUTBOX} WHERE destination = %s "
            "AND published_at BETWEEN to_timestamp(%s) AND to_timestamp(%s)",
            (CLUSTERED, since, until),
        )
    )
