"""Processes the runner starts, each reporting one JSON line on stdout.

    python -m benchmarks.worker relay --url URL --batch-size N [--drain] [--profile FILE]
        [--telemetry]
    python -m benchmarks.worker consume --url URL --queue Q --timeout SECONDS
    python -m benchmarks.worker consume-nats --url NATS_URL --queue STREAM --timeout SECONDS
    python -m benchmarks.worker consume-kafka --url KAFKA_URL --queue TOPIC --timeout SECONDS
    python -m benchmarks.worker produce --destination D --rate R --seconds S --first F --step K
        --per-commit N

A worker sets itself up (Django, broker connection), prints ``ready``, and waits for
a line on stdin, so that the runner can start several together and time only the
work. A relay without ``--drain`` runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

from .common import broker_cpu_seconds, emit, rss_mb
from .pgcost import server_cpu_seconds


def _spent(before: float | None, after: float | None) -> float | None:
    """The CPU seconds between two readings (None: one was not read)."""
    return None if before is None or after is None else after - before


def _ready() -> None:
    print("ready", flush=True)
    sys.stdin.readline()


class SqlCounter:
    """Counts what the process's database connections send while ``counting()``: each
    executed statement, and each explicit transaction as two more (BEGIN, COMMIT).

    Connections opened meanwhile (the relay's finisher thread has its own) are
    counted too."""

    def __init__(self) -> None:
        self.statements = 0
        self.transactions = 0
        self._active = False
        self._lock = threading.Lock()

    def install(self, connection: Any) -> None:
        connection.execute_wrappers.append(self._execute)
        commit = connection.commit

        def counted_commit() -> None:
            self._count(transactions=1)
            commit()

        connection.commit = counted_commit  # transaction.atomic commits through this

    def connected(self, sender: object, connection: Any, **kwargs: Any) -> None:
        """``connection_created`` receiver."""
        self.install(connection)

    def _execute(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        self._count(statements=1)
        return execute(sql, params, many, context)

    def _count(self, *, statements: int = 0, transactions: int = 0) -> None:
        if self._active:
            with self._lock:
                self.statements += statements
                self.transactions += transactions

    @property
    def total(self) -> int:
        return self.statements + 2 * self.transactions

    @contextlib.contextmanager
    def counting(self) -> Iterator[SqlCounter]:
        self._active = True
        try:
            yield self
        finally:
            self._active = False


@contextlib.contextmanager
def _profiled(path: str | None) -> Iterator[None]:
    """Profile the block with pyinstrument (the dev extra) into ``path`` (.txt and .html)."""
    if not path:
        yield
        return
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.0005)
    with profiler:
        yield
    with open(path, "w") as text:
        text.write(profiler.output_text(unicode=True, color=False, show_all=False))
    with open(os.path.splitext(path)[0] + ".html", "w") as html:
        html.write(profiler.output_html())


@contextlib.contextmanager
def _telemetry(on: bool) -> Iterator[Callable[[Any], None] | None]:
    """With ``on``: metrics and tracing switched on (:mod:`benchmarks.telemetry`)."""
    if not on:
        yield None
        return
    from .telemetry import switched_on

    with switched_on() as on_batch:
        yield on_batch


def relay(args: argparse.Namespace) -> None:
    import django

    django.setup()
    from django.db import connection
    from django.db.backends.signals import connection_created

    from django_outbox.relay import Relay
    from django_outbox.transports import transport_class

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # The transport the relay would build for this URL's scheme (Redis: pipelined).
    transport = transport_class(urlsplit(args.url).scheme)(args.url)
    transport.check()
    counter = SqlCounter()
    connection.ensure_connection()
    counter.install(connection)
    connection_created.connect(counter.connected)
    worker = Relay(batch_size=args.batch_size, transports={"default": transport})
    worker.recover()  # a transactional route's producer started (init_transactions), untimed
    with _telemetry(args.telemetry) as on_batch:
        _ready()
        rss_start, started, cpu_started = rss_mb(), time.time(), time.process_time()
        brokers_started, server_started = broker_cpu_seconds(args.url), server_cpu_seconds()
        with _profiled(args.profile), counter.counting():
            totals = worker.run(stop, drain=args.drain, on_batch=on_batch)
        finished, cpu = time.time(), time.process_time() - cpu_started
        brokers, server = broker_cpu_seconds(args.url), server_cpu_seconds()
    emit(
        {
            "published": totals.published,
            "failed": totals.failed + totals.abandoned + totals.lost,
            "started": started,
            "finished": finished,
            "cpu_s": cpu,  # user + system, every thread of the process
            # PostgreSQL's and the brokers' (Kafka, NATS) meanwhile, on this machine
            "pg_cpu_s": _spent(server_started, server),
            "broker_cpu_s": _spent(brokers_started, brokers),
            "rss_start_mb": rss_start,
            "rss_end_mb": rss_mb(),
            "sql": counter.total,
            "statements": counter.statements,
            "transactions": counter.transactions,
        }
    )


def _expected(now: int | None) -> int | None:
    """How many events to receive: ``now``, or the N of an ``expect N`` line the runner
    wrote to stdin since (once the producers are done it knows how many they committed)."""
    if now is None and select.select([sys.stdin], [], [], 0)[0]:
        line = sys.stdin.readline().split()  # "" at EOF: the runner closed stdin, no count
        return int(line[1]) if line else now
    return now


def consume(args: argparse.Namespace) -> None:
    """Receive events from ``--queue`` until the runner says how many to expect and that
    many came (or ``--timeout``); report each one's ``seq`` and receipt time (wall clock,
    comparable with the producers' commit times)."""
    import kombu

    received: dict[int, float] = {}

    def on_message(body: Any, message: Any) -> None:
        received[body["seq"]] = time.time()
        message.ack()

    with kombu.Connection(args.url) as connection:
        queue = kombu.Queue(args.queue, no_declare=True)
        with kombu.Consumer(
            connection, queues=[queue], callbacks=[on_message], accept=["json"], prefetch_count=100
        ):
            _ready()
            deadline, expected = time.monotonic() + args.timeout, None
            while (expected is None or len(received) < expected) and time.monotonic() < deadline:
                with contextlib.suppress(socket.timeout, TimeoutError):
                    connection.drain_events(timeout=0.5)
                expected = _expected(expected)
    emit({"received": {str(seq): at for seq, at in received.items()}})


def consume_nats(args: argparse.Namespace) -> None:
    """:func:`consume`, from the NATS JetStream stream ``--queue`` (nats-py's push
    subscription, each message acked)."""
    import asyncio
    import json

    received: dict[int, float] = {}

    async def run() -> None:
        import nats

        from django_outbox.conf.brokers import nats_servers

        nc = await nats.connect(nats_servers(args.url))

        async def on_message(message: Any) -> None:
            received[json.loads(message.data)["seq"]] = time.time()
            await message.ack()

        # nats-py creates the push consumer before it subscribes to the consumer's delivery
        # subject, and the consumer delivers nothing until its server sees that
        # subscription: right after subscribe() the server did not report it bound in about
        # half the starts (2026-11-29). An ephemeral consumer without interest is deleted
        # after its inactive threshold (5 s by default): one that never saw the subscription
        # in time delivered nothing at all. Ready only once the server reports it bound, and
        # kept for the whole run.
        js = nc.jetstream()
        subscription = await js.subscribe(
            args.queue, stream=args.queue, cb=on_message, inactive_threshold=args.timeout
        )
        await _bound(subscription, time.monotonic() + 30)
        _ready()
        deadline, expected = time.monotonic() + args.timeout, None
        while (expected is None or len(received) < expected) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            expected = _expected(expected)
        await nc.close()

    asyncio.run(run())
    emit({"received": {str(seq): at for seq, at in received.items()}})


def consume_kafka(args: argparse.Namespace) -> None:
    """:func:`consume`, from every partition of the Kafka topic ``--queue``, from its
    beginning (confluent-kafka's consumer, assigned the partitions: no group to join),
    reading committed records only."""
    import json

    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from django_outbox.conf.brokers import kafka_bootstrap

    received: dict[int, float] = {}
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap(args.url),
            "group.id": f"bench-{args.queue}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.wait.max.ms": 10,
        }
    )
    partitions = consumer.list_topics(args.queue, timeout=30).topics[args.queue].partitions
    consumer.assign([TopicPartition(args.queue, p, OFFSET_BEGINNING) for p in partitions])
    _ready()
    deadline, expected = time.monotonic() + args.timeout, None
    while (expected is None or len(received) < expected) and time.monotonic() < deadline:
        record = consumer.poll(0.2)  # (consume(n) would wait for n records or its timeout)
        if record is not None and record.error() is None:
            received[json.loads(record.value())["seq"]] = time.time()
        expected = _expected(expected)
    consumer.close()
    emit({"received": {str(seq): at for seq, at in received.items()}})


async def _bound(subscription: Any, deadline: float) -> None:
    """Wait until the server reports ``subscription``'s push consumer bound to it (its
    delivery subject has interest); ``RuntimeError`` at ``deadline`` (monotonic)."""
    import asyncio

    while not (await subscription.consumer_info()).push_bound:
        if time.monotonic() > deadline:
            raise RuntimeError("the NATS push consumer never saw its subscription")
        await asyncio.sleep(0.05)


def produce(args: argparse.Namespace) -> None:
    """Commit this producer's share of the events (:func:`benchmarks.scenarios.produce`);
    report when it started and each event's commit time (wall clock)."""
    import django

    django.setup()
    from .scenarios import produce as commit_events

    _ready()
    started = time.time()
    committed = commit_events(
        args.destination,
        rate=args.rate,
        seconds=args.seconds,
        first=args.first,
        step=args.step,
        per_commit=args.per_commit,
    )
    emit({"started": started, "committed": {str(seq): at for seq, at in committed.items()}})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    modes = parser.add_subparsers(dest="mode", required=True)
    relay_parser = modes.add_parser("relay")
    relay_parser.add_argument("--url", required=True)
    relay_parser.add_argument("--batch-size", type=int, required=True)
    relay_parser.add_argument("--drain", action="store_true")
    relay_parser.add_argument("--profile", default=None)
    relay_parser.add_argument("--telemetry", action="store_true")
    relay_parser.set_defaults(run=relay)
    consume_parser = modes.add_parser("consume")
    consume_parser.add_argument("--url", required=True)
    consume_parser.add_argument("--queue", required=True)
    consume_parser.add_argument("--timeout", type=float, required=True)
    consume_parser.set_defaults(run=consume)
    nats_parser = modes.add_parser("consume-nats")
    nats_parser.add_argument("--url", required=True)
    nats_parser.add_argument("--queue", required=True, help="the stream and its one subject")
    nats_parser.add_argument("--timeout", type=float, required=True)
    nats_parser.set_defaults(run=consume_nats)
    kafka_parser = modes.add_parser("consume-kafka")
    kafka_parser.add_argument("--url", required=True)
    kafka_parser.add_argument("--queue", required=True, help="the topic")
    kafka_parser.add_argument("--timeout", type=float, required=True)
    kafka_parser.set_defaults(run=consume_kafka)
    produce_parser = modes.add_parser("produce")
    produce_parser.add_argument("--destination", required=True)
    produce_parser.add_argument("--rate", type=float, required=True)
    produce_parser.add_argument("--seconds", type=float, required=True)
    produce_parser.add_argument("--first", type=int, required=True)
    produce_parser.add_argument("--step", type=int, required=True)
    produce_parser.add_argument("--per-commit", type=int, default=1)
    produce_parser.set_defaults(run=produce)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
