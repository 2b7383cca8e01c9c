"""Which one stalled, the broker or a queue: the relay's decision after a destination's
confirms did not come, made by its check of the broker. No broker here: the transport is
a stand-in whose check passes or fails as the test says (the real decision, on a
RabbitMQ queue whose process is suspended, is tests/integration/test_slow_paths.py's)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest
from django.test import override_settings

from django_outbox.conf.routes import Route
from django_outbox.envelope import ClaimedMessage
from django_outbox.relay.loop import Relay, _Run
from django_outbox.transports.base import Outcome, Transport
from django_outbox.workers.outage import database_outage


@pytest.fixture(autouse=True)
def _a_rabbitmq_broker():
    with override_settings(OUTBOX={"BROKER_URL": "amqp://guest:guest@rabbit:5672//"}):
        yield


class Probed(Transport):
    """A transport whose ``check()`` passes while ``up`` (with confirms: a probe confirmed)."""

    supports_confirms = True

    def __init__(self, *, up: bool, confirms: bool = True) -> None:
        self.up = up
        self.supports_confirms = confirms

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        raise AssertionError("not published here")

    def check(self) -> None:
        if not self.up:
            raise ConnectionRefusedError(111, "Connection refused")

    def close(self) -> None:
        pass


def stalled_run(*destinations: str) -> _Run:
    """A run's state after a batch in which ``destinations`` stalled on the default broker."""
    state = _Run(threading.Event(), False, None, None, database=database_outage("default"))  # type: ignore[arg-type]
    state.broker("default").suspect()
    state.retry_at["default"] = time.monotonic()
    state.stalled["default"] = set(destinations)
    return state


def actions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "action", "") for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_stall_on_a_broker_that_confirms_its_probe_was_the_queues(caplog):
    caplog.set_level(logging.INFO)
    relay = Relay(transports={"default": Probed(up=True)})
    state = stalled_run("orders", "invoices")
    relay._try_broker(state, "default")
    assert not state.brokers_down() and "default" not in state.stalled
    assert set(state.queues) == {"orders", "invoices"}
    assert min(state.queues_waiting(time.monotonic()).values()) > 0  # backed off, each
    assert actions(caplog) == ["outbox.queue_down", "outbox.queue_down"]
    assert "queue of destination 'invoices'" in caplog.records[0].getMessage()

    state.stalled["default"] = {"orders"}  # stalls again when tried: backed off longer
    relay._try_broker(state, "default")
    assert actions(caplog) == ["outbox.queue_down"] * 2  # logged once per stall
    state.queues_confirmed({"orders", "clicks"})  # the broker took some of it again
    assert set(state.queues) == {"invoices"} and set(state.queue_retry_at) == {"invoices"}
    assert actions(caplog)[-1] == "outbox.queue_up"


def test_a_stall_whose_probe_fails_too_was_the_brokers(caplog):
    caplog.set_level(logging.INFO)
    relay = Relay(transports={"default": Probed(up=False)})
    state = stalled_run("orders")
    relay._try_broker(state, "default")
    assert state.brokers_down() == ["default"] and state.retry_at["default"] > time.monotonic()
    assert not state.queues and "default" not in state.stalled  # the broker explains it
    assert actions(caplog) == ["outbox.broker_down"]

    relay._transports["default"].up = True  # type: ignore[attr-defined]
    relay._try_broker(state, "default")  # back: the stall is not then blamed on the queue
    assert not state.brokers_down() and not state.queues
    assert actions(caplog) == ["outbox.broker_down", "outbox.broker_up"]


def test_without_confirms_there_is_no_probe_to_tell_so_a_stall_is_the_brokers(caplog):
    caplog.set_level(logging.INFO)
    relay = Relay(transports={"default": Probed(up=True, confirms=False)})
    state = stalled_run("orders")
    relay._try_broker(state, "default")
    assert not state.queues and not state.brokers_down()
    assert actions(caplog) == []
