"""OutageTracker: one per resource, logs an outage once at its start and once at its
end, backs off 1, 2, 4 ... 30 s with jitter. A fake clock; no services, no sleeps."""

from __future__ import annotations

import datetime as dt
import logging

import pytest

from django_outbox.models import WorkerHeartbeat
from django_outbox.workers.heartbeat import outages_of
from django_outbox.workers.outage import (
    MAX_OUTAGE_BACKOFF,
    OutageTracker,
    broker_outage,
    database_outage,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def actions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(r, "action", "") for r in caplog.records]


def no_jitter(low: float, high: float) -> float:
    return high


def test_an_outage_is_logged_once_at_its_start_and_once_at_its_end(caplog):
    clock = Clock()
    broker = broker_outage(clock=clock)
    with caplog.at_level(logging.WARNING, logger="django_outbox.outage"):
        for _ in range(3):
            broker.failed(ConnectionError("refused"))
            broker.backoff()
        clock.now += 7.25
        broker.recovered()
        broker.recovered()  # nothing more: the outage is over
    assert actions(caplog) == ["outbox.broker_down", "outbox.broker_up"]
    assert caplog.records[0].getMessage() == "broker unreachable (refused); retrying with backoff"
    assert caplog.records[1].getMessage() == "broker reachable again after 7.2s"


def test_the_broker_and_the_database_are_tracked_apart(caplog):
    """A database outage that ends does not end (nor reset the backoff of) a broker outage."""
    clock = Clock()
    broker, database = (
        broker_outage(clock=clock, jitter=no_jitter),
        database_outage("default", clock=clock, jitter=no_jitter),
    )
    with caplog.at_level(logging.WARNING, logger="django_outbox.outage"):
        broker.failed(ConnectionError("refused"))
        assert [broker.backoff(), broker.backoff()] == [1.0, 2.0]
        database.failed(OSError("gone"))
        assert database.backoff() == 1.0
        clock.now += 3
        database.recovered()
        assert broker.down and not database.down
        assert broker.backoff() == 4.0
    assert actions(caplog) == ["outbox.broker_down", "outbox.database_down", "outbox.database_up"]
    assert caplog.records[1].using == "default"
    assert caplog.records[2].getMessage() == "database 'default' reachable again after 3.0s"


def test_backoff_doubles_up_to_30_seconds_shortened_by_jitter():
    seen: list[tuple[float, float]] = []

    def jitter(low: float, high: float) -> float:
        seen.append((low, high))
        return low

    tracker = OutageTracker("broker", "broker", jitter=jitter)
    tracker.failed(ConnectionError("refused"))
    delays = [tracker.backoff() for _ in range(8)]
    assert delays == pytest.approx([0.8, 1.6, 3.2, 6.4, 12.8, 24.0, 24.0, 24.0])
    assert set(seen) == {(0.8, 1.0)}
    assert MAX_OUTAGE_BACKOFF == 30.0
    tracker.recovered()
    tracker.failed(ConnectionError("refused"))
    assert tracker.backoff() == pytest.approx(0.8)  # a new outage starts over


def test_a_suspected_outage_is_logged_only_once_confirmed(caplog):
    """A failed publish makes the broker suspect; a check that succeeds ends it quietly."""
    broker = broker_outage(clock=Clock())
    with caplog.at_level(logging.WARNING, logger="django_outbox.outage"):
        broker.suspect()
        assert broker.down
        broker.recovered()
    assert not broker.down
    assert actions(caplog) == []


def test_downtime_adds_up_outages_from_the_failed_attempt_until_forgotten():
    clock = Clock()
    broker = broker_outage(clock=clock)
    attempt = clock.now
    clock.now += 2  # the connection attempt took 2 s to fail
    broker.failed(ConnectionError("timed out"), since=attempt)
    assert broker.downtime() == 2
    clock.now += 3
    broker.failed(ConnectionError("timed out"), since=clock.now)  # the outage began earlier
    assert broker.downtime() == 5
    broker.recovered()
    clock.now += 10  # connected: not counted
    broker.failed(ConnectionError("reset"))
    clock.now += 1
    assert broker.downtime() == 6
    broker.forget_downtime()  # a message came
    assert broker.downtime() == 1  # the outage under way counts from its start still


def test_lasted_is_the_outage_under_way_only():
    clock = Clock()
    broker = broker_outage(clock=clock)
    assert broker.lasted() is None
    broker.failed(ConnectionError("refused"))
    clock.now += 7.5
    assert broker.lasted() == 7.5
    broker.recovered()
    clock.now += 100
    assert broker.lasted() is None  # an outage that ended is not reported by a beat


@pytest.mark.parametrize(
    "counts",
    [
        {},
        {"outages": "broker 'x'"},
        {"outages": ["broker 'x'", 3]},
        {"outages": {"broker 'x'": "3"}},
    ],
)
def test_a_heartbeat_without_a_well_formed_outages_entry_reports_nothing_down(counts):
    """``outbox_health`` reads beats other versions (or hands) may have written."""
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    row = WorkerHeartbeat(beat_at=now, counts=counts)
    row.db_now = now + dt.timedelta(seconds=4)  # type: ignore[attr-defined]
    assert outages_of(row) == {}
    row.counts = {"outages": {"broker 'x'": 3}}
    assert outages_of(row) == {"broker 'x'": 7.0}  # the beat's figure plus its age
