"""A relay and a consumer run in a thread of their own (as a project may run them, and as
the tests do) leave no database connection of theirs open behind them: Django keeps one
connection per thread, and one left open when its thread ends is found by the garbage
collector later, in whatever code runs then (psycopg's ResourceWarning: the test suite's
warnings are errors, and Django 6's layer once failed an unrelated test on it). Real
PostgreSQL and RabbitMQ."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Callable

import pytest
from django.db import connections

from django_outbox.consumer import InboxConsumer
from django_outbox.relay import Relay
from tests.support import delete_queue, stage_events, unique_destination

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def destination():
    name = unique_destination("threads")
    yield name
    delete_queue(name)


def connection_left_open(work: Callable[[], object]) -> list[str]:
    """Run ``work`` in a thread of its own; what the garbage collector then says of the
    connections that thread left open (ResourceWarnings, one per connection)."""
    opened: list[bool] = []

    def run() -> None:
        work()
        opened.append(connections["default"].connection is not None)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] + [
        "the thread's connection was open when its work returned" for left in opened if left
    ]


def test_a_relay_run_in_a_thread_leaves_no_connection_open(destination):
    stage_events(3, destination)
    with Relay() as relay:
        assert connection_left_open(lambda: relay.run(threading.Event(), drain=True)) == []


def test_a_consumer_run_in_a_thread_leaves_no_connection_open(destination):
    stage_events(2, destination)
    with Relay() as relay:
        relay.run(threading.Event(), drain=True)
    consumer = InboxConsumer(destination, lambda event: None, "threads")
    assert connection_left_open(lambda: consumer.run(idle_timeout=1)) == []
    assert consumer.stats.handled == 2
