"""NATS JetStream (issue 45): the relay against nats-py alone on the same cluster.

The ceiling (:func:`raw_batches`) is nats-py publishing the relay's messages (the same
body, headers of the same shape as text, ``Nats-Msg-Id``, the stream expected) to a
stream of one replica, ``batch`` at once with their PubAcks awaited together, from one
asyncio program, as the relay publishes them: each message with a reply subject under one
inbox subscribed to once, each PubAck read (an error in one fails the run). That is the
relay's work without the database, the outbox's rows, their encoding and the hand-over
between the relay's thread and its event loop's. :func:`raw_requests` is the same with
nats-py's ``js.publish`` (a request per message: a task, a future and a timer each), a
batch gathered: what the relay did until 2026-11-29, kept as a second reference. The
relay drains to its default route (a stream of one replica, made before the relay starts,
as the ceilings make theirs before their clocks start). Runs only when ``OUTBOX_NATS_URL``
names a cluster (``scripts/services nats start``).

The commit-to-consumer latency (:func:`end_to_end`) is measured as RabbitMQ's
(:func:`benchmarks.scenarios.end_to_end`): producers commit at a rate, a relay woken by
NOTIFY publishes, and a consumer of nats-py's (a push subscription to the stream, each
message acked) notes when each event came.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from django_outbox.conf.brokers import nats_servers

from .common import BODY, CpuMeter, cpu_figures, median, wire_headers


def _text_headers(stream: str) -> dict[str, str]:
    """:func:`~benchmarks.common.wire_headers` as the relay sends them on NATS."""
    headers = {
        name: value if isinstance(value, str) else json.dumps(value)
        for name, value in wire_headers().items()
        if value is not None
    }
    headers["Nats-Msg-Id"] = headers["event_id"]
    headers["Nats-Expected-Stream"] = stream
    return headers


def raw_batches(url: str, count: int, batch: int) -> dict[str, Any]:
    """nats-py alone, publishing as the relay does: ``count`` messages, ``batch`` sent
    with a reply subject each under one inbox, then their PubAcks awaited (:func:`_timed`'s
    figures)."""

    async def publish(nc: Any, stream: str, headers: list[dict[str, str]]) -> None:
        inbox, waiting, refusals = nc.new_inbox(), set(), []
        done = asyncio.get_running_loop().create_future()

        async def on_reply(reply: Any) -> None:
            waiting.discard(reply.subject)
            if "error" in json.loads(reply.data):
                refusals.append(reply.data)
            if not waiting:
                done.set_result(None)

        await nc.subscribe(f"{inbox}.*", cb=on_reply)
        for start in range(0, count, batch):
            for number in range(start, min(start + batch, count)):
                waiting.add(reply := f"{inbox}.{number}")
                await nc.publish(stream, BODY, reply=reply, headers=headers[number])
            await asyncio.wait_for(done, 30)
            done = asyncio.get_running_loop().create_future()
        if refusals:
            raise RuntimeError(f"the stream refused {len(refusals)} messages: {refusals[0]!r}")

    return _timed(url, count, publish)


def raw_requests(url: str, count: int, batch: int) -> dict[str, Any]:
    """nats-py alone with ``js.publish`` (a request per message): ``batch`` of them
    gathered at once (:func:`_timed`'s figures)."""

    async def publish(nc: Any, stream: str, headers: list[dict[str, str]]) -> None:
        js = nc.jetstream()
        for start in range(0, count, batch):
            await asyncio.gather(
                *(js.publish(stream, BODY, headers=h) for h in headers[start : start + batch])
            )

    return _timed(url, count, publish)


def _timed(url: str, count: int, publish: Any) -> dict[str, Any]:
    """``publish(nc, stream, headers)`` of ``count`` messages to a fresh stream of one
    replica (deleted after), timed: ``msgs_per_s``, and :class:`~benchmarks.common.
    CpuMeter`'s CPU per message of this process (its event loop is this thread) and of
    the NATS servers."""

    async def run() -> dict[str, Any]:
        import nats

        nc = await nats.connect(nats_servers(url))
        js = nc.jetstream()
        stream = f"bench_raw_{uuid.uuid4().hex[:8]}"
        await js.add_stream(name=stream, subjects=[stream])
        headers = [_text_headers(stream) for _ in range(count)]
        meter, started = CpuMeter(url), time.perf_counter()
        await publish(nc, stream, headers)
        rate = count / (time.perf_counter() - started)
        spent = meter.per_message(count)
        stored = (await js.stream_info(stream)).state.messages
        await js.delete_stream(stream)
        await nc.close()
        if stored != count:
            raise RuntimeError(f"the stream holds {stored} messages, not {count}")
        return {"msgs_per_s": rate, **spent}

    return asyncio.run(run())


def end_to_end(
    env: dict[str, str], url: str, *, rate: float, seconds: float, per_commit: int
) -> dict[str, float]:
    """Commit-to-consumer latency through NATS JetStream at ``rate`` events/s,
    ``per_commit`` a transaction: figures ``nats_e2e_1000_*`` (see
    :func:`benchmarks.scenarios.end_to_end`). The stream (the default route's: named as
    the destination, one replica) is made beforehand, so the consumer can subscribe."""
    from . import scenarios

    to = scenarios.destination("nats_e2e").replace("-", "_")
    return scenarios.consumed_end_to_end(
        env, url, to, "consume-nats", (create_stream, delete_stream),
        rate=rate, seconds=seconds, name="nats_e2e_1000", per_commit=per_commit,
    )  # fmt: skip


def create_stream(url: str, destination: str) -> None:
    """Create the stream the relay's default route takes for ``destination`` (one replica,
    the route's subject), as the relay would on its first publish."""

    async def run() -> None:
        import nats

        from django_outbox.conf.routes import JetStream

        nc = await nats.connect(nats_servers(url))
        try:
            stream = JetStream().stream_for(destination)
            await nc.jetstream().add_stream(name=stream, subjects=[destination])
        finally:
            await nc.close()

    asyncio.run(run())


def delete_stream(url: str, destination: str) -> None:
    """Delete the stream the relay made for ``destination`` (its default route's)."""

    async def run() -> None:
        import nats
        from nats.js.errors import NotFoundError

        from django_outbox.conf.routes import JetStream

        nc = await nats.connect(nats_servers(url))
        try:
            await nc.jetstream().delete_stream(JetStream().stream_for(destination))
        except NotFoundError:
            pass
        finally:
            await nc.close()

    asyncio.run(run())


def figures(rounds: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The figures of (ceiling, request ceiling, relay drain) rounds."""
    ratios = [drain["events_per_s"] / top["msgs_per_s"] for top, _, drain in rounds]
    to_requests = [drain["events_per_s"] / r["msgs_per_s"] for _, r, drain in rounds]
    return {
        "raw_nats_msgs_per_s": median(top["msgs_per_s"] for top, _, _ in rounds),
        "raw_nats_request_msgs_per_s": median(r["msgs_per_s"] for _, r, _ in rounds),
        "relay_nats_ev_per_s": median(d["events_per_s"] for _, _, d in rounds),
        "relay_nats_cpu_us_per_event": median(d["cpu_us_per_event"] for _, _, d in rounds),
        "nats_vs_raw": median(ratios),
        "nats_vs_raw_rounds": ratios,
        **cpu_figures("nats", [(top, drain) for top, _, drain in rounds]),
        "nats_vs_request": median(to_requests),
        "nats_vs_request_rounds": to_requests,
    }
