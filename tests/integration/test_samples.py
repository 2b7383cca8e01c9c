"""``record_sample`` on PostgreSQL ("default") and SQLite ("lite"): one sample per minute,
exact counts, and a race for the minute settled by the primary key."""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterable

import pytest
from django.db import connections
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_outbox.models import OutboxMessage, OutboxSample
from django_outbox.relay import retention
from django_outbox.state.status import Summary
from django_outbox.workers import samples
from tests.factories import OutboxMessageFactory
from tests.support import minute_with_time_left

Status = OutboxMessage.Status
BOTH = pytest.mark.parametrize("using", ["default", "lite"])


@pytest.fixture
def using() -> str:
    """The database of the tests that are not parametrized over both."""
    return "default"


@pytest.fixture
def settled(using: str) -> dt.datetime:
    """The database clock's minute, with at least ten seconds of it left."""
    return minute_with_time_left(using)


def _rows(using: str, count: int, **fields: object) -> None:
    OutboxMessage.objects.using(using).bulk_create(
        OutboxMessageFactory.build_batch(count, **fields)
    )


@BOTH
@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
def test_a_sample_counts_the_backlog_and_the_minute_before(using, settled):
    minute = settled
    _rows(using, 3, available_at=timezone.now() - dt.timedelta(minutes=10))
    _rows(using, 2, status=Status.PROCESSING, available_at=minute + dt.timedelta(minutes=5))
    _rows(using, 4, status=Status.FAILED, available_at=minute + dt.timedelta(minutes=5))
    _rows(using, 1, status=Status.ABANDONED)
    _rows(using, 5, published=True, published_at=minute - dt.timedelta(seconds=30))
    _rows(using, 1, published=True, published_at=minute - dt.timedelta(seconds=60))  # bound
    _rows(using, 2, published=True, published_at=minute - dt.timedelta(seconds=61))
    _rows(using, 3, published=True, published_at=minute)  # this minute: the next sample's

    assert samples.record_sample(using) is True

    sample = OutboxSample.objects.using(using).get()
    assert sample.taken_at == minute
    assert (sample.pending, sample.processing, sample.failed) == (3, 2, 4)
    assert sample.published == 5 + 1
    assert sample.oldest_due_age is not None
    assert sample.oldest_due_age >= 600  # the PENDING rows were due ten minutes ago


@BOTH
@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
def test_a_second_call_in_the_minute_inserts_nothing_with_one_query(using, settled):
    assert samples.record_sample(using) is True
    _rows(using, 7)  # a changed backlog does not make a second sample

    with CaptureQueriesContext(connections[using]) as queries:
        assert samples.record_sample(using) is False

    assert len(queries) == 1
    assert "django_outbox_sample" in queries[0]["sql"]
    sample = OutboxSample.objects.using(using).get()
    assert (sample.taken_at, sample.pending) == (settled, 0)


@BOTH
@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
def test_a_rival_that_takes_the_minute_first_wins_and_nothing_is_raised(
    using, settled, monkeypatch
):
    """The rival inserts between this call's lookup and its insert."""
    rival: list[bool] = []
    summary = samples.summary

    def summary_after_a_rival(alias: str, states: Iterable[str]) -> Summary:
        monkeypatch.setattr(samples, "summary", summary)
        rival.append(samples.record_sample(alias))
        return summary(alias, states)

    monkeypatch.setattr(samples, "summary", summary_after_a_rival)
    _rows(using, 2)

    assert samples.record_sample(using) is False
    assert rival == [True]
    assert OutboxSample.objects.using(using).get().pending == 2


@pytest.mark.django_db(transaction=True)
def test_two_connections_racing_for_the_minute_insert_one_row(settled, monkeypatch):
    """Both pass the lookup before either inserts (a barrier holds them there); the
    primary key lets one in, the other gets False."""
    barrier = threading.Barrier(2, timeout=30)
    summary = samples.summary

    def summary_in_step(alias: str, states: Iterable[str]) -> Summary:
        barrier.wait()
        return summary(alias, states)

    monkeypatch.setattr(samples, "summary", summary_in_step)
    results: list[bool] = []

    def relay() -> None:
        try:
            results.append(samples.record_sample("default"))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=relay) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(results) == [False, True]
    assert OutboxSample.objects.count() == 1


@BOTH
@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
def test_recent_returns_the_last_hour_oldest_first_and_retention_drops_a_day_old(using, settled):
    minute = settled
    ages = [0, 5, 59, 60, 24 * 60 + 1]  # minutes before this one
    OutboxSample.objects.using(using).bulk_create(
        OutboxSample(
            taken_at=minute - dt.timedelta(minutes=age),
            pending=age,
            processing=0,
            failed=0,
            published=0,
        )
        for age in ages
    )

    window = samples.recent(using)

    assert (window.end, window.minutes) == (minute, 60)
    assert [s.pending for s in window.samples] == [59, 5, 0]
    assert retention.cleanup(using)["samples"] == 1
    assert sorted(OutboxSample.objects.using(using).values_list("pending", flat=True)) == [
        0,
        5,
        59,
        60,
    ]


@BOTH
@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
def test_a_sample_without_use_tz_counts_the_minute_before(using, settings):
    """A project with ``USE_TZ = False`` stores naive times; the sample's bounds are
    naive too (an aware bound made SQLite raise ValueError inside the relay's beat)."""
    settings.USE_TZ = False
    connections[using].close()  # the next connection takes the setting
    minute = minute_with_time_left(using)
    assert minute.tzinfo is None
    _rows(using, 2, published=True, published_at=minute - dt.timedelta(seconds=30))
    _rows(using, 1, published=True, published_at=minute - dt.timedelta(seconds=90))
    assert samples.record_sample(using) is True
    assert samples.record_sample(using) is False
    sample = OutboxSample.objects.using(using).get()
    assert (sample.taken_at, sample.published) == (minute, 2)
