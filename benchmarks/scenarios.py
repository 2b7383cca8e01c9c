"""The scenarios that involve the database: relays, staging, the claim, end-to-end latency.

They run in the runner's process (Django set up on the benchmark database), with
relays and the consumer as worker processes (:mod:`benchmarks.worker`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import math
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kombu
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F

from django_outbox import db, stage, stage_many
from django_outbox.conf import outbox_settings
from django_outbox.db import postgresql
from django_outbox.envelope import ClaimedMessage
from django_outbox.models import OutboxMessage
from django_outbox.signing import parse_keys

from .common import PAYLOAD, bound_queue
from .models import Customer, Order, OrderLine
from .pgcost import Reading
from .services import REPO
from .telemetry import creation_span

TABLE = OutboxMessage._meta.db_table
#: The key of the signed drains (a benchmark's, not a secret).
SIGNING_KEY = "benchmark-signing-key-of-32-bytes-at-least"


class Worker:
    """A ``python -m benchmarks.worker`` process: started, released with ``go()``, read back."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker", *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.process.kill()
            raise RuntimeError(f"worker {args[0]} did not start (said {line!r})")

    def go(self) -> None:
        self.send("go")

    def send(self, line: str) -> None:
        """Write ``line`` to the worker's stdin (``go``, or what its mode reads later)."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{line}\n")
        self.process.stdin.flush()

    def result(self, timeout: float) -> dict[str, Any]:
        out, _ = self.process.communicate(timeout=timeout)
        if self.process.returncode != 0:
            raise RuntimeError(f"worker exited {self.process.returncode}")
        parsed: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return parsed

    def terminate(self) -> None:
        self.process.terminate()


def destination(tag: str) -> str:
    return f"bench-{tag}-{uuid.uuid4().hex[:8]}"


def reset_outbox() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f'TRUNCATE "{TABLE}"')


def backlog(count: int, to: str, chunk: int = 2000, *, keys: int = 0, traced: bool = False) -> None:
    """Commit ``count`` events to ``to`` through ``stage_many``; with ``keys``, the events
    take keys ``0 .. keys - 1`` in turn (an ordered route needs them); ``traced``, each
    chunk under a span of its own, whose context the rows capture."""

    def event(n: int) -> dict[str, Any]:
        keyed = {"key": f"k{n % keys}"} if keys else {}
        return {"event_type": "bench.order_placed", "payload": PAYLOAD, "destination": to, **keyed}

    for start in range(0, count, chunk):
        with creation_span() if traced else contextlib.nullcontext(), transaction.atomic():
            stage_many(event(n) for n in range(start, min(start + chunk, count)))


def delete_queue(url: str, name: str) -> None:
    if url.startswith("kafka://"):
        from . import kafka

        kafka.delete_topic(url, name)
        return
    if url.startswith("nats://"):
        from . import nats

        nats.delete_stream(url, name)
        return
    with kombu.Connection(url) as broker:
        bound_queue(name)(broker.default_channel).delete()


def relay_drain(
    env: dict[str, str],
    url: str,
    count: int,
    *,
    processes: int,
    batch_size: int,
    tag: str,
    profile_dir: Path | None = None,
    keys: int = 0,
    telemetry: bool = False,
    keep_published: bool = True,
    signed: bool = False,
    envelope: str = "outbox",
    transactional: bool = False,
) -> dict[str, Any]:
    """Stage ``count`` events, then let ``processes`` relays drain them together. With
    ``keys``, the events go to the ordered route, spread over that many keys; with
    ``telemetry``, they are staged under spans and the relays run with metrics and
    tracing on (:mod:`benchmarks.telemetry`); without ``keep_published``, they delete
    each row at its confirm (``PUBLISHED_RETENTION`` 0); ``signed``, they sign every
    message (``SIGNING_KEYS``); ``envelope`` is their ``DEFAULT_ENVELOPE`` (CloudEvents).
    On Kafka the runner makes the drain's topic first (:func:`benchmarks.kafka.create_topic`);
    ``transactional``, the drain's route is a Kafka route with ``"transactional": True``.

    Returns the events/s from the first relay's start to the last one's finish, the
    relays' CPU per event, the first relay's RSS and SQL counts, what the drain cost the
    PostgreSQL server per event (:meth:`benchmarks.pgcost.Reading.cost`), and the WAL
    of staging the backlog per event (``staging_wal_bytes_per_event``)."""
    reset_outbox()
    to = settings.ORDERED if keys else destination(tag)
    if url.startswith("kafka://"):
        from . import kafka

        kafka.create_topic(url, to)
    unstaged = Reading.take(TABLE)
    backlog(count, to, keys=keys, traced=telemetry)
    if url.startswith("nats://"):  # made before the clock starts, as the ceiling's is
        from . import nats

        nats.create_stream(url, to)
    staged = Reading.take(TABLE)
    with connection.cursor() as cursor:
        cursor.execute(f'VACUUM ANALYZE "{TABLE}"')
    vacuumed = Reading.take(TABLE)
    env = {
        **env,
        "OUTBOX_BENCH_KEEP_PUBLISHED": "1" if keep_published else "0",
        "OUTBOX_BENCH_SIGNING_KEY": SIGNING_KEY if signed else "",
        "OUTBOX_BENCH_ENVELOPE": envelope,
        "OUTBOX_BENCH_TRANSACTIONAL": to if transactional else "",
    }
    results = _run_relays(env, url, processes, batch_size, tag, profile_dir, telemetry, keys > 0)
    drained = Reading.take(TABLE)
    delete_queue(url, to)
    _check_drained(tag, count, results)
    elapsed = max(r["finished"] for r in results) - min(r["started"] for r in results)
    first = results[0]
    return {
        "events_per_s": count / elapsed,
        "cpu_us_per_event": sum(r["cpu_s"] for r in results) / count * 1e6,
        "broker_cpu_us_per_event": _per_event(first["broker_cpu_s"], count),
        # the server's CPU during the first relay's drain alone, read by the relay
        # (pg_cpu_us_per_event runs from before the relays start until they have ended)
        "drain_pg_cpu_us_per_event": _per_event(first["pg_cpu_s"], count),
        "published_by_relay": [r["published"] for r in results],
        "rss_start_mb": first["rss_start_mb"],
        "rss_growth_mb": first["rss_end_mb"] - first["rss_start_mb"],
        "sql_per_event": first["sql"] / first["published"],
        "statements": first["statements"],
        "transactions": first["transactions"],
        **vacuumed.cost(drained, count),
        "staging_wal_bytes_per_event": unstaged.cost(staged, count)["wal_bytes_per_event"],
    }


def _per_event(seconds: float | None, count: int) -> float | None:
    """``seconds`` of CPU as microseconds per event (None: not read)."""
    return None if seconds is None else seconds / count * 1e6


def _check_drained(tag: str, count: int, results: list[dict[str, Any]]) -> None:
    """Raise unless the relays' ``results`` published ``count`` events and failed none."""
    published = sum(r["published"] for r in results)
    if published != count or any(r["failed"] for r in results):
        raise RuntimeError(f"{tag}: {published} of {count} published; results {results}")


def _run_relays(
    env: dict[str, str],
    url: str,
    processes: int,
    batch_size: int,
    tag: str,
    profile_dir: Path | None,
    telemetry: bool,
    ordered: bool,
) -> list[dict[str, Any]]:
    """Start ``processes`` draining relays, release them together, and read their results.
    Only with ``ordered`` do their settings have the ordered route."""
    env = {**env, "OUTBOX_BENCH_ORDERED": "1" if ordered else "0"}
    workers = []
    for number in range(processes):
        args = ["relay", "--url", url, "--batch-size", str(batch_size), "--drain"]
        if profile_dir is not None:
            args += ["--profile", str(profile_dir / f"{tag}-{number}.txt")]
        if telemetry:
            args.append("--telemetry")
        workers.append(Worker(env, *args))
    for worker in workers:
        worker.go()
    return [worker.result(timeout=3600) for worker in workers]


def unfairness(published: Sequence[int]) -> float:
    """How far the relays' shares of a drain are from even: the largest
    ``|share - 1/n| / (1/n)`` over the ``n`` relays (0: perfectly even; 1: one relay
    took twice its share, or none at all)."""
    even = 1 / len(published)
    total = sum(published)
    return max(abs(count / total - even) / even for count in published)


def _median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1000


def _timed(block: Callable[[], object]) -> float:
    started = time.perf_counter()
    block()
    return time.perf_counter() - started


def place_order(customer_id: int, to: str | None) -> None:
    """The business transaction: lock the customer, write the order and its lines,
    count it on the customer; and, with ``to``, stage ``order.placed`` there."""
    with transaction.atomic():
        customer = Customer.objects.select_for_update().get(pk=customer_id)
        order = Order.objects.create(customer=customer, total="1234.50")
        OrderLine.objects.bulk_create(
            OrderLine(order=order, sku=line["sku"], quantity=line["quantity"], price="99.90")
            for line in PAYLOAD["lines"]
        )
        Customer.objects.filter(pk=customer_id).update(orders_placed=F("orders_placed") + 1)
        if to is not None:
            _stage_order(order.pk, customer_id, to)


def _stage_order(order_id: int, customer_id: int, to: str) -> None:
    """``order.placed`` to ``to``; on the ordered route, keyed by the customer."""
    key = f"customer-{customer_id}" if to == settings.ORDERED else None
    stage("bench.order_placed", {**PAYLOAD, "order_id": order_id}, destination=to, key=key)


def insert_order(customer_id: int, to: str | None) -> None:
    """The smallest business transaction: one INSERT (and, with ``to``, one event)."""
    with transaction.atomic():
        order = Order.objects.create(customer_id=customer_id, total="1234.50")
        if to is not None:
            _stage_order(order.pk, customer_id, to)


def overhead(
    business: Callable[[int, str | None], None], rounds: int, *, to: str | None = None
) -> tuple[float, float]:
    """Median seconds of ``business`` without and with its event (to ``to``, by default
    a new unordered destination), alternated so that noise hits both alike, after a
    warm-up."""
    customer = Customer.objects.create(name="customer-000042").pk
    to = to or destination("staging")
    return compare(lambda: business(customer, None), lambda: business(customer, to), rounds)


def compare(
    first: Callable[[], None], second: Callable[[], None], rounds: int
) -> tuple[float, float]:
    """Median seconds of ``first`` and of ``second``, alternated after a warm-up."""
    for _ in range(min(rounds, 50)):
        first()
        second()
    first_s, second_s = [], []
    for _ in range(rounds):
        first_s.append(_timed(first))
        second_s.append(_timed(second))
    return statistics.median(first_s), statistics.median(second_s)


def staging(rounds: int, many: int) -> dict[str, float]:
    """The cost of staging one event in a business transaction; then ``stage_many``
    against a loop of ``stage()`` for ``many`` events in one transaction."""
    reset_outbox()
    without, with_event = overhead(place_order, rounds)
    lone_without, lone_with = overhead(insert_order, rounds)
    to = destination("staging")

    def in_one_insert() -> None:
        with transaction.atomic():
            stage_many(
                {"event_type": "bench.order_placed", "payload": PAYLOAD, "destination": to}
                for _ in range(many)
            )

    def in_a_loop() -> None:
        with transaction.atomic():
            for _ in range(many):
                stage("bench.order_placed", PAYLOAD, destination=to)

    many_s, loop_s = [], []
    for _ in range(7):
        many_s.append(_timed(in_one_insert))
        loop_s.append(_timed(in_a_loop))
    return {
        "business_tx_ms": without * 1000,
        "business_tx_with_event_ms": with_event * 1000,
        "staging_overhead": with_event / without,
        "staging_overhead_one_insert": lone_with / lone_without,
        "stage_many_ms": _median_ms(many_s),
        "stage_loop_ms": _median_ms(loop_s),
        "stage_many_vs_loop": statistics.median(loop_s) / statistics.median(many_s),
    }


def ordered_staging(rounds: int) -> dict[str, float]:
    """The business transactions of :func:`staging` staging their event to the ordered
    route (keyed by the customer, so the sequence counter's upsert joins the INSERT)
    against the same transactions staging it to an unordered destination, alternated."""
    reset_outbox()
    customer = Customer.objects.create(name="customer-000043").pk
    unordered = destination("staging")
    plain, ordered = compare(
        functools.partial(place_order, customer, unordered),
        functools.partial(place_order, customer, settings.ORDERED),
        rounds,
    )
    lone_plain, lone_ordered = compare(
        functools.partial(insert_order, customer, unordered),
        functools.partial(insert_order, customer, settings.ORDERED),
        rounds,
    )
    reset_outbox()
    return {
        "business_tx_with_ordered_event_ms": ordered * 1000,
        "ordered_staging_vs_unordered": ordered / plain,
        "ordered_staging_vs_unordered_one_insert": lone_ordered / lone_plain,
    }


def insert_published(count: int, *, ago: dt.timedelta = dt.timedelta(0)) -> None:
    """Insert ``count`` PUBLISHED rows as the relay leaves them (``published_at`` set,
    the CHECK constraints hold), staged, due and published ``ago`` before now, in
    statements of 200,000 rows."""
    with connection.cursor() as cursor:
        for start in range(0, count, 200_000):
            cursor.execute(
                f"""
                INSERT INTO "{TABLE}" (event_id, event_type, destination, payload, headers,
                    ordering_key, status, attempts, available_at, locked_by, lease_token,
                    last_error, created_at, published_at)
                SELECT gen_random_uuid(), 'bench.order_placed', 'bench-retained', %s::jsonb,
                    '{{}}', '', 'published', 0, now() - %s, 'bench', gen_random_uuid(), '',
                    now() - %s, now() - %s
                FROM generate_series(1, %s)
                """,
                [json.dumps(PAYLOAD), ago, ago, ago, min(200_000, count - start)],
            )


def retain(total: int) -> None:
    """Top the outbox up to ``total`` PUBLISHED rows (as retention would keep them), then
    VACUUM ANALYZE as autovacuum eventually would."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM \"{TABLE}\" WHERE status = 'published'")
        (have,) = cursor.fetchone()
    insert_published(max(total - have, 0))
    with connection.cursor() as cursor:
        cursor.execute(f'VACUUM ANALYZE "{TABLE}"')


def claim_latencies(rows: int, batch_size: int) -> list[float]:
    """Stage ``rows`` events and claim them all, batch by batch; each claim's seconds."""
    backlog(rows, destination("claim"))
    window = db.claim_window("default")  # a partitioned outbox's, as a relay reads it
    latencies = []
    while True:
        started = time.perf_counter()
        claimed = db.claim(
            "default",
            limit=batch_size,
            lease_seconds=60,
            worker="bench",
            token=uuid.uuid4(),
            window=window,
        )
        if not claimed:
            break
        latencies.append(time.perf_counter() - started)
    OutboxMessage.objects.filter(status=OutboxMessage.Status.PROCESSING).delete()
    return latencies


def claim_growth(retained: int, rows: int, batch_size: int) -> dict[str, float]:
    """Median claim latency with 1k PUBLISHED rows kept, then with ``retained``."""
    reset_outbox()
    retain(1_000)
    small = claim_latencies(rows, batch_size)
    retain(retained)
    large = claim_latencies(rows, batch_size)
    reset_outbox()
    return {
        "claim_ms_1k": _median_ms(small),
        "claim_ms_retained": _median_ms(large),
        "claim_growth": statistics.median(large) / statistics.median(small),
        "claim_rows_per_s": batch_size / statistics.median(small),
    }


def _schedule(
    total: int, first_due: dt.datetime, rate: float, to: str = "bench-scheduled", *, keyed: bool
) -> None:
    """Add ``total`` PENDING rows to ``to``, row ``g`` (from 0) due ``g / rate`` seconds
    after ``first_due``; ``keyed``, every tenth row of an ordered key (1,000 keys), so
    that both due indexes hold some. In statements of 200,000 rows, as ``stage()`` would
    write them (the trigger's NOTIFY included), without its Python work per row."""
    with connection.cursor() as cursor:
        for start in range(0, total, 200_000):
            end = min(start + 200_000, total)
            cursor.execute(
                f"""
                INSERT INTO "{TABLE}" (event_id, event_type, destination, payload, headers,
                    ordering_key, sequence, status, attempts, available_at, locked_by,
                    last_error, created_at)
                SELECT gen_random_uuid(), 'bench.reminder', %s, %s::jsonb, '{{}}',
                    CASE WHEN %s AND g %% 10 = 0 THEN 'k' || (g %% 1000) ELSE '' END,
                    CASE WHEN %s AND g %% 10 = 0 THEN g END, 'pending', 0,
                    %s::timestamptz + make_interval(secs => g / %s), '', '', now()
                FROM generate_series(%s, %s) AS g
                """,
                [to, json.dumps(PAYLOAD), keyed, keyed, first_due, rate, start, end - 1],
            )


def scheduled_claim_growth(
    scheduled: int, rows: int, batch_size: int, rounds: int
) -> dict[str, Any]:
    """Rounds of: the claim of due rows with no event scheduled, then with ``scheduled``
    events scheduled a day ahead (VACUUM ANALYZE after, as autovacuum would). Each
    claim's latency (median of the round's claims), and the shared buffers one claim of
    a batch touches (a count, where the time is noisy: a claim that walked the future
    rows would touch their pages). Figures are medians of the rounds' ratios."""
    times: list[float] = []
    buffers: list[float] = []
    latencies: dict[str, list[float]] = {"none": [], "future": []}
    for _ in range(rounds):
        reset_outbox()
        retain(1_000)
        none = (claim_latencies(rows, batch_size), _claim_buffers(batch_size))
        with connection.cursor() as cursor:
            cursor.execute("SELECT now() + interval '1 day'")
            (tomorrow,) = cursor.fetchone()
        _schedule(scheduled, tomorrow, rate=1_000.0, keyed=True)
        with connection.cursor() as cursor:
            cursor.execute(f'VACUUM ANALYZE "{TABLE}"')
        future = (claim_latencies(rows, batch_size), _claim_buffers(batch_size))
        latencies["none"] += none[0]
        latencies["future"] += future[0]
        times.append(statistics.median(future[0]) / statistics.median(none[0]))
        buffers.append(future[1] / none[1])
    reset_outbox()
    return {
        "scheduled_claim_ms_none": _median_ms(latencies["none"]),
        "scheduled_claim_ms_future": _median_ms(latencies["future"]),
        "scheduled_claim_growth": statistics.median(times),
        "scheduled_claim_growth_rounds": times,
        "scheduled_claim_buffers_growth": max(buffers),
    }


def _claim_buffers(batch_size: int) -> int:
    """The shared buffers (hit or read) one claim of a batch of due rows touches."""
    plan = claim_plan(batch_size)["Plan"]
    return int(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])


def claim_plan(batch_size: int) -> dict[str, Any]:
    """``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`` of the relay's claim of a batch of due
    rows, rolled back: its plan, with its planning and execution times."""
    to = destination("buffers")
    backlog(batch_size, to)
    params = [batch_size] * 4 + [outbox_settings.MAX_BATCH_BYTES, 60, "bench", uuid.uuid4()]
    window = db.claim_window("default")
    with transaction.atomic(), connection.cursor() as cursor:
        # The relay's whole claim, as the tests read it (its text is the package's own),
        # in the window of ids a relay's claims read on a partitioned outbox.
        statement = postgresql._claim_sql(window=window)
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {statement}", params)
        (plan,) = cursor.fetchone()[0]
        transaction.set_rollback(True)
    OutboxMessage.objects.filter(destination=to).delete()
    return dict(plan)


def scheduled_lateness(
    env: dict[str, str], url: str, *, rate: float, seconds: float, lead: float = 3.0
) -> dict[str, float]:
    """Events coming due at ``rate`` per second for ``seconds``, all committed
    beforehand (the first due ``lead`` seconds after), with a running relay (woken by
    nothing but its own rest: no NOTIFY announces a row coming due) publishing to
    RabbitMQ: how late each went out, ``published_at - available_at`` by the database
    clock (figures ``scheduled_lateness_*``)."""
    reset_outbox()
    to = _declared_queue(url, destination("scheduled"))
    count = int(rate * seconds)
    relay = Worker(
        {**env, "OUTBOX_BENCH_ORDERED": "0"}, "relay", "--url", url, "--batch-size", "500"
    )
    relay.go()
    time.sleep(1.0 + outbox_settings.START_JITTER)  # a settled relay, resting
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        (now,) = cursor.fetchone()
    _schedule(count, now + dt.timedelta(seconds=lead), rate, to, keyed=False)
    published = OutboxMessage.objects.filter(destination=to, published_at__isnull=False)
    deadline = time.monotonic() + lead + seconds + 60
    while published.count() < count and time.monotonic() < deadline:
        time.sleep(0.5)
    relay.terminate()
    relay.result(timeout=60)
    delete_queue(url, to)
    late = sorted(
        (row.published_at - row.available_at).total_seconds() * 1000
        for row in published.only("published_at", "available_at")
    )
    if len(late) != count:
        raise RuntimeError(f"scheduled: {len(late)} of {count} events published")
    return {
        "scheduled_lateness_p50_ms": late[len(late) // 2],
        "scheduled_lateness_p99_ms": late[min(len(late) - 1, int(len(late) * 0.99))],
        "scheduled_lateness_max_ms": late[-1],
        "scheduled_events": count,
    }


#: Commits per second asked of one producer process in :func:`end_to_end`, and of one
#: thread of it: a one-event transaction costs the producer about a millisecond of CPU
#: here and waits for its commit's WAL flush, so faster rates take more of both.
COMMITS_PER_PROCESS = 500
COMMITS_PER_THREAD = 100


def produce(
    to: str, *, rate: float, seconds: float, first: int = 0, step: int = 1, per_commit: int = 1
) -> dict[int, float]:
    """Commit events to ``to`` at ``rate`` per second, ``per_commit`` to a transaction
    (``stage()`` for one, ``stage_many()`` for more): the transactions ``first, first +
    step, ...``, transaction ``n`` holding events ``n * per_commit`` to ``(n + 1) *
    per_commit - 1`` and due ``n * per_commit / rate`` seconds after the start, from
    enough threads that a slow commit does not hold up the next ones. Nothing is committed
    after ``seconds``: a producer that falls behind the rate commits fewer events rather
    than take longer. Returns each event's commit time (wall clock) by ``seq``."""
    commits = rate / per_commit  # per second
    threads = math.ceil(commits / step / COMMITS_PER_THREAD)
    committed: dict[int, float] = {}
    started = time.perf_counter()

    def producer(offset: int) -> None:
        try:
            for number in range(first + offset * step, int(commits * seconds), threads * step):
                pause = started + number / commits - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                elif time.perf_counter() > started + seconds:
                    return
                seqs = range(number * per_commit, (number + 1) * per_commit)
                with transaction.atomic():
                    _stage_seqs(to, seqs)
                at = time.time()
                committed.update(dict.fromkeys(seqs, at))
        finally:
            connection.close()  # this thread's

    with ThreadPoolExecutor(threads, thread_name_prefix="producer") as pool:
        for done in [pool.submit(producer, offset) for offset in range(threads)]:
            done.result()
    return committed


def _stage_seqs(to: str, seqs: range) -> None:
    """Stage the events ``seqs`` to ``to``: one ``stage()``, or one ``stage_many()``."""
    if len(seqs) == 1:
        stage("bench.order_placed", {**PAYLOAD, "seq": seqs[0]}, destination=to)
        return
    stage_many(
        {"event_type": "bench.order_placed", "payload": {**PAYLOAD, "seq": seq}, "destination": to}
        for seq in seqs
    )


def end_to_end(
    env: dict[str, str],
    url: str,
    *,
    rate: float,
    seconds: float,
    name: str = "e2e",
    per_commit: int = 1,
) -> dict[str, float]:
    """Commit events at ``rate`` per second for ``seconds``, ``per_commit`` to a
    transaction (:func:`produce`, in a worker process per ``COMMITS_PER_PROCESS``) with a
    relay running (woken by NOTIFY) and a consumer reading the queue; the latency is
    commit to the consumer's receipt. The figures are ``<name>_p50_ms``,
    ``<name>_p99_ms``, ``<name>_events``, ``<name>_rate`` (the events per second
    committed) and ``<name>_relay_cpu_ms_per_event`` (the relay process's CPU, all its
    threads, over the events)."""
    return consumed_end_to_end(
        env, url, destination("e2e"), "consume", (_declared_queue, delete_queue),
        rate=rate, seconds=seconds, name=name, per_commit=per_commit,
    )  # fmt: skip


def consumed_end_to_end(
    env: dict[str, str],
    url: str,
    to: str,
    mode: str,
    made: tuple[Callable[[str, str], object], Callable[[str, str], object]],
    *,
    rate: float,
    seconds: float,
    name: str,
    per_commit: int,
) -> dict[str, float]:
    """:func:`measure_end_to_end` on an empty outbox, with a consumer worker of ``mode``
    (``consume``, ``consume-nats``, ``consume-kafka``) reading ``to`` on ``url``, which
    ``made``'s first function makes beforehand (a queue, a stream, a topic) and its second
    deletes after."""
    make, delete = made
    reset_outbox()
    make(url, to)
    try:
        consumer = Worker(env, mode, "--url", url, "--queue", to, "--timeout", str(seconds + 60))
        return measure_end_to_end(
            env, url, to, consumer, rate=rate, seconds=seconds, name=name, per_commit=per_commit
        )
    finally:
        delete(url, to)


def measure_end_to_end(
    env: dict[str, str],
    url: str,
    to: str,
    consumer: Worker,
    *,
    rate: float,
    seconds: float,
    name: str,
    per_commit: int,
) -> dict[str, float]:
    """:func:`end_to_end`'s measure, with ``consumer`` (a worker started, reading what
    the relay publishes to destination ``to`` on broker ``url``)."""
    relay = Worker(
        {**env, "OUTBOX_BENCH_ORDERED": "0"}, "relay", "--url", url, "--batch-size", "500"
    )
    producers = _producers(env, to, rate=rate, seconds=seconds, per_commit=per_commit)
    consumer.go()
    relay.go()
    # The relay's start jitter, its first (empty) claim, then LISTEN: latency is measured
    # on a relay that is settled.
    time.sleep(1.0 + outbox_settings.START_JITTER)
    for producer in producers:
        producer.go()
    produced = [producer.result(timeout=seconds + 60) for producer in producers]
    committed = {int(seq): at for run in produced for seq, at in run["committed"].items()}
    reached = len(committed) / (max(committed.values()) - min(run["started"] for run in produced))
    consumer.send(f"expect {len(committed)}")
    received = consumer.result(timeout=seconds + 120)["received"]
    relay.terminate()
    relay_cpu_s = relay.result(timeout=60)["cpu_s"]
    return {
        **_latencies(name, committed, received),
        f"{name}_events": len(committed),
        f"{name}_rate": reached,
        # Its settling second and its wait for the consumer included.
        f"{name}_relay_cpu_ms_per_event": relay_cpu_s / len(committed) * 1000,
    }


def _declared_queue(url: str, name: str) -> str:
    """Declare the queue ``name`` (:func:`~benchmarks.common.bound_queue`)."""
    with kombu.Connection(url) as broker:
        bound_queue(name)(broker.default_channel).declare()
    return name


def _producers(
    env: dict[str, str], to: str, *, rate: float, seconds: float, per_commit: int
) -> list[Worker]:
    """The producer processes of :func:`end_to_end`, one per ``COMMITS_PER_PROCESS``."""
    step = math.ceil(rate / per_commit / COMMITS_PER_PROCESS)
    return [
        Worker(env, "produce", "--destination", to, "--rate", str(rate),
               "--seconds", str(seconds), "--first", str(first), "--step", str(step),
               "--per-commit", str(per_commit))
        for first in range(step)
    ]  # fmt: skip


def _latencies(
    name: str, committed: dict[int, float], received: dict[str, float]
) -> dict[str, float]:
    """p50 and p99 of commit to receipt (ms), once every committed event was received."""
    if len(received) != len(committed):
        raise RuntimeError(f"{name}: the consumer received {len(received)} of {len(committed)}")
    latencies = sorted((at - committed[int(seq)]) * 1000 for seq, at in received.items())
    return {
        f"{name}_p50_ms": latencies[len(latencies) // 2],
        f"{name}_p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def signing_cost(count: int) -> dict[str, float]:
    """The CPU the relay spends signing one event, in process (no broker, no database):
    the canonical encoding and the HMAC-SHA256 of ``count`` claimed messages of the
    benchmark's payload, as :func:`django_outbox.state.store.claim` makes them."""
    keys = parse_keys([SIGNING_KEY])
    now = dt.datetime.now(dt.UTC)
    messages = [
        ClaimedMessage(
            n, uuid.uuid4(), "bench.order_placed", "bench", json.dumps(PAYLOAD), {}, "", 0, now
        )
        for n in range(count)
    ]
    started = time.process_time()
    for message in messages:
        message.signature = keys.sign(message.envelope())
    return {"signing_us_per_event": (time.process_time() - started) / count * 1e6}
