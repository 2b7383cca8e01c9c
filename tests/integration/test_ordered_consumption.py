"""Ordered consumption on real RabbitMQ and PostgreSQL: the inbox's last sequence per
(consumer, destination, key) makes run_outbox_consumer handle each key's events in
sequence, whatever order the broker delivers them in, and partition queues share an
ordered route among consumer processes without breaking that order.

Until the ordered claim exists, the tests publish claimed messages they build
themselves through the relay's kombu transport: the body as JSON and the headers
event_id, event_type, ordering_key, destination, sequence (and skipped on a skip
marker), exactly as the relay sends them."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import random
import signal
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator

import kombu
import psycopg
import pytest
from django.core.management import CommandError, call_command
from django.db import connection, transaction
from django.db.backends.signals import connection_created
from django.test import override_settings

from django_outbox import ReceivedEvent, stage
from django_outbox.conf import outbox_settings
from django_outbox.consumer import InboxConsumer
from django_outbox.consumer.replay import replay_parked
from django_outbox.envelope import ClaimedMessage
from django_outbox.inbox import positions_of, start_positions
from django_outbox.models import InboxFailure, InboxSequence
from django_outbox.transports import for_broker
from django_outbox.transports.declare import DeclareRefused, declare
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    broker_connection,
    delete_queue,
    manage,
    run_relay,
    start_command,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp.models import Delivery

pytestmark = pytest.mark.django_db(transaction=True)

#: (ordering key, sequence), or (key, sequence, "skipped") for a skip marker.
Event = tuple


def event_id(destination: str, key: str, sequence: int) -> str:
    """The same id for every copy of one event, so a republished copy is a duplicate."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{destination}/{key}/{sequence}"))


def publish(destination: str, events: Iterable[Event]) -> None:
    """Publish ``events`` in the given order through the relay's own transport (its
    declarations, wire format, mandatory flag and confirms), as the ordered relay will."""
    route = outbox_settings.route_for(destination)
    messages = [
        ClaimedMessage(
            id=number,
            event_id=uuid.UUID(event_id(destination, key, sequence)),
            event_type="test.ordered",
            destination=destination,
            payload=json.dumps({"key": key, "n": sequence}),
            headers={},
            ordering_key=key,
            attempts=0,
            created_at=dt.datetime.now(dt.UTC),
            sequence=sequence,
            skipped=bool(skipped),
        )
        for number, (key, sequence, *skipped) in enumerate(events, 1)
    ]
    transport = for_broker(outbox_settings.require_broker(route.broker))
    try:
        assert transport.publish(route, messages) == [None] * len(messages)  # all confirmed
    finally:
        transport.close()


class Recorder:
    """An in-process handler that remembers the (key, sequence) of each run."""

    def __init__(self, fail=lambda event: False) -> None:
        self.runs: list[tuple[str, int]] = []
        self.fail = fail
        self.failures = 0

    def __call__(self, event: ReceivedEvent) -> None:
        if self.fail(event):
            self.failures += 1
            raise RuntimeError(f"handler refuses {event.ordering_key} {event.sequence}")
        self.runs.append((event.ordering_key, event.sequence))

    def of(self, key: str) -> list[int]:
        return [sequence for run_key, sequence in self.runs if run_key == key]


@pytest.fixture
def destination():
    name = unique_destination("o")
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "DEFAULT_ORDERED": True}):
        yield name
    delete_queue(name)


def consume(destination: str, handler, **options) -> InboxConsumer:
    consumer = InboxConsumer(
        destination, handler, "ordered", retry_delay=0.05, retry_max_delay=0.2, **options
    )
    consumer.run(idle_timeout=2)
    return consumer


def test_a_key_fed_out_of_order_is_handled_in_sequence_and_duplicates_are_acked(destination):
    publish(destination, [("a", 3), ("b", 2), ("a", 1), ("a", 2), ("b", 1), ("a", 5), ("a", 4)])
    publish(destination, [("a", 2), ("b", 1)])  # copies of events already delivered
    handler = Recorder()
    stats = consume(destination, handler).stats
    assert handler.of("a") == [1, 2, 3, 4, 5]
    assert handler.of("b") == [1, 2]
    assert stats.handled == 7
    assert stats.duplicates == 2  # acked, handler not run
    assert stats.held >= 2  # a3 and b2 at least came before their predecessors
    assert stats.failed == stats.parked == stats.rejected == 0
    last = dict(InboxSequence.objects.values_list("ordering_key", "last_sequence"))
    assert last == {"a": 5, "b": 2}


def test_a_failing_handler_holds_back_only_its_key(destination):
    """a1 fails until every event of b was handled: b flows while a waits, and a's
    successors, delivered meanwhile, are held back and then handled in sequence."""
    publish(destination, [(key, n) for n in range(1, 6) for key in ("a", "b")])
    b_done = threading.Event()

    def fail(event: ReceivedEvent) -> bool:
        if event.ordering_key == "b" and event.sequence == 5:
            b_done.set()
        return event.ordering_key == "a" and event.sequence == 1 and not b_done.is_set()

    handler = Recorder(fail)
    stats = consume(destination, handler, max_deliveries=None).stats
    assert handler.failures >= 1
    assert handler.of("a") == [1, 2, 3, 4, 5]
    assert handler.of("b") == [1, 2, 3, 4, 5]
    assert handler.runs.index(("b", 5)) < handler.runs.index(("a", 1))
    assert stats.handled == 10
    assert stats.failed == handler.failures
    assert stats.held >= 1  # a2 came while a1 was failing


def test_a_skip_marker_moves_the_key_on_without_the_handler(destination, caplog):
    publish(destination, [("a", 1), ("a", 3), ("a", 2, "skipped"), ("a", 4)])
    handler = Recorder()
    with caplog.at_level("WARNING", logger="django_outbox.consumer"):
        stats = consume(destination, handler).stats
    assert handler.of("a") == [1, 3, 4]
    assert stats.handled == 3
    assert stats.ignored == 1
    assert InboxSequence.objects.get(ordering_key="a").last_sequence == 4
    (marker,) = [r for r in caplog.records if getattr(r, "action", "") == "inbox.skip_marker"]
    assert marker.sequence == 2


def publish_raw(queue: str, **headers: object) -> None:
    """Publish one message with a new event id and ``headers``, not through the relay."""
    with broker_connection() as connection:
        channel = connection.channel()
        declare(channel, outbox_settings.route_for(queue))
        kombu.Producer(channel).publish(
            b"{}",
            routing_key=queue,
            content_type="application/json",
            content_encoding="utf-8",
            headers={"event_id": str(uuid.uuid4()), **headers},
        )


def test_an_event_with_a_sequence_but_no_key_is_rejected(destination):
    publish_raw(destination, sequence=1, destination=destination)
    stats = consume(destination, Recorder()).stats
    assert stats.rejected == 1
    assert not InboxSequence.objects.exists()


@pytest.mark.parametrize("sequence", ["1", True, 1.0])
def test_an_event_whose_sequence_is_not_a_whole_number_is_rejected_not_handled(
    destination, sequence
):
    """Read as "no sequence", it would run as an unordered event: out of its key's turn,
    and its key stalled for ever behind the number it never advanced to."""
    publish_raw(destination, sequence=sequence, destination=destination, ordering_key="a")
    handler = Recorder()
    stats = consume(destination, handler).stats
    assert (stats.rejected, handler.runs) == (1, [])


def test_a_new_consumer_on_an_old_stream_starts_where_it_is_told(destination):
    """A new consumer name expects sequence 1 of every key: on a stream whose early
    events it never receives it would hold every event back for ever. Its starting
    positions, set first (by hand or copied from a consumer that is up to date), let
    it take the stream from there."""
    call_command(
        "outbox_inbox_start",
        "--consumer",
        "old",
        "--destination",
        destination,
        "--position",
        "a=2",
        "b=x=1",
        stdout=io.StringIO(),
    )
    call_command(
        "outbox_inbox_start", "--consumer", "ordered", "--like", "old", stdout=io.StringIO()
    )
    publish(destination, [("a", 4), ("a", 2), ("a", 3), ("b=x", 2)])
    handler = Recorder()
    stats = consume(destination, handler).stats
    assert (handler.of("a"), handler.of("b=x"), stats.duplicates) == ([3, 4], [2], 1)
    # A key only moves forward: handlers never run twice.
    assert start_positions("ordered", {(destination, "a"): 1}) == 0
    assert positions_of("ordered") == {(destination, "a"): 4, (destination, "b=x"): 2}


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--position", "a=1"], "--position needs --destination"),
        ([], "nothing to set"),
        (["--destination", "d", "--position", "a=-1"], "must be an integer of 0 or more"),
        (["--destination", "d", "--position", "a"], "must be KEY=LAST"),
    ],
)
def test_outbox_inbox_start_refuses_what_it_cannot_set_in_one_line(args, error):
    with pytest.raises(CommandError, match=error):
        call_command("outbox_inbox_start", "--consumer", "c", *args)
    assert not InboxSequence.objects.exists()


def test_a_parked_head_blocks_its_key_until_it_is_replayed(destination):
    publish(destination, [(key, n) for n in range(1, 4) for key in ("a", "b")])
    fixed = threading.Event()
    handler = Recorder(
        lambda event: event.ordering_key == "a" and event.sequence == 1 and not fixed.is_set()
    )
    consumer = InboxConsumer(
        destination, handler, "ordered", max_deliveries=2, retry_delay=0.05, retry_max_delay=0.1
    )
    thread = threading.Thread(target=consumer.run)
    thread.start()
    try:
        wait_until(lambda: InboxFailure.objects.parked().exists(), timeout=60, what="a1 parked")
        wait_until(lambda: handler.of("b") == [1, 2, 3], timeout=60, what="b handled")
        assert handler.of("a") == []  # a2 and a3 wait behind the parked a1
        fixed.set()
        (replayed,) = replay_parked(InboxFailure.objects.all())
        assert replayed.queue == destination
        wait_until(lambda: handler.of("a") == [1, 2, 3], timeout=60, what="a resumed")
    finally:
        consumer.stop.set()
        thread.join(timeout=60)
    assert consumer.stats.parked == 1
    assert consumer.stats.held >= 2


# -- partition queues, three consumer processes -------------------------------------------

PARTITIONS = 6
KEYS = 30
EVENTS_PER_KEY = 10


def partitioned_route(destination: str) -> dict:
    return {"ROUTES": {destination: {"queue": destination, "ordered": True, "partitions": 6}}}


def shuffled_within_pairs(events: list[Event], rng: random.Random) -> list[Event]:
    """Swap some neighbours, as a requeue or a nacked publication would."""
    events = list(events)
    for index in range(0, len(events) - 1, 2):
        if rng.random() < 0.3:
            events[index], events[index + 1] = events[index + 1], events[index]
    return events


@pytest.fixture
def partitioned():
    name = unique_destination("p")
    outbox = {"BROKER_URL": AMQP_URL, **partitioned_route(name)}
    with override_settings(OUTBOX=outbox):
        yield name
    route = outbox_settings.route_for(name)
    for queue in route.partition_queues:
        delete_queue(queue)
    with broker_connection() as connection:
        kombu.Exchange(route.partition_exchange, channel=connection.channel()).delete()


@pytest.mark.slow  # three consumer processes
def test_three_consumers_over_partition_queues_keep_per_key_order_and_share_the_load(
    partitioned,
):
    outbox = partitioned_route(partitioned)
    rng = random.Random(14)
    keys = [f"order-{number}" for number in range(KEYS)]
    events = [(key, n) for n in range(1, EVENTS_PER_KEY + 1) for key in keys]
    publish(partitioned, shuffled_within_pairs(events, rng))
    shares = ("0,3", "1,4", "2,5")
    consumers = [
        start_command(
            "run_outbox_consumer",
            *("--queue", partitioned, "--partitions", share),
            *("--handler", "tests.testapp.handlers.ordered", "--consumer", "ordered"),
            *("--retry-delay", "0.05", "--retry-max-delay", "0.5"),
            **outbox,
        )
        for share in shares
    ]
    try:
        total = KEYS * EVENTS_PER_KEY
        wait_until(lambda: Delivery.objects.count() >= total, timeout=180, what="every event")
    finally:
        results = [stop(process, signal.SIGTERM) for process in consumers]
    for code, _out, err in results:
        assert code == 0, err
    handled: dict[str, list[int]] = defaultdict(list)
    by_process: dict[str, set[str]] = defaultdict(set)
    for consumer, n in Delivery.objects.order_by("id").values_list("consumer", "n"):
        pid, key = consumer.split(" ")
        handled[key].append(n)
        by_process[pid].add(key)
    assert {key: handled[key] for key in keys} == {
        key: list(range(1, EVENTS_PER_KEY + 1)) for key in keys
    }
    assert len(by_process) == 3  # every process took a share of the keys ...
    owners = [pid for pid, owned in by_process.items() for _key in owned]
    assert len(owners) == KEYS  # ... and each key was handled by one process only
    print("keys per consumer process:", sorted(len(owned) for owned in by_process.values()))


def subscribed(destination: str) -> bool:
    """Whether every partition queue of ``destination`` has a consumer."""
    with broker_connection() as connection:
        channel = connection.channel()
        route = outbox_settings.route_for(destination)
        return all(
            channel.queue_declare(queue, passive=True).consumer_count > 0
            for queue in route.partition_queues
        )


def test_a_standby_takes_over_a_partition_when_the_active_consumer_is_killed(partitioned):
    outbox = partitioned_route(partitioned)
    keys = [f"order-{number}" for number in range(KEYS)]
    publish(partitioned, [(key, n) for n in range(1, EVENTS_PER_KEY + 1) for key in keys])
    command = (
        *("run_outbox_consumer", "--queue", partitioned),
        *("--handler", "tests.testapp.handlers.slow_ordered", "--consumer", "ordered"),
        *("--retry-delay", "0.05", "--retry-max-delay", "0.5"),
    )
    active = start_command(*command, **outbox)
    try:
        wait_until(lambda: subscribed(partitioned), timeout=60, what="the first consumer active")
        standby = start_command(*command, **outbox)
        wait_until(lambda: Delivery.objects.count() >= 50, timeout=60, what="50 events handled")
        # Nothing went to the standby while the active consumer was alive.
        pids = {
            consumer.split(" ")[0]
            for consumer in Delivery.objects.values_list("consumer", flat=True)
        }
        assert pids == {str(active.pid)}
        active.kill()
        active.communicate(timeout=60)
        total = KEYS * EVENTS_PER_KEY
        wait_until(lambda: Delivery.objects.count() >= total, timeout=180, what="every event")
    finally:
        if active.poll() is None:
            active.kill()
            active.communicate()
        code, _out, err = stop(standby, signal.SIGTERM)
    assert code == 0, err
    handled: dict[str, list[int]] = defaultdict(list)
    pids = set()
    for consumer, n in Delivery.objects.order_by("id").values_list("consumer", "n"):
        pid, key = consumer.split(" ")
        handled[key].append(n)
        pids.add(pid)
    assert pids == {str(active.pid), str(standby.pid)}
    # In sequence and once each: what the killed consumer held unacked came back as
    # duplicates (handled and committed) or in its turn (not committed).
    assert dict(handled) == {key: list(range(1, EVENTS_PER_KEY + 1)) for key in keys}


def test_partitions_on_redis_are_a_one_line_configuration_error():
    name = unique_destination("r")
    outbox = {"BROKER_URL": REDIS_URL, **partitioned_route(name)}
    with override_settings(OUTBOX=outbox):
        consumer = InboxConsumer(name, Recorder(), "ordered")
        with pytest.raises(DeclareRefused, match="partitions need RabbitMQ") as caught:
            consumer.run(idle_timeout=5)
    assert "\n" not in str(caught.value)


def test_run_outbox_consumer_refuses_partitions_the_route_does_not_have(partitioned):
    result = manage(
        "run_outbox_consumer",
        *("--queue", partitioned, "--partitions", "2-9"),
        *("--handler", "tests.testapp.handlers.ordered", "--consumer", "ordered"),
        **partitioned_route(partitioned),
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"CommandError: queue {partitioned!r} has partitions 0-5; got 6, 7, 8, 9"
    )


def test_events_of_types_the_handler_does_not_handle_still_move_their_key_on(destination):
    publish(destination, [("a", 2), ("a", 1), ("a", 3)])
    handler = Recorder()
    stats = consume(destination, handler, event_types=["other.type"]).stats
    assert handler.runs == []
    assert stats.ignored == 3
    assert InboxSequence.objects.get(ordering_key="a").last_sequence == 3


def test_two_consumers_on_one_plain_queue_still_handle_each_key_in_sequence(destination):
    """Without partitions, two processes take neighbouring events of one key at once:
    the key's locked InboxSequence row serializes them, and early ones are held back."""
    keys = [f"k{number}" for number in range(5)]
    publish(destination, [(key, n) for n in range(1, 21) for key in keys])
    command = (
        *("run_outbox_consumer", "--queue", destination, "--prefetch", "10"),
        *("--handler", "tests.testapp.handlers.ordered", "--consumer", "ordered"),
        *("--retry-delay", "0.05", "--retry-max-delay", "0.2"),
    )
    outbox = {"DEFAULT_ORDERED": True}
    consumers = [start_command(*command, **outbox) for _ in range(2)]
    try:
        wait_until(lambda: Delivery.objects.count() >= 100, timeout=180, what="every event")
    finally:
        results = [stop(process, signal.SIGTERM) for process in consumers]
    for code, _out, err in results:
        assert code == 0, err
    handled: dict[str, list[int]] = defaultdict(list)
    for consumer, n in Delivery.objects.order_by("id").values_list("consumer", "n"):
        handled[consumer.split(" ")[1]].append(n)
    assert dict(handled) == {key: list(range(1, 21)) for key in keys}


# -- end to end: stage, the ordered relay, partition queues ---------------------------------


@pytest.mark.slow  # three consumer processes
def test_staged_events_reach_three_partition_consumers_in_commit_order(partitioned):
    """stage() numbers each key's events, run_outbox_relay (small batches) publishes them
    through the partitioned route, and three consumer processes handle every key in
    sequence: the events of each key in the order their transactions committed."""
    outbox = partitioned_route(partitioned)
    keys = [f"order-{number}" for number in range(20)]
    staged: dict[str, list[str]] = defaultdict(list)
    for n in range(1, 11):
        with transaction.atomic():  # one transaction stages one event of every key
            for key in keys:
                row = stage("order.changed", {"n": n}, destination=partitioned, key=key)
                staged[key].append(str(row.event_id))
    consumers = [
        start_command(
            "run_outbox_consumer",
            *("--queue", partitioned, "--partitions", share),
            *("--handler", "tests.testapp.handlers.ordered", "--consumer", "ordered"),
            **outbox,
        )
        for share in ("0,3", "1,4", "2,5")
    ]
    try:
        run_relay("--drain", "--batch-size", "7", **outbox)
        wait_until(lambda: Delivery.objects.count() >= 200, timeout=180, what="every event")
    finally:
        results = [stop(process, signal.SIGTERM) for process in consumers]
    for code, _out, err in results:
        assert code == 0, err
    handled: dict[str, list[str]] = defaultdict(list)
    pids = set()
    for consumer, event in Delivery.objects.order_by("id").values_list("consumer", "event_id"):
        pid, key = consumer.split(" ")
        handled[key].append(str(event))
        pids.add(pid)
    assert dict(handled) == dict(staged)
    assert len(pids) == 3


#: The sessions of the test database waiting for a lock, but the one asking.
LOCK_WAITERS = (
    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
    "AND datname = current_database() AND pid <> pg_backend_pid()"
)


@contextlib.contextmanager
def sequences_locked() -> Iterator[None]:
    """The inbox's sequence table locked by a session of its own (ACCESS EXCLUSIVE) until
    the block ends: every statement on it waits, a read without a lock too."""
    with psycopg.connect(**connection.get_connection_params()) as session:
        session.execute(f'LOCK TABLE "{InboxSequence._meta.db_table}" IN ACCESS EXCLUSIVE MODE')
        yield


def redeliver(queue: str) -> None:
    """Take the message on ``queue`` and requeue it: the broker marks it redelivered, and
    the consumer reads its key's turn before it counts the delivery."""
    with broker_connection() as broker:
        bound = kombu.Queue(queue, no_declare=True)(broker.channel())
        wait_until(bound.get, timeout=30, what="the message").requeue()


def test_an_ordered_redelivery_whose_session_ends_is_an_outage_not_a_delivery(destination):
    """The consumer's session ended (pg_terminate_backend) while it reads a redelivered
    event's turn: a database outage, the event requeued uncounted and handled once the
    consumer is connected again."""
    publish(destination, [("k", 1)])
    redeliver(destination)
    handler, stopping = Recorder(), threading.Event()
    consumer = InboxConsumer(destination, handler, "ordered", stop=stopping)
    runner = threading.Thread(target=consumer.run)
    try:
        params = connection.get_connection_params()
        with sequences_locked(), psycopg.connect(**params, autocommit=True) as session:
            runner.start()
            (pid,) = wait_until(
                lambda: session.execute(LOCK_WAITERS).fetchone(), timeout=60, what="a waiter"
            )
            session.execute("SELECT pg_terminate_backend(%s)", [pid])
        wait_until(lambda: handler.runs, timeout=60, what="the event handled")
    finally:
        stopping.set()
        runner.join(timeout=60)
    assert handler.runs == [("k", 1)]
    assert (consumer.stats.failed, consumer.stats.parked) == (0, 0)
    assert not InboxFailure.objects.exists()


def test_an_ordered_redelivery_whose_turn_fails_on_a_usable_connection_is_a_failure(
    destination,
):
    """A statement that fails on a connection still usable (the consumer session's
    lock_timeout, the sequence table locked by another) is a failed delivery on an ordered
    route as on any other: counted, and parked at max_deliveries. It was read as a
    database outage there, the event requeued uncounted for as long as the lock stayed."""
    publish(destination, [("k", 1)])
    redeliver(destination)

    def lock_timeout(sender, connection, **kwargs) -> None:
        if threading.current_thread().name == "ordered-consumer":
            with connection.cursor() as cursor:
                cursor.execute("SET lock_timeout = '200ms'")

    handler, stopping = Recorder(), threading.Event()
    consumer = InboxConsumer(
        destination, handler, "ordered", max_deliveries=2, retry_delay=0.05, stop=stopping
    )
    runner = threading.Thread(target=consumer.run, name="ordered-consumer")
    connection_created.connect(lock_timeout)
    try:
        with sequences_locked():
            runner.start()
            wait_until(lambda: consumer.stats.parked, timeout=60, what="the event parked")
    finally:
        stopping.set()
        runner.join(timeout=60)
        connection_created.disconnect(lock_timeout)
    assert handler.runs == []
    failure = InboxFailure.objects.parked().get()
    assert failure.attempts == 2
    assert failure.last_error.startswith("OperationalError: canceling statement due to lock")
