"""A user's one-process setup on ``OUTBOX["BROKER_URL"] = "memory://"``: the relay and
``run_outbox_consumer``'s consumer in threads of one process, no broker server."""

from __future__ import annotations

import threading

import pytest
from django.db import connections
from django.test import override_settings

from django_outbox.consumer import InboxConsumer
from django_outbox.relay import Relay
from django_outbox.transports import memory
from tests.support import stage_events, unique_destination

WAIT = 60.0  # generous: two threads on a shared machine


def in_thread(work) -> threading.Thread:
    """A started thread running ``work``, closing its database connections at the end."""

    def run():
        try:
            work()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_a_relay_and_a_consumer_in_one_process_round_trip_on_memory():
    queue = unique_destination("mem")
    outbox = {"BROKER_URL": "memory://", "ROUTES": {queue: {"queue": queue}}}
    seen: list[str] = []
    all_seen = threading.Event()

    def handler(event):
        seen.append(str(event.event_id))
        if len(seen) == 3:
            all_seen.set()

    stop = threading.Event()
    with override_settings(OUTBOX=outbox):
        consumer = InboxConsumer(queue, handler, "mem-test", stop=stop)
        consuming = in_thread(consumer.run)
        relaying = in_thread(lambda: Relay().run(stop))
        try:
            ids = stage_events(3, queue)
            assert all_seen.wait(WAIT), f"consumer saw {len(seen)} of 3"
        finally:
            stop.set()
            consuming.join(WAIT)
            relaying.join(WAIT)
    memory.clear()
    assert not consuming.is_alive() and not relaying.is_alive()
    assert sorted(seen) == sorted(ids)
