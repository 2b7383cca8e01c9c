"""The raw ceilings: the broker driven as fast as kombu (or redis-py) allows, no database.

Each one publishes the relay's message (same body, headers of the same shape,
persistent) to a durable queue bound to the same exchange as the relay's default
route, so the relay's figures can be divided by these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any

import kombu

from .common import BODY, EXCHANGE, bound_queue, wire_headers

CONTENT = {"content_type": "application/json", "content_encoding": "utf-8"}


@contextlib.contextmanager
def bench_queue(url: str, prefix: str) -> Iterator[tuple[kombu.Connection, str]]:
    """A connection and a fresh durable queue bound like the relay's default route;
    the queue is deleted afterwards."""
    name = f"bench-{prefix}-{uuid.uuid4().hex[:8]}"
    with kombu.Connection(url) as connection:
        queue = bound_queue(name)
        queue(connection.default_channel).declare()
        try:
            yield connection, name
        finally:
            queue(connection.default_channel).delete()


def _publish_each(
    connection: kombu.Connection, name: str, headers: list[dict[str, Any]], **options: Any
) -> float:
    """One ``Producer.publish`` per message, as kombu users write it; returns msg/s."""
    producer = kombu.Producer(connection.channel(), auto_declare=False)
    started = time.perf_counter()
    for header in headers:
        producer.publish(
            BODY,
            exchange=EXCHANGE,
            routing_key=name,
            headers=header,
            delivery_mode=2,
            message_id=header["event_id"],
            retry=False,
            **CONTENT,
            **options,
        )
    return len(headers) / (time.perf_counter() - started)


def confirm_each(url: str, count: int) -> float:
    """kombu's own confirm mode: every publish waits for its confirm."""
    headers = [wire_headers() for _ in range(count)]
    with (
        bench_queue(url, "each") as (_, name),
        kombu.Connection(url, transport_options={"confirm_publish": True}) as connection,
    ):
        return _publish_each(connection, name, headers, mandatory=True)


class _Acks:
    """Delivery tags not yet confirmed; a ``multiple`` ack settles every tag up to it."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.floor = 1

    def on_ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            self.pending.difference_update(range(self.floor, tag + 1))
            self.floor = max(self.floor, tag + 1)
        else:
            self.pending.discard(tag)

    def on_nack(self, tag: int, multiple: bool) -> None:
        raise RuntimeError(f"the broker nacked delivery tag {tag}")


@dataclasses.dataclass(frozen=True)
class Ceiling:
    """A raw publisher's run: its rate, and the CPU its thread spent per message."""

    msgs_per_s: float
    cpu_us_per_msg: float


def confirm_batch(url: str, count: int, batch: int) -> Ceiling:
    """Publish ``batch`` messages without waiting, then wait for all their confirms.
    Its CPU is this thread's alone (``time.thread_time``): the publisher is one thread,
    and the runner's other threads, if any, are not counted against it."""
    headers = [wire_headers() for _ in range(count)]
    with bench_queue(url, "batch") as (connection, name):
        channel = connection.channel()
        channel.confirm_select()
        acks = _Acks()
        channel.events["basic_ack"].add(acks.on_ack)
        channel.events["basic_nack"].add(acks.on_nack)
        tag = 0
        started, cpu_started = time.perf_counter(), time.thread_time()
        for start in range(0, count, batch):
            for header in headers[start : start + batch]:
                tag += 1
                acks.pending.add(tag)
                channel.basic_publish(
                    _amqp_message(channel, header), EXCHANGE, name, mandatory=True
                )
            while acks.pending:
                connection.drain_events(timeout=30)
        cpu, elapsed = time.thread_time() - cpu_started, time.perf_counter() - started
        return Ceiling(msgs_per_s=count / elapsed, cpu_us_per_msg=cpu / count * 1e6)


def no_confirm(url: str, count: int) -> float:
    """Publish without confirms: how fast py-amqp writes to the socket."""
    headers = [wire_headers() for _ in range(count)]
    with bench_queue(url, "noconfirm") as (connection, name):
        channel = connection.channel()
        started = time.perf_counter()
        for header in headers:
            channel.basic_publish(_amqp_message(channel, header), EXCHANGE, name, mandatory=True)
        return count / (time.perf_counter() - started)


def _amqp_message(channel: Any, header: dict[str, Any]) -> Any:
    return channel.prepare_message(
        BODY,
        headers=header,
        properties={"delivery_mode": 2, "message_id": header["event_id"]},
        **CONTENT,
    )


def kombu_redis(url: str, count: int) -> float:
    """kombu's Redis transport, one ``Producer.publish`` per message: the kombu Redis ceiling."""
    headers = [wire_headers() for _ in range(count)]
    with bench_queue(url, "redis") as (connection, name):
        return _publish_each(connection, name, headers)


def redis_pipeline(url: str, count: int, batch: int) -> float:
    """redis-py alone: LPUSH of kombu-sized messages, ``batch`` per pipeline."""
    import redis
    from kombu.utils.json import dumps

    with bench_queue(url, "pipeline") as (connection, name):
        channel = connection.channel()
        message = channel.prepare_message(BODY, headers=wire_headers(), **CONTENT)
        channel._inplace_augment_message(message, EXCHANGE, name)  # kombu's wire form
        encoded = dumps(message)
        client = redis.Redis.from_url(url)
        started = time.perf_counter()
        for start in range(0, count, batch):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(batch, count - start)):
                pipe.lpush(name, encoded)
            pipe.execute()
        rate = count / (time.perf_counter() - started)
        client.close()
        return rate
