"""NATS JetStream (issue 45): the relay against nats-py alone on the same cluster.

The ceiling (:func:`raw_batches`) is nats-py publishing the relay's messages (the same
body, headers of the same shape as text, ``Nats-Msg-Id``) to a stream of one replica,
``batch`` at once with their PubAcks awaited together, from one asyncio program: what the
relay does, without the database, the outbox's rows and the hand-over between the relay's
thread and its event loop's. The relay drains to its default route (a stream of one
replica made on first use). Runs only when ``OUTBOX_NATS_URL`` names a cluster
(``scripts/services nats start``).

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

from .common import BODY, wire_headers


def _text_headers() -> dict[str, str]:
    """:func:`~benchmarks.common.wire_headers` as the relay sends them on NATS."""
    headers = {
        name: value if isinstance(value, str) else json.dumps(value)
        for name, value in wire_headers().items()
        if value is not None
    }
    headers["Nats-Msg-Id"] = headers["event_id"]
    return headers


def raw_batches(url: str, count: int, batch: int) -> float:
    """nats-py alone: ``count`` messages, ``batch`` in flight at once; msg/s."""

    async def run() -> float:
        import nats

        nc = await nats.connect(nats_servers(url))
        js = nc.jetstream()
        stream = f"bench_raw_{uuid.uuid4().hex[:8]}"
        await js.add_stream(name=stream, subjects=[stream])
        headers = [_text_headers() for _ in range(count)]
        started = time.perf_counter()
        for start in range(0, count, batch):
            await asyncio.gather(
                *(
                    js.publish(stream, BODY, stream=stream, headers=h)
                    for h in headers[start : start + batch]
                )
            )
        rate = count / (time.perf_counter() - started)
        await js.delete_stream(stream)
        await nc.close()
        return rate

    return asyncio.run(run())


def end_to_end(
    env: dict[str, str], url: str, *, rate: float, seconds: float, per_commit: int
) -> dict[str, float]:
    """Commit-to-consumer latency through NATS JetStream at ``rate`` events/s,
    ``per_commit`` a transaction: figures ``nats_e2e_1000_*`` (see
    :func:`benchmarks.scenarios.end_to_end`). The stream (the default route's: named as
    the destination, one replica) is made beforehand, so the consumer can subscribe."""
    from . import scenarios

    scenarios.reset_outbox()
    to = scenarios.destination("nats_e2e").replace("-", "_")
    _create_stream(url, to)
    consumer = scenarios.Worker(
        env, "consume-nats", "--url", url, "--queue", to, "--timeout", str(seconds + 60)
    )
    try:
        return scenarios.measure_end_to_end(
            env, url, to, consumer, rate=rate, seconds=seconds, name="nats_e2e_1000",
            per_commit=per_commit,
        )  # fmt: skip
    finally:
        delete_stream(url, to)


def _create_stream(url: str, stream: str) -> None:
    async def run() -> None:
        import nats

        nc = await nats.connect(nats_servers(url))
        try:
            await nc.jetstream().add_stream(name=stream, subjects=[stream])
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


def figures(rounds: list[tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """The figures of (ceiling, relay drain) rounds."""
    import statistics

    ratios = [drain["events_per_s"] / top for top, drain in rounds]
    return {
        "raw_nats_msgs_per_s": statistics.median(top for top, _ in rounds),
        "relay_nats_ev_per_s": statistics.median(d["events_per_s"] for _, d in rounds),
        "relay_nats_cpu_us_per_event": statistics.median(d["cpu_us_per_event"] for _, d in rounds),
        "nats_vs_raw": statistics.median(ratios),
        "nats_vs_raw_rounds": ratios,
    }
