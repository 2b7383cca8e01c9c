"""No attempt spent without a publish: the relay's slow paths, on real RabbitMQ.

A broker that takes connections but stops confirming (RabbitMQ under a memory
alarm, set with ``rabbitmqctl set_vm_memory_high_watermark``) is an outage: one
WARNING (``outbox.broker_down``), backoff, no attempt counted, and everything is
published once the alarm clears, even with ``MAX_ATTEMPTS`` 1. A claim whose turn
comes after half its lease goes back due with its attempts unchanged, and the
confirm timeout is derived from ``LEASE_SECONDS`` so that it fits in the lease.
The relays run on threads of the test process, so that their log records can be
counted; broker and database are the real ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.db import connections
from django.test.utils import override_settings

from django_outbox.models import OutboxMessage
from django_outbox.relay.loop import Relay, RunStats
from django_outbox.transports.confirms import lease_confirm_timeout
from django_outbox.transports.kombu import AmqpTransport
from tests.integration.test_silent_broker import BROKER, FreezableProxy, memory_alarm
from tests.support import (
    AMQP_URL,
    consume,
    delete_queue,
    rabbitmqctl,
    stage_events,
    status_counts,
    unique_destination,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.disrupts]


@pytest.fixture
def destination() -> Iterator[str]:
    """A destination (and queue) of the test's own, its queue deleted at the end."""
    yield (name := unique_destination())
    delete_queue(name)


@contextlib.contextmanager
def running_relay(**outbox: object) -> Iterator[RunStats]:
    """A :class:`Relay` running on a thread with ``outbox`` over the test settings;
    stopped (and joined) at the end. Yields the totals it returns."""
    stop, totals = threading.Event(), RunStats()
    with override_settings(OUTBOX={**settings.OUTBOX, **outbox}):
        relay = Relay(batch_size=20)

        def run() -> None:
            try:
                totals.add(relay.run(stop))
            finally:
                connections.close_all()  # this thread's

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            yield totals
        finally:
            stop.set()
            thread.join(timeout=120)
    assert not thread.is_alive(), "the relay did not stop"


def records(caplog: pytest.LogCaptureFixture, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", "") == action]


def attempts_spent() -> int:
    return sum(OutboxMessage.objects.values_list("attempts", flat=True))


@pytest.mark.slow
def test_a_memory_alarm_is_an_outage_that_spends_no_attempt(destination, caplog):
    """MAX_ATTEMPTS 1 and an alarm lasting many batches' worth of retries: nothing
    is abandoned, no attempt is counted, one WARNING says the broker is down, and
    every event is published once the alarm clears."""
    caplog.set_level(logging.INFO)
    with running_relay(MAX_ATTEMPTS=1):
        stage_events(1, destination)
        wait_until(lambda: status_counts()["published"] == 1, timeout=60, what="a first event")
        with memory_alarm():
            staged = stage_events(100, destination)
            wait_until(lambda: records(caplog, "outbox.broker_down"), timeout=60, what="the outage")
            # The alarm lasts through several backoffs (1, 2, 4 s): each is a probe
            # the broker leaves unconfirmed, and no attempt.
            time.sleep(8)
            assert status_counts()["abandoned"] == 0
            assert attempts_spent() == 0
        wait_until(lambda: status_counts()["published"] == 101, timeout=90, what="the backlog")
    assert attempts_spent() == 0
    assert status_counts()["abandoned"] == 0
    (down,) = records(caplog, "outbox.broker_down")
    assert "blocked" in down.getMessage(), down.getMessage()
    assert records(caplog, "outbox.broker_up")
    relay_warnings = [
        r
        for r in caplog.records
        if r.name == "django_outbox.relay"
        and r.levelno >= logging.WARNING
        # (the once-per-process note that the destination has only the default route)
        and getattr(r, "action", "") != "outbox.default_route"
    ]
    assert relay_warnings == []
    received = {m.headers["event_id"] for m in consume(destination, 101)}
    assert set(staged) <= received


@pytest.mark.slow
def test_confirms_that_stop_coming_are_an_outage_that_spends_no_attempt(destination, caplog):
    """No connection.blocked this time: the network to the broker goes silent (a TCP
    proxy of the test's that stops passing bytes; no real part can freeze a connection
    half-way). The batch's confirm timeout (a third of LEASE_SECONDS: 2 s) passes, the
    broker is down, checks time out until the network comes back."""
    caplog.set_level(logging.INFO)
    proxy = FreezableProxy(BROKER)
    try:
        with running_relay(BROKER_URL=proxy.url, MAX_ATTEMPTS=1, LEASE_SECONDS=6):
            stage_events(1, destination)
            wait_until(lambda: status_counts()["published"] == 1, timeout=60, what="an event")
            proxy.freeze()
            stage_events(60, destination)
            wait_until(lambda: records(caplog, "outbox.broker_down"), timeout=60, what="the outage")
            assert attempts_spent() == 0
            proxy.thaw()
            wait_until(lambda: status_counts()["published"] == 61, timeout=120, what="the rest")
    finally:
        proxy.close()
    assert attempts_spent() == 0
    assert len(records(caplog, "outbox.broker_down")) == 1
    assert "not confirmed" in records(caplog, "outbox.publish_deferred")[0].getMessage()


@contextlib.contextmanager
def suspended(queue: str) -> Iterator[None]:
    """RabbitMQ's process of ``queue`` suspended (Erlang's ``sys:suspend``): the queue
    takes no message and confirms none, while the broker and its other queues answer,
    as a quorum queue without a majority does on a cluster."""
    pid = (
        "amqqueue:get_pid(element(2, rabbit_amqqueue:lookup("
        f'rabbit_misc:r(<<"/">>, queue, <<"{queue}">>))))'
    )
    rabbitmqctl("eval", f"sys:suspend({pid}).")
    try:
        yield
    finally:
        rabbitmqctl("eval", f"sys:resume({pid}).")


def published_to(destination: str) -> int:
    return OutboxMessage.objects.filter(destination=destination, status="published").count()


@pytest.mark.slow
def test_a_queue_that_stops_confirming_holds_back_its_destination_alone(caplog):
    """Two destinations on one broker; the queue of the first (it is published first
    in a batch) stops confirming. The second's events go on being published; the
    first's wait, attempts unchanged, with one WARNING naming it (not the broker),
    and go out once the queue is back."""
    caplog.set_level(logging.INFO)
    stalled, healthy = unique_destination("a"), unique_destination("b")
    try:
        with running_relay(MAX_ATTEMPTS=1, LEASE_SECONDS=6):  # confirm timeout 2 s
            stage_events(1, stalled)  # the relay declares the queue
            wait_until(lambda: published_to(stalled) == 1, timeout=60, what="a first event")
            with suspended(stalled):
                stage_events(10, stalled) + stage_events(10, healthy)
                wait_until(lambda: published_to(healthy) == 10, timeout=60, what="the others")
                wait_until(lambda: records(caplog, "outbox.queue_down"), timeout=60, what="a stall")
                stage_events(10, healthy)  # while the queue still stalls
                wait_until(lambda: published_to(healthy) == 20, timeout=60, what="more others")
                assert published_to(stalled) == 1
                assert attempts_spent() == 0
            wait_until(lambda: published_to(stalled) == 11, timeout=90, what="the held events")
    finally:
        delete_queue(stalled)
        delete_queue(healthy)
    assert attempts_spent() == 0
    (down,) = records(caplog, "outbox.queue_down")
    assert down.destination == stalled and "not confirmed" in down.getMessage()
    assert records(caplog, "outbox.queue_up")
    assert records(caplog, "outbox.broker_down") == []


def test_a_drain_during_a_memory_alarm_gives_up_without_spending_attempts(destination):
    stage_events(30, destination)
    with memory_alarm(), override_settings(OUTBOX={**settings.OUTBOX, "MAX_ATTEMPTS": 1}):
        with Relay(batch_size=10) as relay:
            totals = relay.run(threading.Event(), drain=True)
    assert "blocked" in totals.gave_up, totals.gave_up
    assert totals.published == 0 and totals.abandoned == 0
    assert attempts_spent() == 0
    counts = status_counts()
    assert counts["abandoned"] == 0 and counts["pending"] + counts["failed"] == 30, counts
    with Relay() as relay:  # the alarm cleared: all of it goes out, once due (in 1 s)
        wait_until(
            lambda: (
                not relay.run(threading.Event(), drain=True).gave_up
                and status_counts()["published"] == 30
            ),
            timeout=60,
            interval=0.5,
            what="the rows not taken to be published",
        )
    assert attempts_spent() == 0


def test_a_claim_whose_turn_comes_after_half_its_lease_keeps_its_attempts(destination):
    """A claim held back (a claim made ahead while an earlier batch waited for slow
    confirms) is published only while half its lease is left: past that, its rows go
    back due, attempts unchanged."""
    stage_events(5, destination)
    with override_settings(OUTBOX={**settings.OUTBOX, "MAX_ATTEMPTS": 1}), Relay() as relay:
        batches = relay.batches()
        claim = batches.claim()
        assert claim is not None and len(claim.messages) == 5
        late = dataclasses.replace(claim, deadline=time.monotonic() - 1)  # came late
        batch = batches.publish(late, relay.outages())
        assert {o.counts for o in batch.outcomes if o is not None} == {False}
        assert batch.tried == frozenset()  # nothing handed to the broker
        batches.finalize(batch)
        assert attempts_spent() == 0
        assert status_counts()["failed"] == 5
        assert relay.run(threading.Event(), drain=True).published == 5  # due again at once
    assert attempts_spent() == 0


@pytest.mark.parametrize(("lease", "timeout"), [(60, 20.0), (300, 30.0), (3, 1.0)])
def test_the_confirm_timeout_fits_in_the_lease(lease, timeout):
    """A destination starts in the first half of the lease and waits for its confirms
    a third of it at most (30 s at most): the outcome is recorded before the lease ends."""
    with override_settings(OUTBOX={**settings.OUTBOX, "LEASE_SECONDS": lease}):
        assert lease_confirm_timeout() == pytest.approx(timeout)
        assert AmqpTransport(AMQP_URL)._confirm_timeout == pytest.approx(timeout)
        assert lease / 2 + lease_confirm_timeout() < lease
