"""Faults of a broker that stays up: a memory alarm, Redis out of memory, and a slow or
partitioned network.

* ``memory_alarm``: ``rabbitmqctl set_vm_memory_high_watermark 0.0001`` for a few
  seconds, then ``0.4`` again. RabbitMQ keeps accepting connections but blocks every
  publishing connection: nothing is confirmed while it lasts.
* ``redis_oom``: the services' Redis at its ``maxmemory`` (1 byte, ``noeviction``) for
  a few seconds: it takes connections and reads, and refuses every write (``OOM``). The
  runner stages an event to ``REDIS`` first and waits until it is published (the relays
  have declared the queue and push to it), then sets the limit and stages
  ``REDIS_EVENTS`` more, which wait for the memory to come back.
* ``net_delay``: the relays' proxy (:mod:`chaos.proxy`) adds latency to every chunk
  for a few seconds.
* ``net_partition``: the proxy stops forwarding for a few seconds, sockets open, then
  resets the relays' connections.

None of them is a publish failure of a row: the relay must spend no attempt on them.
Each measures the attempts spent, ``sum(attempts)`` over the outbox rows of the single
broker (not the cluster's, whose connections these faults do not touch, and one of which
a node restart earlier may leave to reset later) from before the fault until every row
staged before it ended is PUBLISHED (faults come one at a time, after the system
recovered from the last, so nothing else spends attempts then), and
the audit's "attempts spent without a publish" adds them up. The partition's reset
is the exception: a publish it cuts was sent and failed, a real failure that may
count; only the attempts spent while the link was silent must be none.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import database as db
from .destinations import REDIS
from .logs import lines

if TYPE_CHECKING:
    from .faults import Done, Injector

ALARM = "0.0001"  # vm_memory_high_watermark: every node is over it
NORMAL = "0.4"  # RabbitMQ's default
HOLD = (5.0, 10.0)  # seconds a fault lasts
DELAY = (0.05, 0.4)  # seconds of latency per chunk
#: Seconds a three-node system's (NATS, Kafka) killed node stays down, and the whole
#: cluster.
NODE_DOWN = (1.0, 3.0)
DOWN = (3.0, 6.0)
#: Events the runner stages to REDIS once Redis is out of memory.
REDIS_EVENTS = 50
#: Seconds the event staged before the limit may take to be published.
REDIS_WARMUP = 30.0


def memory_alarm(injector: Injector) -> Done:
    """Set RabbitMQ's memory alarm for a few seconds, then clear it."""
    services = injector.services
    hold = injector.rng.uniform(*HOLD)

    def on() -> None:
        services.run("rabbitmqctl", "set_vm_memory_high_watermark", ALARM)

    def off() -> None:
        services.run("rabbitmqctl", "set_vm_memory_high_watermark", NORMAL)

    return spell(injector, "rabbitmq", on, off, hold, f"memory alarm for {hold:.1f}s")


def redis_oom(injector: Injector) -> Done:
    """Put Redis at its maxmemory for a few seconds (every write refused), with events
    staged to it meanwhile, then give it its memory back."""
    import redis

    from .faults import NotRecovered

    client = redis.Redis.from_url(injector.services.redis_url)
    limit = client.config_get("maxmemory")["maxmemory"]
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    hold = injector.rng.uniform(*HOLD)
    if db.published_within(_stage_to_redis(1)[0], REDIS_WARMUP) is None:
        raise NotRecovered(f"an event to {REDIS} was not published within {REDIS_WARMUP:g}s")

    def on() -> None:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 1)
        _stage_to_redis(REDIS_EVENTS)

    def off() -> None:
        client.config_set("maxmemory", limit)
        client.config_set("maxmemory-policy", policy)

    try:
        return spell(injector, "redis", on, off, hold, f"Redis out of memory for {hold:.1f}s")
    finally:
        client.close()


def _stage_to_redis(count: int) -> list[str]:
    """Commit ``count`` events to REDIS (no order: the audit counts them apart); their
    event ids."""
    from django.db import transaction

    from django_outbox import stage_many

    with transaction.atomic():
        rows = stage_many(
            [
                {"event_type": "chaos.oom", "payload": {"n": n}, "destination": REDIS}
                for n in range(count)
            ]
        )
    return [str(row.event_id) for row in rows]


def net_delay(injector: Injector) -> Done:
    """Add latency between the relays and RabbitMQ for a few seconds."""
    proxy = injector.proxy
    hold = injector.rng.uniform(*HOLD)
    delay = injector.rng.uniform(*DELAY)
    what = f"{delay * 1000:.0f} ms per chunk for {hold:.1f}s"
    return spell(
        injector, "network", lambda: proxy.delay(delay), lambda: proxy.delay(0), hold, what
    )


def net_partition(injector: Injector) -> Done:
    """Blackhole the relays' connections for a few seconds, then reset them."""
    proxy = injector.proxy
    hold = injector.rng.uniform(*HOLD)
    reset: list[int] = []

    def heal() -> None:
        reset.append(proxy.heal())

    done = spell(
        injector, "network", proxy.partition, heal, hold, f"partition for {hold:.1f}s", reset=True
    )
    return with_facts(done, lambda facts: f"{facts}; {reset[0]} connections reset at the end")


def spell(
    injector: Injector,
    target: str,
    on: Callable[[], None],
    off: Callable[[], None],
    hold: float,
    what: str,
    *,
    reset: bool = False,
) -> Done:
    """Turn a fault ``on`` for ``hold`` seconds and ``off`` again; then wait until every
    row staged before it ended is PUBLISHED, and count the attempts spent meanwhile.
    With ``reset`` (``off`` cuts the relays' connections), only the attempts spent
    while it was on count: a publish the reset cut is a real publish failure."""
    from .faults import Done, NotRecovered

    watched = injector.relays
    before = {relay.role: _outage_lines(relay.log) for relay in watched}
    attempts = db.attempts()
    on()
    began = time.monotonic()
    published_before = db.published()
    time.sleep(hold)
    published_during = db.published() - published_before
    spent_while_on = db.attempts() - attempts
    off()
    ended = time.monotonic()
    mark = db.last_outbox()
    deadline = ended + injector.recovery_timeout
    while db.unpublished(mark):
        if time.monotonic() > deadline:
            raise NotRecovered(f"rows staged before the {target} fault ended still unpublished")
        time.sleep(0.2)
    spent = db.attempts() - attempts
    counted = spent_while_on if reset else spent
    logged = ", ".join(
        f"{relay.role} {d - before[relay.role][0]}/{u - before[relay.role][1]}"
        for relay in watched
        for d, u in [_outage_lines(relay.log)]
    )
    facts = (
        f"{what} ({ended - began:.1f}s); {published_during} rows published meanwhile; "
        f"outbox.broker_down/broker_up lines: {logged}; attempts spent: {spent_while_on} "
        f"while it lasted, {spent} until every row staged before its end was published"
    )
    return Done(target, ended, lambda: facts, spent=counted)


def with_facts(done: Done, more: Callable[[str], str], **changes: Any) -> Done:
    """``done`` with its facts (``more`` of them) and ``changes`` (its target ...)."""
    facts = more(done.facts())
    return dataclasses.replace(done, facts=lambda: facts, **changes)


def node_pid(injector: Injector, system: str, node: int) -> int:
    """The pid of node ``node`` (1-3) of the three-node ``system`` (``nats``, ``kafka``),
    as ``scripts/services SYSTEM status`` reports it."""
    status = injector.services.run(system, "status").splitlines()
    return int(status[node - 1].split(" pid ")[1].split()[0])


def node_kill(
    injector: Injector,
    system: str,
    number: int,
    destination: str,
    wait: float,
    *,
    role: str,
    now: Callable[[], str],
) -> Done:
    """SIGKILL node ``number`` of ``system`` (``nats`` or ``kafka``: node n3 or k3; its
    ``role`` said in the facts) and stage an event of the runner's to ``destination``; a few
    seconds later wait up to ``wait`` seconds for that event to be published (through the
    other nodes), then start the node again. The fault is ``stranded`` when the event was
    not published; its facts end with what was seen of the event and ``now()``, the
    system once it recovered (who leads)."""
    from . import database as db

    pid = node_pid(injector, system, number)
    staged: list[str] = []
    failover: list[float | None] = []

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        staged.append(db.stage_order(destination))

    def start() -> None:
        failover.append(db.published_within(staged[0], wait))
        injector.services.run(system, "start-node", str(number))

    hold = injector.rng.uniform(*NODE_DOWN)
    target = f"{system[0]}{number}"
    what = f"{target} ({role}) SIGKILLed, started again after {hold:.1f}s"
    done = spell(injector, system, kill, start, hold, what)
    seen = (
        f"not published within {wait:.0f}s"
        if failover[0] is None
        else f"published through the other nodes after {failover[0]:.1f}s more"
    )
    return with_facts(
        done,
        lambda facts: f"{facts}; an event staged once it was down was {seen}; {now()}",
        target=target,
        stranded=int(failover[0] is None),
    )


def cluster_down(injector: Injector, system: str) -> Done:
    """Stop every node of the three-node ``system`` (their data kept) for a few seconds,
    then start them together."""
    services = injector.services
    hold = injector.rng.uniform(*DOWN)
    took: list[float] = []

    def stop() -> None:
        services.run(system, "stop-nodes")

    def start() -> None:
        began = time.monotonic()
        services.run(system, "start-nodes")
        took.append(time.monotonic() - began)

    done = spell(injector, system, stop, start, hold, f"every node down for {hold:.1f}s")
    return with_facts(done, lambda facts: f"{facts}; the nodes started in {took[0]:.1f}s")


def _outage_lines(log: Path) -> tuple[int, int]:
    return len(lines(log, "outbox.broker_down")), len(lines(log, "outbox.broker_up"))
