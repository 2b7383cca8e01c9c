"""Strict per-key order on real PostgreSQL (docs/ordering.md): sequence numbers taken at
staging in commit order, the claim of heads and their runs, the finalize rule.

Concurrency is driven by threads that each hold their own Django connection, and by
``threading.Event`` and polling of ``pg_stat_activity`` (a session waiting for a lock),
never by sleeps.
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import functools
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence

import kombu
import psycopg
import pytest
from django.db import connection, connections, transaction
from django.db.models.functions import Now
from django.test.utils import override_settings

from django_outbox import db, stage, stage_many, testing
from django_outbox.db import postgresql
from django_outbox.envelope import ClaimedMessage
from django_outbox.exceptions import InvalidEvent
from django_outbox.models import OutboxMessage, OutboxSequence
from django_outbox.relay import Relay
from django_outbox.state import store
from django_outbox.transports.base import Failure, Outcome
from django_outbox.transports.memory import MemoryTransport
from tests.factories import OutboxMessageFactory
from tests.support import AMQP_URL, as_on_the_table, delete_queue, unique_destination, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Status = OutboxMessage.Status
ORDERED = "ordered-orders"
PLAIN = "plain-orders"
ROUTES = {
    "BROKERS": {"default": {"URL": "memory://"}},
    "ROUTES": {
        ORDERED: {"exchange": "orders", "ordered": True},
        PLAIN: {"exchange": "orders"},
    },
}


@pytest.fixture(autouse=True)
def _ordered_route() -> Iterator[None]:
    with override_settings(OUTBOX=ROUTES):
        yield


def _stage(key: str, n: int = 0, destination: str = ORDERED) -> OutboxMessage:
    return stage("order.changed", {"n": n}, destination=destination, key=key)


def _sequences(key: str) -> list[int]:
    rows = OutboxMessage.objects.filter(destination=ORDERED, ordering_key=key)
    return list(rows.order_by("sequence").values_list("sequence", flat=True))


class _Thread(threading.Thread):
    """A thread with its own database connection (closed at its end) that keeps the
    exception it raised."""

    def __init__(self, target: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self._target_call = target
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._target_call()
        except BaseException as exc:  # reported by join_checked
            self.error = exc
        finally:
            connections.close_all()

    def join_checked(self) -> None:
        self.join(timeout=60)
        assert not self.is_alive(), "thread did not finish"
        if self.error is not None:
            raise self.error


def _waiting_for_a_lock() -> int:
    """Sessions of the test database waiting for a row lock (the counter row)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'"
        )
        return int(cursor.fetchone()[0])


# -- staging ------------------------------------------------------------------------


def test_ordered_rows_are_numbered_per_key_and_unordered_rows_are_not():
    with transaction.atomic():
        rows = stage_many(
            [
                {"event_type": "e", "payload": i, "destination": dest, "key": key}
                for i, (dest, key) in enumerate(
                    [(ORDERED, "b"), (ORDERED, "a"), (PLAIN, "a"), (ORDERED, "b"), (PLAIN, None)]
                )
            ]
        )
    assert [row.sequence for row in rows] == [1, 1, None, 2, None]
    with transaction.atomic():
        assert _stage("b").sequence == 3
    stored = OutboxMessage.objects.order_by("id").values_list("sequence", flat=True)
    assert list(stored) == [1, 1, None, 2, None, 3]
    counters = OutboxSequence.objects.values_list("ordering_key", "last_sequence")
    assert dict(counters) == {"a": 1, "b": 3}


def test_a_keyless_event_on_an_ordered_route_is_refused():
    with transaction.atomic():
        with pytest.raises(InvalidEvent, match=r"ordered.*give key="):
            stage("e", {}, destination=ORDERED)
        with pytest.raises(InvalidEvent, match=r"event #1: .*ordered"):
            stage_many(
                [
                    {"event_type": "e", "payload": 1, "destination": ORDERED, "key": "k"},
                    {"event_type": "e", "payload": 2, "destination": ORDERED},
                ]
            )
    assert not OutboxMessage.objects.exists()


def test_a_rolled_back_savepoint_gives_its_number_back():
    with transaction.atomic():
        assert _stage("k").sequence == 1
        with pytest.raises(RuntimeError), transaction.atomic():
            assert _stage("k").sequence == 2
            raise RuntimeError("the business write failed")
        assert _stage("k").sequence == 2
    assert _sequences("k") == [1, 2]


def test_a_rolled_back_transaction_gives_its_number_to_the_writer_waiting_for_it():
    staged, release = threading.Event(), threading.Event()

    def first() -> None:
        with pytest.raises(RuntimeError), transaction.atomic():
            _stage("k", 1)
            staged.set()
            release.wait(30)
            raise RuntimeError("rolled back")

    t1 = _Thread(first)
    t1.start()
    assert staged.wait(30)
    t2 = _Thread(lambda: transaction.atomic()(_stage)("k", 2))
    t2.start()
    wait_until(_waiting_for_a_lock, timeout=30, what="the second writer to wait")
    release.set()
    t1.join_checked()
    t2.join_checked()
    assert list(OutboxMessage.objects.values_list("payload", "sequence")) == [({"n": 2}, 1)]


def test_numbers_follow_commit_order_not_id_order():
    """T2 takes the lower outbox ids (it stages first, on another key), then waits for
    the key's counter row that T1 holds; T1 commits first, so its event is number 1
    although T2 opened first and the relay publishes T1's event first."""
    t2_started, t1_staged, t1_commit = threading.Event(), threading.Event(), threading.Event()

    def t1() -> None:
        assert t2_started.wait(30)
        with transaction.atomic():
            _stage("k", 1)
            t1_staged.set()
            assert t1_commit.wait(30)

    def t2() -> None:
        with transaction.atomic():
            _stage("other", 0)
            t2_started.set()
            assert t1_staged.wait(30)
            _stage("k", 2)  # waits for T1's commit

    threads = [_Thread(t1), _Thread(t2)]
    for thread in threads:
        thread.start()
    wait_until(_waiting_for_a_lock, timeout=30, what="T2 to wait for T1's counter row")
    t1_commit.set()
    for thread in threads:
        thread.join_checked()
    rows = OutboxMessage.objects.filter(ordering_key="k").order_by("sequence")
    assert [(row.payload["n"], row.sequence) for row in rows] == [(1, 1), (2, 2)]
    published = [e.payload["n"] for e in testing.drain() if e.ordering_key == "k"]
    assert published == [1, 2]


def test_concurrent_writers_of_one_key_get_dense_numbers_in_commit_order():
    """Four threads, 25 transactions each on one key: the numbers are 1..100 without a
    gap or a double, and each thread's numbers (its commits are in a known order)
    increase."""
    taken: dict[int, list[int]] = {}

    def writer(first: int) -> None:
        taken[first] = []
        for n in range(first, first + 25):
            with transaction.atomic():
                row = _stage("hot", n)
            taken[first].append(row.sequence)

    threads = [_Thread(lambda f=f: writer(f)) for f in range(0, 100, 25)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join_checked()
    assert _sequences("hot") == list(range(1, 101))
    for numbers in taken.values():
        assert numbers == sorted(numbers)


# -- the claim ---------------------------------------------------------------------

Claim = Callable[[int, uuid.UUID], list[ClaimedMessage]]


def _production(limit: int, token: uuid.UUID) -> list[ClaimedMessage]:
    return db.claim("default", limit=limit, lease_seconds=30, worker="w", token=token)


def _portable(limit: int, token: uuid.UUID) -> list[ClaimedMessage]:
    return db._claim_portable("default", limit, 2**62, 30, "w", token)


@pytest.fixture(params=[_production, _portable], ids=["postgresql", "portable"])
def claim(request) -> Claim:
    return request.param


def _stage_keys(spec: dict[str, int]) -> None:
    """Stage ``spec[key]`` events for each key, the keys interleaved, in one transaction."""
    events = [
        {"event_type": "e", "payload": {"key": key, "n": n}, "destination": ORDERED, "key": key}
        for n in range(max(spec.values()))
        for key in spec
        if n < spec[key]
    ]
    with transaction.atomic():
        stage_many(events)


def _by_key(messages: Sequence[ClaimedMessage]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = collections.defaultdict(list)
    for message in sorted(messages, key=lambda m: (m.ordering_key, m.sequence or 0)):
        assert message.sequence is not None
        found[message.ordering_key].append(message.sequence)
    return dict(found)


def test_a_claim_takes_heads_and_their_runs_and_a_second_claim_none_of_those_keys(claim):
    _stage_keys({"a": 5, "b": 2})
    first = claim(4, uuid.uuid4())
    # Heads first, then the runs' rows round by round: a1, b1, a2, b2.
    assert _by_key(first) == {"a": [1, 2], "b": [1, 2]}
    _stage_keys({"c": 2})
    # a3.. wait behind a2 (PROCESSING under the first claim): only c's rows.
    assert _by_key(claim(10, uuid.uuid4())) == {"c": [1, 2]}
    assert claim(10, uuid.uuid4()) == []


def test_a_head_locked_by_a_claim_in_progress_holds_back_its_whole_key(claim):
    _stage_keys({"a": 3, "b": 3})
    head = OutboxMessage.objects.get(ordering_key="a", sequence=1)
    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "server_side_binding"):
        params.pop(django_only, None)
    with psycopg.connect(**params) as other, other.transaction():
        other.execute(
            "SELECT id FROM django_outbox_outboxmessage WHERE id = %s FOR UPDATE", [head.pk]
        )
        assert _by_key(claim(10, uuid.uuid4())) == {"b": [1, 2, 3]}
    assert _by_key(claim(10, uuid.uuid4())) == {"a": [1, 2, 3]}


def test_a_run_stops_at_a_row_not_due_and_the_cut_keeps_each_keys_prefix(claim):
    _stage_keys({"a": 4, "b": 4})
    OutboxMessage.objects.filter(ordering_key="a", sequence=3).update(
        status=Status.FAILED, last_error="RuntimeError: failed"
    )
    OutboxMessage.objects.filter(ordering_key="a", sequence=3).update(
        available_at=OutboxMessage.objects.get(ordering_key="a", sequence=1).created_at.replace(
            year=2999
        )
    )
    assert _by_key(claim(5, uuid.uuid4())) == {"a": [1, 2], "b": [1, 2, 3]}


def test_the_byte_bound_cuts_runs_to_prefixes():
    _stage_keys({"a": 3, "b": 3})
    size = len('{"key": "a", "n": 0}')
    messages = db.claim(
        "default", limit=10, lease_seconds=30, worker="w", token=uuid.uuid4(), max_bytes=3 * size
    )
    assert _by_key(messages) == {"a": [1, 2], "b": [1]}


# -- the relay: publish order and the finalize rule ------------------------------------


class _FailingTransport(MemoryTransport):
    """The memory transport, failing the messages whose (key, sequence) is in ``fail``
    (as a broker's nack, a basic.return or a missing confirm would): RabbitMQ cannot be
    made to refuse one chosen message of a pipelined run, so this stands in for it."""

    def __init__(self, fail: set[tuple[str, int]], permanent: bool = False) -> None:
        super().__init__(store=[])
        self.fail, self.permanent = fail, permanent

    def publish(self, route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        outcomes = super().publish(route, messages)
        return [
            Failure("nacked by the broker", permanent=self.permanent)
            if (m.ordering_key, m.sequence) in self.fail
            else outcome
            for m, outcome in zip(messages, outcomes, strict=True)
        ]


def _relay(transport: MemoryTransport) -> Relay:
    return Relay(transports={"default": transport}, batch_size=50)


def _published(transport: MemoryTransport) -> list[tuple[str, int]]:
    return [(e.ordering_key, e.sequence) for _, e in transport.store]


def test_a_failure_mid_run_publishes_only_the_prefix_and_holds_the_rest():
    _stage_keys({"a": 5, "b": 3})
    transport = _FailingTransport(fail={("a", 3)})
    with _relay(transport) as relay:
        stats = relay.run_once()
    assert (stats.published, stats.failed) == (5, 1)  # a1, a2, b1-b3; a3; a4, a5 held
    # Each key's run went out in sequence order (a4 and a5 reached the "broker" too).
    assert [s for k, s in _published(transport) if k == "a"] == [1, 2, 3, 4, 5]
    rows = {r.sequence: r for r in OutboxMessage.objects.filter(ordering_key="a")}
    assert [rows[s].status for s in (1, 2, 3, 4, 5)] == [
        Status.PUBLISHED,
        Status.PUBLISHED,
        Status.FAILED,
        Status.PENDING,
        Status.PENDING,
    ]
    assert [rows[s].attempts for s in (3, 4, 5)] == [1, 0, 0]
    assert rows[4].locked_until is None
    assert set(OutboxMessage.objects.filter(ordering_key="b").values_list("status", flat=True)) == {
        Status.PUBLISHED
    }
    # a4 and a5 are due, but wait behind a3 (not due until its retry).
    assert _production(10, uuid.uuid4()) == []
    # a3's retry comes (a4 and a5, parked until then, come with it).
    OutboxMessage.objects.filter(ordering_key="a", sequence__gte=3).update(
        available_at=rows[1].created_at
    )
    transport.fail = set()
    transport.store.clear()
    with _relay(transport) as relay:
        relay.run_once()
    assert _published(transport) == [("a", 3), ("a", 4), ("a", 5)]


def test_with_no_published_retention_a_key_flows_over_its_deleted_rows():
    """PUBLISHED_RETENTION 0 deletes each confirmed row: the gate reads a deleted
    earlier row as finished, so a key goes on in order, through a failure too."""
    with override_settings(OUTBOX={**ROUTES, "PUBLISHED_RETENTION": 0}):
        _stage_keys({"a": 5, "b": 3})
        transport = _FailingTransport(fail={("a", 3)})
        with _relay(transport) as relay:
            assert relay.run_once().published == 5
        left = OutboxMessage.objects.order_by("sequence")
        assert list(left.values_list("ordering_key", "sequence", "status")) == [
            ("a", 3, Status.FAILED),
            ("a", 4, Status.PENDING),
            ("a", 5, Status.PENDING),
        ]
        left.update(available_at=Now())  # a3's retry is due
        _stage_keys({"a": 2})
        transport.fail = set()
        transport.store.clear()
        with _relay(transport) as relay:
            relay.run_once()
        assert _published(transport) == [("a", s) for s in (3, 4, 5, 6, 7)]
        assert not OutboxMessage.objects.exists()


def _due_ordered() -> list[tuple[str, int]]:
    """The ordered rows a claim's walk of outbox_ordered_due_idx would visit now."""
    due = OutboxMessage.objects.due().filter(sequence__isnull=False)
    return sorted(due.values_list("ordering_key", "sequence"))


def test_a_failed_heads_key_waits_until_its_retry_out_of_the_claims_walk():
    """Without parking, every claim would walk (and gate out) the failed key's backlog
    before reaching other keys: the claim's cost would grow with one key's backlog."""
    _stage_keys({"a": 6, "b": 2})
    transport = _FailingTransport(fail={("a", 2)})
    with _relay(transport) as relay:
        relay.run_once()
    rows = {r.sequence: r for r in OutboxMessage.objects.filter(ordering_key="a")}
    assert rows[2].status == Status.FAILED
    # a3..a6 (held back by this batch) are due with a2's retry, not in the walk before.
    assert min(rows[s].available_at for s in (3, 4, 5, 6)) >= rows[2].available_at
    assert _due_ordered() == []
    OutboxMessage.objects.filter(ordering_key="a").update(available_at=rows[1].created_at)
    transport.fail = set()
    transport.store.clear()
    with _relay(transport) as relay:
        relay.run_once()
    assert _published(transport) == [("a", s) for s in (2, 3, 4, 5, 6)]


def test_an_abandoned_heads_key_is_parked_until_requeued_or_skipped():
    _stage_keys({"a": 4, "b": 2})
    transport = _FailingTransport(fail={("a", 2)}, permanent=True)
    with _relay(transport) as relay:
        relay.run_once()
    parked = OutboxMessage.objects.filter(ordering_key="a", sequence__gt=2)
    assert set(parked.values_list("status", "available_at")) == {(Status.PENDING, store.PARKED)}
    _stage_keys({"a": 1, "b": 1})  # staged while blocked: due (parked at the next failure)
    assert _due_ordered() == [("a", 5), ("b", 3)]
    store.abandon("default", OutboxMessage.objects.filter(ordering_key="b", sequence=3))
    assert _due_ordered() == [("a", 5)]
    head = OutboxMessage.objects.get(ordering_key="a", sequence=2)
    store.requeue_heads("default", [head.pk])
    assert _due_ordered() == [("a", s) for s in (2, 3, 4, 5)]
    store.requeue("default", OutboxMessage.objects.filter(ordering_key="b"))
    assert ("b", 3) in _due_ordered()


def test_a_skipped_head_releases_its_parked_key():
    _stage_keys({"a": 3})
    store.abandon("default", OutboxMessage.objects.filter(ordering_key="a", sequence=1))
    assert _due_ordered() == []
    head = OutboxMessage.objects.get(ordering_key="a", sequence=1)
    store.skip("default", [head.pk])
    assert [(e.sequence, e.skipped) for e in testing.drain()] == [(1, True), (2, False), (3, False)]


def test_requeuing_a_row_behind_a_blocked_head_leaves_its_key_parked():
    """outbox_requeue --id (or --status abandoned with the head FAILED) may name an
    ABANDONED row that is not its key's head: the head before it still blocks the key,
    so its waiting events must stay parked, not be walked by every claim."""
    _stage_keys({"a": 6, "b": 1})
    store.abandon("default", OutboxMessage.objects.filter(ordering_key="a", sequence=1))
    store.abandon("default", OutboxMessage.objects.filter(ordering_key="a", sequence=3))
    store.requeue("default", OutboxMessage.objects.filter(ordering_key="a", sequence=3))
    assert _due_ordered() == [("b", 1)]
    head = OutboxMessage.objects.get(ordering_key="a", sequence=1)
    store.requeue_heads("default", [head.pk])
    assert [e.sequence for e in testing.drain() if e.ordering_key == "a"] == [1, 2, 3, 4, 5, 6]


def test_requeuing_a_row_behind_a_failed_head_lets_the_key_flow_after_its_retry():
    """Only an ABANDONED row before it keeps a requeued row parked: behind a FAILED head
    (which retries by itself) the key must not stay parked for ever."""
    _stage_keys({"a": 4})
    store.abandon("default", OutboxMessage.objects.filter(ordering_key="a", sequence=3))
    transport = _FailingTransport(fail={("a", 1)})
    with _relay(transport) as relay:
        relay.run_once()
    store.requeue("default", OutboxMessage.objects.filter(ordering_key="a", sequence=3))
    # a1's retry comes, with the rows parked until then (none parked for ever).
    waiting = OutboxMessage.objects.filter(ordering_key="a").exclude(available_at=store.PARKED)
    waiting.update(available_at=Now())
    assert [e.sequence for e in testing.drain()] == [1, 2, 3, 4]


def test_a_skipped_head_releases_its_key_only_up_to_the_next_abandoned_row():
    """a3 was abandoned while a1 blocked the key: skipping a1 lets a2 go, and a3 blocks
    the key in turn, so a4 and a5 stay parked (not walked by every claim)."""
    _stage_keys({"a": 5})
    store.abandon("default", OutboxMessage.objects.filter(ordering_key="a", sequence=3))
    store.abandon("default", OutboxMessage.objects.filter(ordering_key="a", sequence=1))
    head = OutboxMessage.objects.get(ordering_key="a", sequence=1)
    store.skip("default", [head.pk])
    assert _due_ordered() == [("a", 1), ("a", 2)]
    assert [(e.sequence, e.skipped) for e in testing.drain()] == [(1, True), (2, False)]
    store.requeue_heads("default", [OutboxMessage.objects.get(ordering_key="a", sequence=3).pk])
    assert [e.sequence for e in testing.drain()] == [3, 4, 5]


def test_abandon_losing_the_race_to_a_claim_does_not_park_the_key_for_ever():
    """The operator abandons a2 while a relay's claim (not committed yet) takes a1 and
    a2: the abandon waits for the claim's lock, then finds a2 PROCESSING under a live
    lease and leaves it. It must not park a3 and a4 behind a row it did not abandon:
    nothing would release them once a1 and a2 are published."""
    _stage_keys({"a": 4})
    claimed, release = threading.Event(), threading.Event()
    token = uuid.uuid4()

    def relay_claim() -> None:
        with transaction.atomic():
            assert _by_key(_production(2, token)) == {"a": [1, 2]}
            claimed.set()
            assert release.wait(30)

    def operator_abandon() -> None:
        assert claimed.wait(30)
        assert (
            store.abandon("default", OutboxMessage.objects.filter(ordering_key="a", sequence=2))
            == 0
        )

    threads = [_Thread(relay_claim), _Thread(operator_abandon)]
    for thread in threads:
        thread.start()
    wait_until(_waiting_for_a_lock, timeout=30, what="the abandon to wait for the claim's lock")
    release.set()
    for thread in threads:
        thread.join_checked()
    ids = list(
        OutboxMessage.objects.filter(ordering_key="a", sequence__lte=2).values_list("id", flat=True)
    )
    assert store.record("default", token, published=ids, failed=[]) == set()
    assert [e.sequence for e in testing.drain()] == [3, 4]


def test_a_follower_staged_for_later_keeps_its_time_through_its_heads_failure_and_requeue():
    """An ordered event staged with available_at waits for it: parking and releasing
    the key behind a failing head must not make it due sooner."""
    later = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    with transaction.atomic():
        _stage("a", 1)
        stage("order.changed", {"n": 2}, destination=ORDERED, key="a", available_at=later)
        _stage("a", 3)
    with _relay(_FailingTransport(fail={("a", 1)})) as relay:
        relay.run_once()
    scheduled = OutboxMessage.objects.get(ordering_key="a", sequence=2)
    assert scheduled.available_at == later
    head = OutboxMessage.objects.get(ordering_key="a", sequence=1)
    store.requeue_heads("default", [head.pk])
    assert OutboxMessage.objects.get(pk=scheduled.pk).available_at == later
    assert _due_ordered() == [("a", 1), ("a", 3)]  # a3 released (it waits behind a2)
    store.abandon("default", OutboxMessage.objects.filter(pk=head.pk))
    store.skip("default", [head.pk])
    assert OutboxMessage.objects.get(pk=scheduled.pk).available_at == later
    assert [e.sequence for e in testing.drain()] == [1]


def _read(queue: str, count: int) -> list[int]:
    """The ``sequence`` headers of the next ``count`` messages of ``queue`` (declared by
    the relay with its arguments, so read with basic.get, which declares nothing)."""
    found: list[int] = []
    with kombu.Connection(AMQP_URL) as broker:
        channel = broker.channel()

        def one_more() -> bool:
            message = channel.basic_get(queue, no_ack=True)
            if message is not None:
                found.append(message.headers["sequence"])
            return len(found) == count

        wait_until(one_more, timeout=30, interval=0.05, what=f"{count} messages")
    return found


def test_a_real_nack_mid_run_publishes_only_the_prefix_and_the_rest_follows_in_order():
    """RabbitMQ nacks what a full queue (``x-overflow: reject-publish``, two messages)
    cannot take: of the key's five events, 1 and 2 are confirmed, 3 is nacked (FAILED)
    and 4 and 5 are held back; once the queue is read, 3, 4 and 5 follow in order."""
    queue = unique_destination("ordered-nack")
    route = {
        "exchange": "",
        "routing_key": queue,
        "queue": queue,
        "queue_arguments": {"x-max-length": 2, "x-overflow": "reject-publish"},
        "ordered": True,
    }
    try:
        with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": {queue: route}}):
            with transaction.atomic():
                for n in range(1, 6):
                    stage("e", {"n": n}, destination=queue, key="a")
            with Relay(batch_size=10) as relay:
                relay.run_once()
            rows = OutboxMessage.objects.order_by("sequence")
            assert [(r.status, r.attempts) for r in rows] == [
                (Status.PUBLISHED, 0),
                (Status.PUBLISHED, 0),
                (Status.FAILED, 1),
                (Status.PENDING, 0),
                (Status.PENDING, 0),
            ]
            assert _read(queue, 2) == [1, 2]
            # 3's retry comes (4 and 5, parked until then, come with it).
            OutboxMessage.objects.exclude(status=Status.PUBLISHED).update(
                available_at=rows[0].created_at
            )
            with Relay(batch_size=10) as relay:
                relay.run_once()  # 3 and 4 fit, 5 is nacked
                consumed = _read(queue, 2)
                OutboxMessage.objects.exclude(status=Status.PUBLISHED).update(
                    available_at=rows[0].created_at
                )
                relay.run_once()
            assert consumed + _read(queue, 1) == [3, 4, 5]
    finally:
        delete_queue(queue)


def test_an_abandoned_head_blocks_only_its_key():
    _stage_keys({"a": 3, "b": 3})
    transport = _FailingTransport(fail={("a", 1)}, permanent=True)
    with _relay(transport) as relay:
        while relay.run_once().claimed:
            pass
    b_rows = OutboxMessage.objects.filter(ordering_key="b")
    assert set(b_rows.values_list("status", flat=True)) == {Status.PUBLISHED}
    a_rows = OutboxMessage.objects.filter(ordering_key="a").order_by("sequence")
    assert list(a_rows.values_list("status", flat=True)) == [
        Status.ABANDONED,
        Status.PENDING,
        Status.PENDING,
    ]
    assert list(a_rows.values_list("attempts", flat=True)) == [1, 0, 0]


def test_drain_relays_ordered_rows_in_sequence_order_across_batches():
    _stage_keys({"a": 120, "b": 7})
    events = testing.drain()
    by_key: dict[str, list[int | None]] = collections.defaultdict(list)
    for event in events:
        by_key[event.ordering_key].append(event.sequence)
    assert by_key == {"a": list(range(1, 121)), "b": list(range(1, 8))}
    assert not OutboxMessage.objects.exclude(status=Status.PUBLISHED).exists()


def test_a_draining_relay_publishes_a_hot_key_whole_though_its_claims_ahead_find_nothing():
    """While a batch of the only key is in flight, the claim made ahead finds nothing;
    the relay claims again once the batch is finalized instead of calling it a day."""
    _stage_keys({"hot": 450})
    transport = MemoryTransport(store=[])
    with Relay(transports={"default": transport}, batch_size=100) as relay:
        stats = relay.run(threading.Event(), drain=True)
    assert stats.published == 450
    assert _published(transport) == [("hot", s) for s in range(1, 451)]


@contextlib.contextmanager
def _slow_finalize(seconds: float) -> Iterator[None]:
    """Every transaction that marks rows PUBLISHED takes ``seconds`` longer: a trigger
    sleeps at its first such row. Dropped at the end."""
    table = connection.ops.quote_name(OutboxMessage._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION outbox_test_slow_finalize() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN IF current_setting('outbox_test.slept', true) IS DISTINCT FROM 'yes' THEN"
            " PERFORM set_config('outbox_test.slept', 'yes', true);"
            f" PERFORM pg_sleep({seconds:g}); END IF; RETURN NEW; END $$"
        )
        cursor.execute(
            f"CREATE TRIGGER outbox_test_slow_finalize BEFORE UPDATE ON {table} FOR EACH ROW"
            " WHEN (NEW.status = 'published') EXECUTE FUNCTION outbox_test_slow_finalize()"
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER outbox_test_slow_finalize ON {table}")
            cursor.execute("DROP FUNCTION outbox_test_slow_finalize()")


def test_a_claim_made_ahead_waits_for_the_finalize_of_a_batch_of_ordered_rows(monkeypatch):
    """Eight keys of two rows, batches of four: the third claim wants the second rows of
    the first batch's keys. It is made ahead while that batch is finalized (on a thread
    of its own, slowed here by a trigger), and waits for the finalize instead of coming
    back empty: every claim but the last ones is full."""
    _stage_keys({f"k{n}": 2 for n in range(8)})
    sizes: list[int] = []
    claim = store.claim

    def counted(*args: object, **kwargs: object) -> list[ClaimedMessage]:
        claimed = claim(*args, **kwargs)  # type: ignore[arg-type]
        sizes.append(len(claimed))
        return claimed

    monkeypatch.setattr(store, "claim", counted)  # a spy: every claim runs as it would
    transport = MemoryTransport(store=[])
    with _slow_finalize(0.5), Relay(transports={"default": transport}, batch_size=4) as relay:
        stats = relay.run(threading.Event(), drain=True)
    assert stats.published == 16
    assert sizes[:4] == [4, 4, 4, 4] and not any(sizes[4:])
    assert sorted(_published(transport)) == [(f"k{n}", s) for n in range(8) for s in (1, 2)]


def test_a_claim_made_ahead_does_not_wait_for_the_finalize_of_a_batch_without_ordered_rows(
    monkeypatch,
):
    """The other side of the test above: rows of a route that is not ordered need no
    finalize before the next claim. Claim ``n`` is made ahead while batch ``n - 1`` is
    published; gated, it would wait for the finalize of batch ``n - 2`` (slowed here by
    a trigger to a second); it does not."""
    _stage_plain(16)
    ended: list[None] = []  # one item per finalize that ended
    seen: list[int] = []  # per claim: how many finalizes had ended when it started
    claim, record = store.claim, store.record

    def claiming(*args: object, **kwargs: object) -> list[ClaimedMessage]:
        seen.append(len(ended))
        return claim(*args, **kwargs)  # type: ignore[arg-type]

    def recording(*args: object, **kwargs: object) -> object:
        try:
            return record(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            ended.append(None)

    monkeypatch.setattr(store, "claim", claiming)  # spies: every claim and finalize runs
    monkeypatch.setattr(store, "record", recording)
    transport = MemoryTransport(store=[])
    with _slow_finalize(1.0), Relay(transports={"default": transport}, batch_size=4) as relay:
        stats = relay.run(threading.Event(), drain=True)
    assert stats.published == 16
    assert any(finalized < n - 1 for n, finalized in enumerate(seen) if n >= 2), seen


# -- a relay whose settings order no route -------------------------------------------

#: The routes of this module with nothing ordered: a relay of another process's settings.
ORDERING_NOTHING = {
    **ROUTES,
    "ROUTES": {ORDERED: {"exchange": "orders"}, PLAIN: {"exchange": "orders"}},
}


def _left_behind(key: str, n: int) -> None:
    """``n`` rows of ``key`` on the ordered route, numbered 1..n, as a route that was
    ordered left them (written directly: the settings in force order nothing)."""
    for sequence in range(1, n + 1):
        OutboxMessageFactory(destination=ORDERED, ordering_key=key, sequence=sequence)


def _stage_plain(n: int) -> None:
    with transaction.atomic():
        for i in range(n):
            stage("order.changed", {"n": i}, destination=PLAIN)


@contextlib.contextmanager
def _relay_ordering_nothing(poll_interval: float) -> Iterator[MemoryTransport]:
    """A relay (batch 2) whose settings order no route, running on a thread of its own
    until the block ends; yields the transport it publishes to."""
    transport = MemoryTransport(store=[])
    stop = threading.Event()
    with override_settings(OUTBOX={**ORDERING_NOTHING, "POLL_INTERVAL": poll_interval}):
        relay = Relay(transports={"default": transport}, batch_size=2)
        runner = _Thread(lambda: relay.run(stop))
        runner.start()
        try:
            yield transport
        finally:
            stop.set()
            runner.join_checked()


@pytest.mark.parametrize("vendor", ["postgresql", "portable"])
def test_the_unordered_claim_leaves_ordered_rows_alone(vendor):
    _stage_keys({"a": 2})
    _stage_plain(2)
    if vendor == "postgresql":
        claim = functools.partial(db.claim, "default", limit=10, lease_seconds=30, worker="w")
    else:
        claim = functools.partial(db._claim_portable, "default", 10, 2**62, 30, "w")
    unordered = claim(token=uuid.uuid4(), ordered=False)
    assert [(m.destination, m.sequence) for m in unordered] == [(PLAIN, None), (PLAIN, None)]
    assert _by_key(claim(token=uuid.uuid4(), ordered=True)) == {"a": [1, 2]}


def test_between_its_whole_claims_a_relay_ordering_nothing_leaves_ordered_rows_alone():
    """A run's first claim is whole; the next ones, until POLL_INTERVAL has passed, take
    unordered rows only; run_once() claims whole."""
    transport = MemoryTransport(store=[])
    with override_settings(OUTBOX={**ORDERING_NOTHING, "POLL_INTERVAL": 3600}):
        with Relay(transports={"default": transport}) as relay:
            _stage_plain(1)
            assert relay.run_once().published == 1
            batches = relay.batches()  # a run's
            assert batches.claim() is None  # whole, the first: nothing due
            with override_settings(OUTBOX=ROUTES):  # another process, ordering the route
                _stage_keys({"a": 2})
            assert batches.claim() is None  # unordered only
            assert relay.run_once().published == 2
    assert _published(transport)[1:] == [("a", 1), ("a", 2)]


def test_a_drain_ordering_nothing_publishes_ordered_rows_left_behind_in_order():
    """The whole first claim finds only unordered rows (the oldest); the later claims are
    unordered, so the drain claims whole once more before it calls the table empty."""
    _stage_plain(4)
    _stage_keys({"a": 3, "b": 1})
    transport = MemoryTransport(store=[])
    with override_settings(OUTBOX={**ORDERING_NOTHING, "POLL_INTERVAL": 3600}):
        with Relay(transports={"default": transport}, batch_size=2) as relay:
            stats = relay.run(threading.Event(), drain=True)
    assert stats.published == 8
    published = [item for item in _published(transport) if item[1] is not None]
    assert sorted(published) == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
    assert [s for key, s in published if key == "a"] == [1, 2, 3]


def test_a_running_relay_ordering_nothing_claims_a_keys_batches_back_to_back():
    """While a key's batch is in flight its next rows are hidden from claims (the claim made
    ahead finds none): claims stay whole for a POLL_INTERVAL after one found ordered rows,
    so the key's next batch follows at once, not a POLL_INTERVAL (an hour here) later."""
    _stage_keys({"a": 7})
    with _relay_ordering_nothing(poll_interval=3600) as transport:
        wait_until(lambda: len(transport.store) == 7, timeout=30, what="the key's 4 batches")
    assert _published(transport) == [("a", s) for s in range(1, 8)]


def test_a_running_relay_ordering_nothing_publishes_ordered_rows_within_a_poll_interval():
    """Rows a route left behind when it stopped being ordered: the relay's claims between
    whole ones pass them by; its next whole claim, at most a POLL_INTERVAL later, takes
    them, and it keeps claiming whole while it finds ordered rows."""
    with _relay_ordering_nothing(poll_interval=1) as transport:
        _stage_plain(1)
        wait_until(lambda: len(transport.store) == 1, timeout=30, what="the plain row")
        _left_behind("a", 5)
        wait_until(lambda: len(transport.store) == 6, timeout=30, what="the ordered rows")
    assert _published(transport)[1:] == [("a", s) for s in range(1, 6)]


def test_a_drain_after_run_once_claims_whole_before_it_ends():
    """``run_once()`` claims whole and finds no ordered row, so the drain's claims are
    unordered; with nothing pending, the drain still claims whole once before it ends."""
    transport = MemoryTransport(store=[])
    with override_settings(OUTBOX={**ORDERING_NOTHING, "POLL_INTERVAL": 3600}):
        with Relay(transports={"default": transport}) as relay:
            _stage_plain(1)
            assert relay.run_once().published == 1
            _left_behind("a", 3)
            stats = relay.run(threading.Event(), drain=True)
    assert stats.published == 3
    assert _published(transport)[1:] == [("a", 1), ("a", 2), ("a", 3)]


# -- the plan ---------------------------------------------------------------------------


@pytest.mark.slow
def test_the_ordered_claim_reads_the_partial_indexes_on_a_large_table():
    """200,000 published rows, 2,000 pending ordered rows over 200 keys, 1,000 unordered:
    the claim's plan reads each part through its partial index, never the whole table."""
    table = OutboxMessage._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO {table} (event_id, event_type, destination, payload, headers,
                ordering_key, available_at, status, attempts, locked_by, last_error,
                created_at, sequence, published_at)
            SELECT gen_random_uuid(), 'e', %s, '{{}}', '{{}}', 'k' || (i %% 200), now(),
                   CASE WHEN i <= 200000 THEN 'published' ELSE 'pending' END, 0, '', '',
                   now(), i / 200 + 1, CASE WHEN i <= 200000 THEN now() END
            FROM generate_series(1, 202000) AS i""",
            [ORDERED],
        )
        cursor.execute(
            f"""INSERT INTO {table} (event_id, event_type, destination, payload, headers,
                ordering_key, available_at, status, attempts, locked_by, last_error, created_at)
            SELECT gen_random_uuid(), 'e', %s, '{{}}', '{{}}', '', now(), 'pending', 0, '', '',
                   now()
            FROM generate_series(1, 1000)""",
            [PLAIN],
        )
        cursor.execute(f"ANALYZE {table}")
        cursor.execute(
            f"EXPLAIN {postgresql._claim_sql()}",
            [100, 100, 100, 100, 2**40, 30, "w", uuid.uuid4()],
        )
        plan = as_on_the_table("\n".join(row[0] for row in cursor.fetchall()))
    assert f"Seq Scan on {table}" not in plan, plan
    for index in ("outbox_due_idx", "outbox_ordered_due_idx", "outbox_key_unfinished_idx"):
        assert index in plan, plan
    with connection.cursor() as cursor:
        cursor.execute(
            f"EXPLAIN {postgresql._claim_sql(ordered=False)}",
            [100, 100, 2**40, 30, "w", uuid.uuid4()],
        )
        unordered = as_on_the_table("\n".join(row[0] for row in cursor.fetchall()))
    assert f"Seq Scan on {table}" not in unordered, unordered
    assert "outbox_due_idx" in unordered and "outbox_ordered_due_idx" not in unordered
    claimed = _production(100, uuid.uuid4())
    assert len(claimed) == 100


# -- SQLite -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
def test_sqlite_stages_numbers_and_one_relay_publishes_in_order():
    with transaction.atomic(using="lite"):
        for n in range(6):
            stage("e", {"n": n}, destination=ORDERED, key="ab"[n % 2], using="lite")
    rows = OutboxMessage.objects.using("lite").order_by("id")
    assert list(rows.values_list("ordering_key", "sequence")) == [
        ("a", 1),
        ("b", 1),
        ("a", 2),
        ("b", 2),
        ("a", 3),
        ("b", 3),
    ]
    events = testing.drain("lite")
    assert [(e.ordering_key, e.sequence) for e in events if e.ordering_key == "a"] == [
        ("a", 1),
        ("a", 2),
        ("a", 3),
    ]
    assert len(events) == 6
