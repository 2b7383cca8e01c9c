"""The chaos suite on a three-node NATS JetStream cluster (``scripts/services nats``).

Two destinations publish to one stream, ``STREAM`` (three replicas, subjects
``chaos.nats.>``): ``NATS``, keyless, and ``NATS_ORDERED``, an ordered route (broker
alias ``nats``; see chaos.settings). One producer stages its events there. No consumer
reads the stream during a run: the runner creates the stream afresh at the start, and
at the end :func:`read` reads it from its first message with nats-py (a consumer of its
own, not ``run_outbox_consumer``), into the audit's ``BrokerCopy`` and ``OrderedCopy``
as the taps' copies.

The faults (one at a time, as every other): the node holding the stream's leader
SIGKILLed, then started again (the runner stages an event of its own once the node is
down and waits for it to be published through the other two: the audit's "NATS node
kills with nothing published through the other nodes"); the stream's leader moved
(``$JS.API.STREAM.LEADER.STEPDOWN.<stream>``); the whole cluster stopped for a few
seconds, its data kept, and started again. None of them is a publish failure of a row:
each measures the attempts spent, as the broker faults do (:func:`chaos.broker.spell`).
The relay's SIGKILL between publish and mark is chaos.faults' ``relay_kill``: the kill it
aims between publish and finalize waits until the relay holds NATS rows already in the
stream (:func:`stored`), which the next relay publishes again, and the stream must keep
one copy of each (its duplicate window, ``WINDOW``, is longer than a run's lease and
outages).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from django_outbox.conf.brokers import nats_servers

from .destinations import NATS, NATS_STREAM

if TYPE_CHECKING:
    from .faults import Done, Injector

T = TypeVar("T")
KINDS = ("nats_node_kill", "nats_leader_move", "nats_down")
SUBJECTS = ["chaos.nats.>"]
#: The stream's duplicate window (seconds): longer than a run's lease plus its longest
#: outage, so that every copy a relay publishes again is within it.
WINDOW = 600.0
#: Seconds the runner's own event may take to be published while a node is down.
FAILOVER_WAIT = 20.0
#: Messages at the end of the stream :func:`stored` looks through (about 100 s of a run).
TAIL = 1000
TIMEOUT = 10.0


def _run(url: str, work: Callable[[Any, Any], Awaitable[T]]) -> T:
    """``work(client, jetstream)`` on a connection of its own, closed afterwards."""
    import nats

    async def connected() -> T:
        client = await nats.connect(
            nats_servers(url), connect_timeout=2, max_reconnect_attempts=2, name="chaos runner"
        )
        try:
            return await work(client, client.jetstream(timeout=TIMEOUT))
        finally:
            await client.close()

    return asyncio.run(connected())


def reset_stream(url: str) -> None:
    """Delete what an earlier run left, and create the stream afresh."""
    from nats.js.errors import NotFoundError

    async def reset(client: Any, js: Any) -> None:
        try:
            await js.delete_stream(NATS_STREAM)
        except NotFoundError:
            pass
        await js.add_stream(
            name=NATS_STREAM, subjects=SUBJECTS, num_replicas=3, duplicate_window=WINDOW
        )

    _run(url, reset)


def messages(url: str, tail: int | None = None) -> list[tuple[int, dict[str, str]]]:
    """The stream's messages (the last ``tail`` of them, or all), each its sequence in
    the stream and its headers, read with an ephemeral consumer."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    async def read(client: Any, js: Any) -> list[tuple[int, dict[str, str]]]:
        last = (await js.stream_info(NATS_STREAM)).state.last_seq
        first = max(1, last - tail + 1) if tail else 1
        found: list[tuple[int, dict[str, str]]] = []
        if not last:
            return found
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=first,
            inactive_threshold=60.0,
            mem_storage=True,
        )
        sub = await js.pull_subscribe(">", stream=NATS_STREAM, config=config)
        while not found or found[-1][0] < last:
            for msg in await sub.fetch(batch=1000, timeout=TIMEOUT):
                found.append((msg.metadata.sequence.stream, dict(msg.headers or {})))
        await sub.unsubscribe()
        return found

    return _run(url, read)


def read(url: str) -> int:
    """Read the whole stream into the audit's copies (:func:`chaos.audit.record_read`; by
    the ``event_id`` header: a relay that sent no ``Nats-Msg-Id`` still names its event
    there), in stream order; the messages read."""
    from .audit import record_read

    found = messages(url)
    record_read([headers for _, headers in found])
    return len(found)


def stored(url: str, event_ids: Iterable[str]) -> int:
    """How many of ``event_ids`` are among the last ``TAIL`` messages of the stream."""
    wanted = set(event_ids)
    if not wanted:
        return 0
    return len(wanted & {headers["event_id"] for _, headers in messages(url, TAIL)})


def leader(url: str) -> str:
    """The server holding the stream's leader (``n1``..``n3``; "" during an election)."""

    async def ask(client: Any, js: Any) -> str:
        info = await js.stream_info(NATS_STREAM)
        return (info.cluster.leader if info.cluster else None) or ""

    return _run(url, ask)


def _leader_within(url: str, seconds: float, unlike: str = "") -> str:
    """The stream's leader once it has one (other than ``unlike``), asked until
    ``seconds`` have passed ("" if none by then)."""
    import nats.errors

    deadline = time.monotonic() + seconds
    while True:
        try:
            now = leader(url)
        except (TimeoutError, nats.errors.Error, OSError):
            now = ""
        if (now and now != unlike) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def _step_down(url: str) -> dict[str, Any]:
    async def ask(client: Any, js: Any) -> dict[str, Any]:
        reply = await client.request(
            f"$JS.API.STREAM.LEADER.STEPDOWN.{NATS_STREAM}", b"", timeout=TIMEOUT
        )
        answer: dict[str, Any] = json.loads(reply.data)
        return answer

    return _run(url, ask)


def node_kill(injector: Injector) -> Done:
    """SIGKILL the node holding the stream's leader and stage an event of the runner's;
    a few seconds later wait for that event to be published (through the other two
    nodes), then start the node again."""
    from .broker import node_kill

    url = injector.services.nats_url
    was = _leader_within(url, TIMEOUT)
    node = int(was.removeprefix("n") or injector.rng.choice("123"))

    def now() -> str:
        return f"the leader is now on {_leader_within(url, TIMEOUT) or 'nobody'}"

    return node_kill(
        injector, "nats", node, NATS, FAILOVER_WAIT, role="the stream's leader", now=now
    )


def leader_move(injector: Injector) -> Done:
    """Have the stream's leader step down, and wait until another node leads it."""
    from .broker import spell, with_facts

    url = injector.services.nats_url
    was = _leader_within(url, TIMEOUT)
    moved: list[str] = []

    def step_down() -> None:
        began = time.monotonic()
        answer = _step_down(url)
        now = _leader_within(url, TIMEOUT, unlike=was)
        error = answer.get("error") or {}
        moved.append(
            f"{error.get('description', 'accepted')}; the leader moved from {was} to "
            f"{now or 'nobody'} in {time.monotonic() - began:.1f}s"
        )

    done = spell(injector, "nats", step_down, lambda: None, 0.0, "stream leader step-down")
    return with_facts(done, lambda facts: f"{facts}; {moved[0]}", target=was)


def cluster_down(injector: Injector) -> Done:
    """Stop every node (their data kept) for a few seconds, then start them together."""
    from .broker import cluster_down as down

    return dataclasses.replace(down(injector, "nats"), target="nats")
