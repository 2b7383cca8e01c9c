"""The end of a run: count what reached the broker, check the guarantees in SQL, report.

The tap queue is bound to the chaos exchange beside the consumer's queue and read
by no one during the run, so after the relays have stopped it holds one message
per publish RabbitMQ accepted: ``BrokerCopy`` gets the number of copies of each
event. Every check is one SQL statement over the suite's tables. The Django tasks'
checks (Django 6 only; on 5.2 the report says they were not run, and why) read the
tasks' results and the ``TaskEffect`` rows their runs wrote.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kombu

from django_outbox.conf.routes import TASKS_PREFIX, Route
from django_outbox.transports.declare import declare

from . import database as db
from .cluster import KINDS as CLUSTER_KINDS
from .destinations import (
    KAFKA,
    KAFKA_ORDERED,
    KAFKA_TRANSACTIONAL,
    NATS,
    NATS_ORDERED,
    ORDERED,
    QUEUE,
    REDIS,
    TASK_QUEUE,
    TASKS_UNAVAILABLE,
)
from .disk import lost_during
from .faults import KINDS, Fault
from .jetstream import KINDS as NATS_KINDS
from .kafka import KINDS as KAFKA_KINDS
from .logs import lines
from .models import BrokerCopy, OrderedCopy

EXCHANGE = "chaos"
DESTINATION = QUEUE
TAP = "chaos.tap"
#: Batches a relay can have between claim and finalize: one finalizing, one
#: publishing, one claimed ahead.
IN_FLIGHT = 3
#: The informative line of the Django tasks, and the ``totals()`` keys it shows.
TASK_TOTALS = "tasks enqueued / run / started twice or more / deliveries not run again"
TASK_TOTAL_KEYS = (
    "tasks_enqueued",
    "tasks_run",
    "tasks_attempted_again",
    "task_deliveries_skipped",
)
#: Faults that can make every relay publish again what it had in flight.
EVERY_RELAY = (
    "rabbitmq_restart",
    "postgres_restart",
    "postgres_crash",
    "memory_alarm",
    "net_delay",
    "net_partition",
    "disk_full",
    "pg_failover",
    *CLUSTER_KINDS,
)


def tap_route() -> Route:
    return Route(DESTINATION, EXCHANGE, "topic", DESTINATION, TAP)


def reset_queues(url: str) -> None:
    """Delete what an earlier run left in the queues, and bind a fresh tap."""
    with kombu.Connection(url, connect_timeout=10) as connection:
        channel = connection.channel()
        for name in (DESTINATION, TAP, TASK_QUEUE):
            kombu.Queue(name, channel=channel).delete()
        declare(channel, tap_route())


def drain_tap(url: str, arguments: dict[str, str] | None = None) -> int:
    """Read the tap queue (declared with ``arguments``: the cluster's is a quorum queue)
    to the end into ``BrokerCopy``, and the ordered destination's messages, in tap order,
    into ``OrderedCopy``; returns the messages read."""
    copies: collections.Counter[str] = collections.Counter()
    ordered: list[OrderedCopy] = []
    read = 0
    with kombu.Connection(url, connect_timeout=10) as connection:
        channel = connection.channel()
        queue = kombu.Queue(TAP, channel=channel, queue_arguments=arguments)
        expected = queue.queue_declare(passive=True).message_count

        def count(message: Any) -> None:  # the message id is the event id; no need to decode
            nonlocal read
            copies[message.properties["message_id"]] += 1
            read += 1
            headers = message.headers
            if headers.get("sequence") is not None:
                ordered.append(
                    OrderedCopy(
                        position=read,
                        event_id=headers["event_id"],
                        destination=headers["destination"],
                        ordering_key=headers["ordering_key"],
                        sequence=headers["sequence"],
                    )
                )

        with kombu.Consumer(channel, [queue], on_message=count, no_ack=True):
            while read < expected:
                connection.drain_events(timeout=30)
    record(copies, ordered)
    return read


def reset_redis(url: str) -> None:
    """Delete what an earlier run left of REDIS on Redis (its list, its exchange's
    bindings), and give Redis back its memory if a run that broke left it full."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        if client.config_get("maxmemory")["maxmemory"] == "1":  # redis_oom's limit
            client.config_set("maxmemory", 0)
        client.delete(REDIS, f"_kombu.binding.{EXCHANGE}")
    finally:
        client.close()


def drain_redis(url: str) -> int:
    """Read REDIS's list (nobody consumes it during a run: its tap) into ``BrokerCopy``;
    returns the messages read."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        texts = client.lrange(REDIS, 0, -1)
        client.delete(REDIS)
    finally:
        client.close()
    record(collections.Counter(json.loads(text)["properties"]["message_id"] for text in texts))
    return len(texts)


def record(copies: collections.Counter[str], ordered: Sequence[OrderedCopy] = ()) -> None:
    """Add ``copies`` (event id -> copies read) to ``BrokerCopy``, and ``ordered``."""
    # An event on both taps (a relay whose encoder gave messages of both brokers one id:
    # --sabotage frames) adds up instead of breaking the audit.
    earlier = BrokerCopy.objects.filter(event_id__in=list(copies))
    copies.update({str(event_id): n for event_id, n in earlier.values_list("event_id", "copies")})
    earlier.delete()
    BrokerCopy.objects.bulk_create(
        (BrokerCopy(event_id=event_id, copies=n) for event_id, n in copies.items()),
        batch_size=5000,
    )
    OrderedCopy.objects.bulk_create(ordered, batch_size=5000)


def record_read(found: Sequence[Mapping[str, Any]]) -> None:
    """Record the messages read back from a NATS stream or a Kafka topic, each its
    headers (text) in the order read: ``BrokerCopy`` by the ``event_id`` header, and the
    ordered destinations' messages (those with a ``sequence``) into ``OrderedCopy``."""
    from django.db.models import Max

    copies = collections.Counter(headers["event_id"] for headers in found)
    # After the taps' positions (the table's key): the order within each read is the order.
    after = OrderedCopy.objects.aggregate(last=Max("position"))["last"] or 0
    ordered = [
        OrderedCopy(
            position=after + position,
            event_id=headers["event_id"],
            destination=headers["destination"],
            ordering_key=headers["ordering_key"],
            sequence=int(headers["sequence"]),
        )
        for position, headers in enumerate(found, 1)
        if headers.get("sequence") is not None
    ]
    record(copies, ordered)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    value: int
    limit: int  # the check passes when value <= limit (with at_least: value >= limit)
    note: str = ""
    #: A figure whose expectation is documented, not a pass or a fail (the losses of a
    #: failover with asynchronous replication: chaos.failover).
    measured: bool = False
    #: A floor, not a ceiling: something the run must have done (the partitioned
    #: profile's ranges made and dropped: chaos.partitioned).
    at_least: bool = False

    @property
    def ok(self) -> bool:
        if self.at_least:
            return self.value >= self.limit
        return self.measured or self.value <= self.limit


def duplicate_bound(faults: Sequence[Fault], relays: int, batch_size: int) -> int:
    """Copies beyond the first a run may publish: a relay fault can repeat what
    that relay had in flight; a broker or database restart what every relay had."""
    bound = 0
    for fault in faults:
        if fault.kind in ("relay_kill", "relay_stop"):
            bound += IN_FLIGHT * batch_size
        elif fault.kind in EVERY_RELAY:
            bound += relays * IN_FLIGHT * batch_size
    return bound


def checks(faults: Sequence[Fault], relays: int, batch_size: int) -> list[Check]:
    """Every check of the run (the Django tasks' only where Django has them)."""
    duplicates = int(db.value(f"SELECT coalesce(sum(copies - 1), 0) FROM {_not_kafka()}"))
    return [
        *(Check(name, value, 0) for name, value in _must_be_zero(faults)),
        *fault_checks(faults),
        Check(
            "duplicates at the broker",
            duplicates,
            duplicate_bound(faults, relays, batch_size),
            "bound: in-flight batches x batch size x faults",
        ),
        *(
            Check(name, int(db.value(sql)), 0)
            for name, sql in (task_checks() if TASKS_UNAVAILABLE is None else [])
        ),
    ]


def task_checks() -> list[tuple[str, str]]:
    """The Django tasks' guarantees, each a label and the SQL of its value (0 when it
    holds): a task enqueued in a committed transaction runs to completion, its effects
    once; one enqueued in a rolled-back transaction never runs."""
    r, e = db.TASK_RESULT, db.TASK_EFFECT
    return [
        (
            "tasks committed and not SUCCESSFUL (ready, running, failed)",
            f"SELECT count(*) FROM {r} WHERE status <> 'SUCCESSFUL'",
        ),
        (
            "tasks whose effects ran more than once",
            f"SELECT count(*) FROM (SELECT 1 FROM {e} GROUP BY result_id HAVING count(*) > 1) x",
        ),
        (
            "tasks SUCCESSFUL without their effect",
            f"SELECT count(*) FROM {r} t WHERE status = 'SUCCESSFUL' AND NOT EXISTS "
            f"(SELECT 1 FROM {e} x WHERE x.result_id = t.id)",
        ),
        (
            "tasks run with no committed enqueue",
            f"SELECT count(DISTINCT result_id) FROM {e} t WHERE NOT EXISTS "
            f"(SELECT 1 FROM {r} x WHERE x.id = t.result_id)",
        ),
    ]


def _must_be_zero(faults: Sequence[Fault]) -> list[tuple[str, float]]:
    """The checks every run has, each a label and its value (0 when it holds)."""
    o, h, r, b, v = db.ORDER, db.HANDLED, db.ROLLED_BACK, db.BROKER, db.VIOLATION
    outbox, forged = db.OUTBOX_ROWS, f"SELECT event_id FROM {db.FORGED}"
    parked = f"{db.INBOX_FAILURE} WHERE parked_at IS NOT NULL AND event_id NOT IN ({forged})"
    gaps = (
        f"SELECT count(*) FROM (SELECT 1 FROM {outbox} WHERE sequence IS NOT NULL "
        "GROUP BY destination, ordering_key "
        "HAVING min(sequence) <> 1 OR max(sequence) <> count(*)) gaps"
    )
    return [
        ("lost (committed, never handled)", without(db.CONSUMED, h)),
        ("duplicates handled", db.value(f"SELECT count(*) - count(DISTINCT event_id) FROM {h}")),
        ("handled without a committed order", without(h, o, count="count(DISTINCT event_id)")),
        (
            "rolled-back events at the broker",
            db.value(f"SELECT count(*) FROM {r} JOIN {b} USING (event_id)"),
        ),
        (
            "rolled-back events in the outbox",
            db.value(f"SELECT count(*) FROM {r} JOIN {outbox} USING (event_id)"),
        ),
        ("committed events never at the broker", without(o, b)),
        ("outbox rows without their order", without(_events(), o)),
        (
            "outbox rows not PUBLISHED (processing, due, abandoned)",
            db.value(f"SELECT count(*) FROM {outbox} WHERE status <> 'published'"),
        ),
        (
            "PUBLISHED rows set back (trigger)",
            db.value(f"SELECT count(*) FROM {v} WHERE kind = 'set_back'"),
        ),
        (
            "rows finalized by a relay not holding their lease (trigger)",
            db.value(f"SELECT count(*) FROM {v} WHERE kind = 'stale_write'"),
        ),
        (
            "rows deleted by a relay not holding their lease (trigger)",
            db.value(f"SELECT count(*) FROM {v} WHERE kind = 'stale_delete'"),
        ),
        (
            "zombie relays' rows taken over, not reported lease_lost",
            sum(fault.done.unreported for fault in faults),
        ),
        ("events the consumer parked", db.value(f"SELECT count(*) FROM {parked}")),
        (
            "forged messages handled",
            db.value(f"SELECT count(*) FROM {h} WHERE event_id IN ({forged})"),
        ),
        (
            "events out of order per key",
            out_of_order(NATS_ORDERED, KAFKA_ORDERED, KAFKA_TRANSACTIONAL, among=False),
        ),
        ("ordered rows without a gap-free sequence (keys)", db.value(gaps)),
    ]


def fault_checks(faults: Sequence[Fault]) -> list[Check]:
    """The broker, network, disk and cluster faults' own guarantees."""
    return [
        Check(
            "attempts spent without a publish (memory alarm, Redis out of memory, network "
            "delay, partition)",
            sum(
                fault.done.spent
                for fault in faults
                if fault.kind not in NATS_KINDS and fault.kind not in KAFKA_KINDS
            ),
            0,
        ),
        Check(
            f"events to {REDIS} not pushed exactly once",
            int(
                db.value(
                    f"SELECT count(*) FROM {db.OUTBOX_ROWS} o LEFT JOIN {db.BROKER} b "
                    "USING (event_id) WHERE o.destination = %s AND coalesce(b.copies, 0) <> 1",
                    [REDIS],
                )
            ),
            0,
        ),
        Check("orders committed during disk full lost", lost_during(faults), 0),
        Check(
            "cluster node restarts with nothing published through the other nodes",
            sum(fault.done.stranded for fault in faults if fault.kind in CLUSTER_KINDS),
            0,
        ),
    ]


def nats_checks(faults: Sequence[Fault]) -> list[Check]:
    """The NATS destinations' guarantees, read from their stream (chaos.jetstream): every
    committed event in it, once, each key's events in sequence order, and no attempt
    spent on the cluster's faults."""
    nats = f"(SELECT * FROM {db.OUTBOX_ROWS} WHERE destination IN {db.NATS_DESTINATIONS})"
    return [
        Check("NATS lost (committed, never in the stream)", without(nats, db.BROKER), 0),
        Check(
            "NATS duplicates in the stream",
            int(
                db.value(
                    f"SELECT coalesce(sum(copies - 1), 0) FROM {db.BROKER} b "
                    f"WHERE EXISTS (SELECT 1 FROM {nats} o WHERE o.event_id = b.event_id)"
                )
            ),
            0,
        ),
        Check("NATS out of order per key", out_of_order(NATS_ORDERED), 0),
        Check(
            "NATS attempts spent without a publish (node killed, leader moved, cluster down)",
            sum(fault.done.spent for fault in faults if fault.kind in NATS_KINDS),
            0,
        ),
        Check(
            "NATS node kills with nothing published through the other nodes",
            sum(fault.done.stranded for fault in faults if fault.kind in NATS_KINDS),
            0,
        ),
    ]


def kafka_checks(faults: Sequence[Fault]) -> list[Check]:
    """The Kafka destinations' guarantees (the kafka profile), read back from their topics
    (chaos.kafka): every committed event in them, each key's events in sequence order in
    its partition, the transactional route's events once each in its topic (as a
    ``read_committed`` reader sees it), no attempt spent on the cluster's faults, a
    broker's death survived through the other two, and nothing acknowledged while too few
    replicas were in sync. The consumer's side (each event handled once) is the run's
    "duplicates handled"; the plain routes' duplicates are counted, not judged
    (``totals``): a plain route is at least once, and a relay killed between publish and
    mark sends its rows again."""
    kafka = f"(SELECT * FROM {db.OUTBOX_ROWS} WHERE destination IN {db.KAFKA_DESTINATIONS})"
    return [
        Check("Kafka lost (committed, never in the topic)", without(kafka, db.BROKER), 0),
        Check("Kafka out of order per key", out_of_order(KAFKA_ORDERED, KAFKA_TRANSACTIONAL), 0),
        Check(
            "Kafka transactional duplicates in the topic (read_committed)",
            _copies(KAFKA_TX)[2],
            0,
        ),
        Check(
            "Kafka attempts spent without a publish (broker killed, frozen, cluster down, "
            "in-sync replicas below the minimum)",
            sum(fault.done.spent for fault in faults if fault.kind in KAFKA_KINDS),
            0,
        ),
        Check(
            "Kafka broker kills with nothing published through the other brokers",
            sum(fault.done.stranded for fault in faults if fault.kind in KAFKA_KINDS),
            0,
        ),
        Check(
            "Kafka events published while in-sync replicas were below the minimum",
            sum(fault.done.short for fault in faults),
            0,
        ),
    ]


def heartbeat_checks(unbeating: Sequence[str], stopped: Sequence[str]) -> list[Check]:
    """The heartbeat's guarantees (docs/health.md): every relay and consumer running
    when the run drained had a live heartbeat (``unbeating``: the ``host:pid`` of those
    that had none, read before the SIGTERM), and each one SIGTERM stopped (``stopped``)
    wrote its stop."""
    from django_outbox.models import WorkerHeartbeat
    from django_outbox.workers.heartbeat import WorkerState, state_of

    rows = {row.worker: row for row in WorkerHeartbeat.objects.filter(worker__in=stopped)}
    return [
        Check(
            "relays and consumers running without a live heartbeat",
            len(unbeating),
            0,
            "read before the SIGTERM",
        ),
        Check(
            "relays and consumers SIGTERMed whose heartbeat does not say stopped",
            sum(
                1
                for worker in stopped
                if worker not in rows or state_of(rows[worker]) is not WorkerState.STOPPED
            ),
            0,
        ),
    ]


def not_live(workers: Sequence[str]) -> list[str]:
    """Those of ``workers`` (``host:pid``) without a live heartbeat row."""
    from django_outbox.models import WorkerHeartbeat
    from django_outbox.workers.heartbeat import WorkerState, state_of

    live = {
        row.worker
        for row in WorkerHeartbeat.objects.filter(worker__in=workers)
        if state_of(row) is WorkerState.LIVE
    }
    return [worker for worker in workers if worker not in live]


def out_of_order(*destinations: str, among: bool = True) -> int:
    """Events of ``destinations`` (without ``among``: of every ordered destination but
    them) whose first copy in the tap (or the stream) did not come right after the first
    copy of their predecessor: its sequence is not one more than the highest of its key
    first delivered before it (a swap or a gap). The checks above catch an event that
    never arrived at all."""
    return int(
        db.value(
            f"""
            SELECT count(*) FROM (
                SELECT sequence, max(sequence) OVER (
                    PARTITION BY destination, ordering_key ORDER BY position
                    ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING
                ) AS before
                FROM (
                    SELECT DISTINCT ON (event_id) * FROM {db.ORDERED_COPY}
                    WHERE (destination = ANY(%s)) = %s
                    ORDER BY event_id, position
                ) firsts
            ) delivered
            WHERE sequence <> coalesce(before, 0) + 1
            """,
            [list(destinations), among],
        )
    )


def _events() -> str:
    """The outbox's rows of events, without the Django tasks' (whose id is their result's,
    not an order's: the tasks' checks look at them) and the runner's to REDIS (no order:
    a check of their own)."""
    return (
        f"(SELECT * FROM {db.OUTBOX_ROWS} WHERE NOT starts_with(destination, '{TASKS_PREFIX}') "
        f"AND destination <> '{REDIS}')"
    )


#: The transactional Kafka destination, as an SQL list.
KAFKA_TX = f"('{KAFKA_TRANSACTIONAL}')"


def _not_kafka() -> str:
    """``BrokerCopy`` without the Kafka destinations' copies (counted apart)."""
    return (
        f"(SELECT * FROM {db.BROKER} b WHERE NOT EXISTS (SELECT 1 FROM {db.OUTBOX_ROWS} o "
        f"WHERE o.event_id = b.event_id AND o.destination IN {db.KAFKA_DESTINATIONS})) copies"
    )


def without(table: str, other: str, *, count: str = "count(*)") -> int:
    """Rows of ``table`` whose event id is nowhere in ``other``."""
    return int(
        db.value(
            f"SELECT {count} FROM {table} t WHERE NOT EXISTS "
            f"(SELECT 1 FROM {other} x WHERE x.event_id = t.event_id)"
        )
    )


def totals(task_log: Path | None = None) -> dict[str, int]:
    """The report's figures; ``task_log`` is the task worker's log (Django 6)."""
    o, h, r, b = db.ORDER, db.HANDLED, db.ROLLED_BACK, db.BROKER
    committed, handled = db.rows(
        f"SELECT (SELECT count(*) FROM {o}), (SELECT count(DISTINCT event_id) FROM {h})"
    )[0]
    kinds = dict(db.rows(f"SELECT kind, count(*) FROM {r} GROUP BY kind"))
    published = db.value(f"SELECT coalesce(sum(copies), 0) FROM {b}")
    ordered, keys = db.rows(
        f"SELECT count(*), count(DISTINCT ordering_key) FROM {db.OUTBOX_ROWS} "
        "WHERE destination = %s",
        [ORDERED],
    )[0]
    tried, attempts, most = db.rows(
        f"SELECT count(*) FILTER (WHERE attempts > 0), coalesce(sum(attempts), 0), "
        f"coalesce(max(attempts), 0) FROM {db.OUTBOX_ROWS}"
    )[0]
    nats, in_stream, _ = _copies(db.NATS_DESTINATIONS)
    kafka, in_topic, twice = _copies(db.KAFKA_PLAIN)
    kafka_tx, in_tx_topic, _ = _copies(KAFKA_TX)
    return {
        **task_totals(task_log),
        "nats": nats,
        "nats_messages": in_stream,
        "kafka": kafka,
        "kafka_records": in_topic,
        "kafka_duplicates": twice,
        "kafka_tx": kafka_tx,
        "kafka_tx_records": in_tx_topic,
        "deleted": db.value(f"SELECT count(*) FROM {db.DELETED}"),
        "rows_with_attempts": tried,
        "attempts": attempts,
        "most_attempts": most,
        "ordered": ordered,
        "ordered_keys": keys,
        "committed": committed,
        "rolled_back_transaction": kinds.get("transaction", 0),
        "rolled_back_savepoint": kinds.get("savepoint", 0),
        "delivered": handled,
        "broker_messages": published,
        "forged": db.value(f"SELECT count(*) FROM {db.FORGED}"),
        "forged_parked": db.value(
            f"SELECT count(*) FROM {db.INBOX_FAILURE} WHERE parked_at IS NOT NULL "
            f"AND event_id IN (SELECT event_id FROM {db.FORGED})"
        ),
    }


def _copies(destinations: str) -> tuple[int, int, int]:
    """The events of ``destinations`` (an SQL list), their copies read back, and the
    copies beyond each one's first."""
    events, copies, again = db.rows(
        f"SELECT count(*), coalesce(sum(b.copies), 0), coalesce(sum(b.copies - 1), 0) "
        f"FROM {db.OUTBOX_ROWS} o LEFT JOIN {db.BROKER} b USING (event_id) "
        f"WHERE o.destination IN {destinations}"
    )[0]
    return int(events), int(copies), int(again)


def task_totals(log: Path | None) -> dict[str, int]:
    """The Django tasks enqueued (committed), run (with an effect), started by more than
    one worker (a worker killed mid-task), and the deliveries the task worker's ``log``
    says it did not run (a second copy of a finished task); none without the tasks."""
    if TASKS_UNAVAILABLE is not None or log is None:
        return {}
    enqueued, again = db.rows(
        f"SELECT count(*), count(*) FILTER (WHERE jsonb_array_length(worker_ids) > 1) "
        f"FROM {db.TASK_RESULT}"
    )[0]
    ran = db.value(f"SELECT count(DISTINCT result_id) FROM {db.TASK_EFFECT}")
    skipped = sum(len(lines(log, action)) for action in ("tasks.skipped", "tasks.duplicate"))
    return {
        "tasks_enqueued": enqueued,
        "tasks_run": ran,
        "tasks_attempted_again": again,
        "task_deliveries_skipped": skipped,
    }


def relay_fault_copies(faults: Sequence[Fault], workers: dict[str, str]) -> list[str]:
    """For each relay fault: which relays published the rows the faulted relay held
    (the rows' final ``locked_by``, named through ``workers``), and how many of them
    reached their broker more than once (published before the fault and again after:
    RabbitMQ keeps both, a NATS stream only one within its duplicate window)."""
    found = []
    for fault in faults:
        if fault.kind not in ("relay_kill", "relay_stop"):
            continue
        again = db.value(
            f"SELECT count(*) FROM {db.OUTBOX_ROWS} o JOIN {db.BROKER} USING (event_id) "
            "WHERE o.id = ANY(%s) AND copies > 1",
            [fault.done.held_ids],
        )
        by = db.rows(
            f"SELECT locked_by, count(*) FROM {db.OUTBOX_ROWS} WHERE id = ANY(%s) "
            "GROUP BY locked_by ORDER BY 2 DESC",
            [fault.done.held_ids],
        )
        # A relay's start-up mark from its Kafka transactional record clears locked_by.
        named = {**workers, "": "a relay's start (its Kafka transactional record)"}
        published_by = ", ".join(f"{n} by {named.get(w, w)}" for w, n in by) or "nobody"
        found.append(
            f"{fault.kind} of {fault.target} at {fault.at:.1f}s: its {len(fault.done.held_ids)} "
            f"rows ({fault.done.stored} of them NATS rows already in the stream, "
            f"{fault.done.in_topic} Kafka rows already handled, "
            f"{fault.done.transactional} of them committed in a Kafka transaction) were "
            f"published: {published_by}; {again} reached their broker twice or more"
        )
    return found


def violations() -> list[str]:
    """The rule-breaking writes the triggers recorded, grouped: who wrote over whose
    lease, from which state to which, how many rows and when (to find the fault)."""
    found = db.rows(
        f"SELECT kind, writer, locked_by, old_status, new_status, count(*), min(at), max(at) "
        f"FROM {db.VIOLATION} GROUP BY 1, 2, 3, 4, 5 ORDER BY 7"
    )
    return [
        f"{kind}: {n} rows {old} -> {new} written by {writer!r} under the lease of "
        f"{holder!r}, {first:%H:%M:%S.%f} to {last:%H:%M:%S.%f}"
        for kind, writer, holder, old, new, n, first, last in found
    ]


def report(
    *,
    profile: str,
    seed: int,
    seconds: float,
    faults: Sequence[Fault],
    counted: dict[str, int],
    results: list[Check],
) -> str:
    head = f"chaos profile {profile}, seed {seed}: {seconds:.0f}s, {len(faults)} faults"
    return "\n".join(
        [head, *_counted_rows(counted), *_check_rows(results), *recovery_table(faults)]
    )


def _row(label: str, value: Any, note: str = "") -> str:
    """``label: value``, the verdict aligned after it (a line to grep for)."""
    number = f"{value:,}" if isinstance(value, int) else str(value)
    return f"{f'{label}: {number}':<72}   {note}".rstrip()


def _counted_rows(counted: dict[str, int]) -> list[str]:
    """The report's figures that are no check."""
    if TASKS_UNAVAILABLE is None:
        tasks = _row(TASK_TOTALS, " / ".join(f"{counted[key]:,}" for key in TASK_TOTAL_KEYS))
    else:
        tasks = _row(TASK_TOTALS, "not run", f"({TASKS_UNAVAILABLE})")
    return [
        _row("events committed", counted["committed"]),
        _row(
            f"  of them to the ordered destination {ORDERED} (keys)",
            f"{counted['ordered']:,} ({counted['ordered_keys']})",
        ),
        _row(
            f"  of them to NATS, {NATS} and {NATS_ORDERED} (messages in the stream)",
            f"{counted['nats']:,} ({counted['nats_messages']:,})",
        ),
        *_kafka_rows(counted),
        _row(
            "events rolled back (transaction / savepoint)",
            f"{counted['rolled_back_transaction']:,} / {counted['rolled_back_savepoint']:,}",
        ),
        _row("events delivered (handled by the consumer)", counted["delivered"]),
        _row("messages RabbitMQ received", counted["broker_messages"]),
        _row(
            "messages forged onto the consumer's queue (parked)",
            f"{counted['forged']:,} ({counted['forged_parked']:,})",
        ),
        _row("outbox rows deleted (at their confirm: ci-deleting's relay-1)", counted["deleted"]),
        _row(
            "attempts spent in all (rows / attempts / most on one row)",
            f"{counted['rows_with_attempts']:,} / {counted['attempts']:,} / "
            f"{counted['most_attempts']:,}",
        ),
        tasks,
    ]


def _kafka_rows(counted: dict[str, int]) -> list[str]:
    """The Kafka destinations' figures, in a run that has them (the kafka profile): their
    events and the records read back, the plain routes' and the transactional one's, and
    the duplicates among the plain routes' (a plain route is at least once: counted, not
    judged; the transactional route's are a check)."""
    if not counted["kafka"]:
        return []
    return [
        _row(
            f"  of them to Kafka, {KAFKA} and {KAFKA_ORDERED} (records in the topic)",
            f"{counted['kafka']:,} ({counted['kafka_records']:,})",
        ),
        _row(
            f"  of them to Kafka's transactional {KAFKA_TRANSACTIONAL} (records in its topic)",
            f"{counted['kafka_tx']:,} ({counted['kafka_tx_records']:,})",
        ),
        _row(
            "Kafka duplicates in the topic",
            counted["kafka_duplicates"],
            "counted, not judged (a plain route is at least once; the inbox handles each once)",
        ),
    ]


def _check_rows(results: list[Check]) -> list[str]:
    """Each check with its verdict; the Django tasks' as not run (and why) without them."""
    out = []
    for check in results:
        if check.measured:
            verdict = f"measured ({check.note})"
        elif check.at_least:
            verdict = f"{'ok' if check.ok else 'FAIL'} (>= {check.limit:,}; {check.note})"
        elif check.limit:
            verdict = f"{'ok' if check.ok else 'FAIL'} (<= {check.limit:,}; {check.note})"
        else:
            verdict = "ok" if check.ok else "FAIL (must be 0)"
        out.append(_row(check.name, check.value, verdict))
    if TASKS_UNAVAILABLE is not None:
        out += [_row(name, "not run", f"({TASKS_UNAVAILABLE})") for name, _ in task_checks()]
    return out


def recovery_table(faults: Sequence[Fault]) -> list[str]:
    """Per kind of fault: how many, and their recovery times' min, median and max."""
    kafka = KAFKA_KINDS if any(fault.kind in KAFKA_KINDS for fault in faults) else ()
    by_kind: dict[str, list[float]] = {kind: [] for kind in (*KINDS, *kafka)}
    for fault in faults:  # a kind only a profile schedules (pg_failover) is listed after
        by_kind.setdefault(fault.kind, []).append(fault.recovery)
    out = [f"{'fault':<25}{'count':>6}{'recovery min':>14}{'median':>9}{'max':>9}  (s)"]
    for kind, times in by_kind.items():
        if times:
            out.append(
                f"{kind:<25}{len(times):>6}{min(times):>14.1f}"
                f"{statistics.median(times):>9.1f}{max(times):>9.1f}"
            )
        else:
            out.append(f"{kind:<25}{0:>6}")
    return out
