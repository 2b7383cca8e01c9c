"""Strict per-key order end to end (issue 14), on real PostgreSQL and RabbitMQ.

Four producer threads commit events for a dozen keys. Each transaction locks its key's
business row (a ``testapp.Order`` whose ``total`` counts the key's events) and stages the
event with that count in its payload, so the count is the key's commit order. Two relay
processes with a batch of five publish them while RabbitMQ is stopped and started, and
one relay is SIGKILLed while it holds a claim and then restarted. The queue is read at
the end: its order is the order a first consumer would receive the events in.

On an ordered route, for every key the first delivery of each event comes in commit
order with no gap, and its ``sequence`` header is its commit count. The same run on an
unordered route shows the violation the ordered route fixes.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import threading
from collections.abc import Callable

import pytest
from django.db import connection, transaction
from django.test.utils import override_settings

from django_outbox import stage
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from tests.support import (
    AMQP_URL,
    consume,
    delete_queue,
    services,
    start_relay,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp.models import Order

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.disrupts]

KEYS = [f"key-{n:02d}" for n in range(12)]
PRODUCERS = 4
RELAY_KNOBS = {
    "LEASE_SECONDS": 3,
    "RETRY_BASE_DELAY": 0.2,
    "RETRY_MAX_DELAY": 2,
    "MAX_ATTEMPTS": 1000,  # the outage must abandon nothing
    "POLL_INTERVAL": 0.2,
}
Status = OutboxMessage.Status


class Producers:
    """``PRODUCERS`` threads, each committing one event at a time for a random key until
    stopped. The transaction locks the key's ``Order`` row, counts the event on it, and
    stages the event with that count: the count is the key's commit order."""

    def __init__(self, destination: str, seed: int) -> None:
        self.destination = destination
        self.stopping = threading.Event()
        self.committed = 0
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._rows = {key: Order.objects.create(customer=key, total=0).pk for key in KEYS}
        self._threads = [
            threading.Thread(target=self._run, args=(random.Random(seed + n),), daemon=True)
            for n in range(PRODUCERS)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> int:
        """Stop the threads; the number of events committed."""
        self.stopping.set()
        for thread in self._threads:
            thread.join(60)
        assert not self.errors, self.errors
        return self.committed

    def _run(self, rng: random.Random) -> None:
        try:
            while not self.stopping.is_set():
                self._commit_one(rng.choice(KEYS))
                self.stopping.wait(rng.uniform(0.005, 0.03))
        except BaseException as exc:  # reported by stop()
            self.errors.append(exc)
        finally:
            connection.close()

    def _commit_one(self, key: str) -> None:
        with transaction.atomic():
            order = Order.objects.select_for_update().get(pk=self._rows[key])
            order.total += 1
            order.save(update_fields=["total"])
            n = int(order.total)
            stage("test.ordered", {"key": key, "n": n}, destination=self.destination, key=key)
        with self._lock:
            self.committed += 1


def worker(process: subprocess.Popen[str]) -> str:
    """The relay process's ``locked_by``."""
    return f"{socket.gethostname()}:{process.pid}"


def relay_holding(process: subprocess.Popen[str]) -> int:
    """How many rows the relay process holds PROCESSING now."""
    return OutboxMessage.objects.filter(status=Status.PROCESSING, locked_by=worker(process)).count()


def claimed_by(process: subprocess.Popen[str]) -> bool:
    """Whether the relay process has claimed a row (a row keeps its last ``locked_by``)."""
    return OutboxMessage.objects.filter(locked_by=worker(process)).exists()


def published_more(than: int) -> Callable[[], bool]:
    return lambda: OutboxMessage.objects.filter(status=Status.PUBLISHED).count() > than


def published() -> int:
    return OutboxMessage.objects.filter(status=Status.PUBLISHED).count()


def run_with_faults(destination: str, *, ordered: bool) -> tuple[int, list[dict]]:
    """The run of the module docstring; returns the events committed and, in queue order,
    each message's key, count, sequence header and event id."""
    knobs = {**RELAY_KNOBS, "ROUTES": {destination: {"queue": destination, "ordered": ordered}}}
    relays: list[subprocess.Popen[str]] = []
    with override_settings(OUTBOX={**_outbox(), **knobs}):
        try:
            relays += [start_relay("--batch-size", "5", **knobs) for _ in range(2)]
            committed = _produce_through_faults(destination, relays, knobs)
            wait_until(lambda: published() == committed, timeout=180, what="all published")
            for relay in relays:
                code, _, err = stop(relay, signal.SIGTERM)
                assert code == 0, err
        finally:
            for relay in relays:
                if relay.poll() is None:
                    relay.kill()
                    relay.communicate(timeout=30)
    messages = consume(destination, committed, timeout=120)
    return committed, [
        {
            "event_id": m.headers["event_id"],
            "key": m.headers["ordering_key"],
            "sequence": m.headers.get("sequence"),
            **json.loads(m.body),
        }
        for m in messages
    ]


def _produce_through_faults(destination: str, relays: list, knobs: dict) -> int:
    """Commit events while RabbitMQ is stopped and started and ``relays[0]`` is SIGKILLed
    holding a claim and restarted (in place in ``relays``); the events committed."""
    producers = Producers(destination, seed=1414)
    try:
        producers.start()
        wait_until(published_more(50), timeout=60, what="a first 50 published")
        services("stop", "rabbitmq")
        try:
            wait_until(
                lambda: OutboxMessage.objects.filter(attempts__gte=1).exists(),
                timeout=60,
                what="a publish failing while RabbitMQ is down",
            )
        finally:
            services("start", "rabbitmq")
        wait_until(published_more(published() + 50), timeout=120, what="50 more published")
        # SIGKILL a relay while it holds a claim; its rows wait for their lease.
        wait_until(lambda: relay_holding(relays[0]), timeout=60, interval=0.01, what="a claim")
        relays[0].send_signal(signal.SIGKILL)
        relays[0].communicate(timeout=30)
        relays[0] = start_relay("--batch-size", "5", **knobs)
        wait_until(lambda: claimed_by(relays[0]), timeout=120, what="the restarted relay's claim")
        wait_until(published_more(published() + 50), timeout=120, what="50 more published")
    finally:
        committed = producers.stop()
    return committed


def _outbox() -> dict:
    from django.conf import settings

    return dict(settings.OUTBOX)


def first_deliveries(messages: list[dict]) -> dict[str, list[dict]]:
    """Per key, the first delivery of each event, in delivery order."""
    seen: set[str] = set()
    per_key: dict[str, list[dict]] = {key: [] for key in KEYS}
    for message in messages:
        if message["event_id"] not in seen:
            seen.add(message["event_id"])
            per_key[message["key"]].append(message)
    return per_key


def out_of_order(counts: list[int]) -> int:
    """Events not delivered right after their predecessor: each count that is not one
    more than the highest delivered before it (a swap or a gap)."""
    highest, wrong = 0, 0
    for n in counts:
        if n != highest + 1:
            wrong += 1
        highest = max(highest, n)
    return wrong


@pytest.fixture
def destination():
    name = unique_destination("ordered")
    yield name
    delete_queue(name, AMQP_URL)


def test_an_ordered_route_delivers_each_keys_events_in_commit_order_through_faults(destination):
    committed, messages = run_with_faults(destination, ordered=True)
    per_key = first_deliveries(messages)
    assert sum(len(firsts) for firsts in per_key.values()) == committed
    for key, firsts in per_key.items():
        counts = [message["n"] for message in firsts]
        assert counts == list(range(1, len(counts) + 1)), f"{key}: {counts}"
        assert [message["sequence"] for message in firsts] == counts, key


def test_the_same_run_unordered_shows_the_violation(destination):
    committed, messages = run_with_faults(destination, ordered=False)
    per_key = first_deliveries(messages)
    assert sum(len(firsts) for firsts in per_key.values()) == committed  # nothing lost
    violations = sum(out_of_order([m["n"] for m in firsts]) for firsts in per_key.values())
    assert violations > 0


def test_a_drain_relays_every_event_of_a_key_longer_than_a_batch(destination):
    """A claim made while the key's previous batch is still being finalized (the claim
    ahead, or the next turn's) finds no head of that key: the relay finishes that batch
    and claims again instead of taking the table for empty (a drain would stop there)."""
    knobs = {"ROUTES": {destination: {"queue": destination, "ordered": True}}}
    with override_settings(OUTBOX={**_outbox(), **knobs}):
        with transaction.atomic():
            for n in range(1, 31):
                stage("test.ordered", {"key": "hot", "n": n}, destination=destination, key="hot")
        with Relay(batch_size=5) as relay:
            totals = relay.run(threading.Event(), drain=True)
    assert totals.published == 30
    sequences = [m.headers["sequence"] for m in consume(destination, 30, timeout=60)]
    assert sequences == list(range(1, 31))
