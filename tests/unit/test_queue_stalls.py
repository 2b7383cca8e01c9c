"""Which one stalled, the broker or a queue: the decision of a run's outage record
(:class:`~django_outbox.relay.outages.Outages`) after a destination's confirms did not
come, made by its check of the broker, and what it then blocks. No broker here: the
transport is a stand-in whose check passes or fails as the test says (the real decision,
on a RabbitMQ queue whose process is suspended, is tests/integration/test_slow_paths.py's)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import pytest

from django_outbox.conf.routes import Route
from django_outbox.envelope import ClaimedMessage
from django_outbox.exceptions import BrokerOutOfMemory
from django_outbox.relay.outages import Outages
from django_outbox.transports.base import Failure, Outcome, Transport

ORDERS = Route("orders", "outbox", queue="orders")
INVOICES = Route("invoices", "outbox", queue="invoices")
CLICKS = Route("clicks", "outbox", queue="clicks", broker="events")
#: What a transport says of a message its broker did not confirm in time.
UNCONFIRMED = Failure("no confirm within the confirm timeout", counts=False, outage=True)


class Probed(Transport):
    """A transport whose ``check()`` passes while ``up`` (with confirms: a probe confirmed)."""

    supports_confirms = True

    def __init__(self, *, up: bool, confirms: bool = True, error: Exception | None = None) -> None:
        self.up = up
        self.supports_confirms = confirms
        self.error = error or ConnectionRefusedError(111, "Connection refused")

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        raise AssertionError("not published here")

    def check(self) -> None:
        if not self.up:
            raise self.error

    def close(self) -> None:
        pass


def stalled(*routes: Route) -> Outages:
    """A run's outage record after a batch in which ``routes`` stalled on their broker."""
    outages = Outages(describe=lambda key: f"the broker {key!r}")
    for route in routes:
        outages.published(route, [UNCONFIRMED, UNCONFIRMED])
    return outages


def actions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "action", "") for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_stall_blocks_the_brokers_other_destinations_until_its_check(caplog):
    caplog.set_level(logging.INFO)
    outages = stalled(ORDERS)
    now = time.monotonic()
    blocked = outages.blocked(INVOICES, "invoices", now)
    assert blocked is not None and not blocked.counts and blocked.outage
    assert blocked.error == "not attempted: the broker 'default' is down"
    assert blocked.retry_delay == 1.0  # checked before the next batch
    assert outages.blocked(CLICKS, "clicks", now) is None  # another broker: attempted
    assert outages.due(now) == ["default"] and outages.down() == ["default"]
    assert outages.any_up({"default", "events"}) and not outages.any_up({"default"})
    assert actions(caplog) == []  # not logged before its check says it is down


def test_a_stall_on_a_broker_that_confirms_its_probe_was_the_queues(caplog):
    caplog.set_level(logging.INFO)
    outages = stalled(ORDERS, INVOICES)
    assert outages.check("default", Probed(up=True)) is None
    now = time.monotonic()
    assert outages.down() == [] and outages.stalled_queues() == {"orders", "invoices"}
    for route in (ORDERS, INVOICES):  # backed off, each
        waiting = outages.blocked(route, route.destination, now)
        assert waiting is not None and not waiting.counts and waiting.retry_delay >= 1.0
        queue = route.destination
        assert waiting.error == f"not attempted: the queue of {queue!r} is not confirming"
    assert outages.blocked(CLICKS, "clicks", now) is None
    assert actions(caplog) == ["outbox.queue_down", "outbox.queue_down"]
    assert "queue of destination 'invoices'" in caplog.records[0].getMessage()

    outages.published(ORDERS, [UNCONFIRMED])  # stalls again when tried: backed off longer
    assert outages.check("default", Probed(up=True)) is None
    assert actions(caplog) == ["outbox.queue_down"] * 2  # logged once per stall
    outages.published(ORDERS, [None, None])  # the queue confirmed again
    assert outages.stalled_queues() == {"invoices"}
    assert outages.blocked(ORDERS, "orders", time.monotonic()) is None
    assert actions(caplog)[-1] == "outbox.queue_up"


def test_a_stall_whose_probe_fails_too_was_the_brokers(caplog):
    caplog.set_level(logging.INFO)
    outages = stalled(ORDERS)
    transport = Probed(up=False)
    assert isinstance(outages.check("default", transport), ConnectionRefusedError)
    now = time.monotonic()
    assert outages.down() == ["default"] and outages.due(now) == []  # backed off
    assert (next_check := outages.next_check()) is not None and next_check > now
    assert outages.stalled_queues() == set()  # the broker explains it
    blocked = outages.blocked(ORDERS, "orders", now)
    assert blocked is not None  # due again when the broker is checked again
    assert blocked.retry_delay == pytest.approx(max(next_check - now, 1.0), abs=0.1)
    assert actions(caplog) == ["outbox.broker_down"]

    transport.up = True
    assert outages.check("default", transport) is None  # back: the stall is not the queue's
    assert outages.down() == [] and outages.stalled_queues() == set()
    assert outages.blocked(ORDERS, "orders", time.monotonic()) is None
    assert actions(caplog) == ["outbox.broker_down", "outbox.broker_up"]


def test_without_confirms_there_is_no_probe_to_tell_so_a_stall_is_the_brokers(caplog):
    caplog.set_level(logging.INFO)
    outages = stalled(ORDERS)
    assert outages.check("default", Probed(up=True, confirms=False)) is None
    assert outages.stalled_queues() == set() and outages.down() == []
    assert actions(caplog) == []


def test_a_broker_out_of_memory_is_said_so_and_a_later_stall_is_not(caplog):
    caplog.set_level(logging.INFO)
    outages = stalled(ORDERS)
    assert outages.check("default", Probed(up=False, error=BrokerOutOfMemory("OOM"))) is not None
    blocked = outages.blocked(INVOICES, "invoices", time.monotonic())
    assert blocked is not None and blocked.kind == "out_of_memory"
    assert blocked.error == "not attempted: the broker 'default' is out of memory"
    assert outages.check("default", Probed(up=True)) is None
    outages.published(ORDERS, [UNCONFIRMED])  # a new outage: not the last one's condition
    blocked = outages.blocked(INVOICES, "invoices", time.monotonic())
    assert blocked is not None and blocked.error == "not attempted: the broker 'default' is down"


def test_a_transient_error_makes_the_broker_suspected_not_blocked(caplog):
    outages = Outages(describe=str)
    refused = Failure("ConnectionResetError: reset", retry_delay=0.0)
    outages.published(ORDERS, [None, refused])
    now = time.monotonic()
    assert outages.down() == ["default"] and outages.due(now) == ["default"]  # checked next
    assert outages.blocked(INVOICES, "invoices", now) is None  # still attempted meanwhile
    outages.published(INVOICES, [Failure("bad", permanent=True)])  # says nothing of a broker
    assert outages.check("default", Probed(up=True)) is None and outages.down() == []
