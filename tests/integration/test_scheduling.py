"""Scheduled events (docs/scheduling.md#scheduled-events) on real PostgreSQL and
RabbitMQ: a resting relay wakes when one comes due, the backlog's figures count them
apart, and on an ordered route a key's later event waits behind its scheduled one.

The relays run on a thread of the test process (``running_relay``) with
``POLL_INTERVAL`` 30 s: an event that waited for the poll would miss every deadline
below by far, so no deadline is tight.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import uuid
from collections.abc import Iterator

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext, override_settings

from django_outbox import db, stage
from django_outbox.db import RowCount
from django_outbox.models import OutboxMessage, OutboxSample
from django_outbox.ops.metrics import BacklogCollector
from django_outbox.state import status
from django_outbox.workers.samples import record_sample
from tests.factories import OutboxMessageFactory
from tests.integration.test_admin import CHANGELIST, _plans
from tests.integration.test_slow_paths import running_relay
from tests.support import consume, delete_queue, stage_events, unique_destination, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

POLL_INTERVAL = 30
HOUR = dt.timedelta(hours=1)


@pytest.fixture
def destination() -> Iterator[str]:
    yield (name := unique_destination())
    delete_queue(name)


def _schedule(destination: str, seconds: float, n: int = 0, **options: object) -> OutboxMessage:
    """Commit one event due ``seconds`` from now by the database clock."""
    at = db.database_now("default") + dt.timedelta(seconds=seconds)
    with transaction.atomic():
        return stage("t.scheduled", {"n": n}, destination=destination, available_at=at, **options)


def _published(row: OutboxMessage) -> OutboxMessage | None:
    row.refresh_from_db()
    return row if row.published_at is not None else None


# ---------------------------------------------------------------- coming due


def test_a_resting_relay_publishes_a_scheduled_event_when_it_comes_due(destination):
    """No NOTIFY announces a row coming due: the relay's rest after a claim ends when
    the first row not due comes due, not at the poll interval (before, an event
    scheduled two seconds ahead went out at the next poll, 30 s later here)."""
    with running_relay(POLL_INTERVAL=POLL_INTERVAL):
        stage_events(1, destination)  # the relay listens, and has heard a NOTIFY
        wait_until(lambda: consume(destination, 1, timeout=20), timeout=30, what="event 0")
        row = _schedule(destination, 2)
        published = wait_until(lambda: _published(row), timeout=15, what="the scheduled event")
    late = published.published_at - published.available_at
    assert dt.timedelta(0) <= late < dt.timedelta(seconds=10), late
    assert len(consume(destination, 1, timeout=20)) == 1


@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
@pytest.mark.parametrize("using", ["default", "lite"], ids=["postgresql", "sqlite"])
def test_the_claim_and_a_rest_know_when_the_next_row_comes_due(using):
    """``db.next_due_in`` (a rest after an empty claim) and a claim's ``next_due_in``:
    the seconds until the first unfinished row not due comes due; due rows do not count,
    none left is None."""
    assert db.next_due_in(using) is None
    now = db.database_now(using)
    with transaction.atomic(using=using):
        stage("t", {}, destination="q", using=using)  # due now
        for seconds in (200, 100):
            at = now + dt.timedelta(seconds=seconds)
            stage("t", {}, destination="q", available_at=at, using=using)
    claim = db.claim(using, limit=10, lease_seconds=30, worker="w", token=uuid.uuid4())
    assert len(claim) == 1
    for seconds in (db.next_due_in(using), claim.next_due_in):
        assert seconds is not None and 90 < seconds <= 100
    OutboxMessage.objects.using(using).filter(available_at__gt=now).delete()
    assert db.next_due_in(using) is None


def _explained(sql: str, params: object, settings: list[str]) -> dict:
    """The plan of the claim statement ``sql`` run after ``settings`` in one query
    (its own transaction, as the relay sends it), with every plan past
    ``jit_above_cost``."""
    with connection.cursor() as cursor:
        cursor.execute("SET jit_above_cost = 0")
        try:
            cursor.execute(";\n".join([*settings, f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}"]), params)
            for _setting in settings:
                cursor.nextset()
            (plan,) = cursor.fetchone()
        finally:
            cursor.execute("RESET jit_above_cost")
    return plan[0]


@pytest.mark.parametrize("ordered", [True, False], ids=["whole", "unordered"])
def test_a_claim_is_never_jit_compiled(ordered):
    """With a million events scheduled ahead (a tenth of them ordered) the planner's
    cost of the claim passed jit_above_cost, and JIT compiled each claim: 74 ms of an
    80 ms claim of 500 rows. The claim the relay sends, run with every plan past that
    cost, is not compiled; the same statement without its settings is."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_jit_available()")
        if not cursor.fetchone()[0]:
            pytest.skip("this PostgreSQL has no JIT")
    stage_events(3, unique_destination())
    sent: list[tuple[str, object]] = []

    def capture(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        sent.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(capture):
        claimed = db.claim(
            "default", limit=10, lease_seconds=30, worker="w", token=uuid.uuid4(), ordered=ordered
        )
    assert len(claimed) == 3
    ((sql, params),) = [(sql, params) for sql, params in sent if "RETURNING" in sql]
    *settings, statement = sql.split(";\n")
    assert "JIT" not in _explained(statement, params, settings)
    assert "JIT" in _explained(statement, params, [])  # what the settings prevent


# ---------------------------------------------------------------- the backlog's figures


@pytest.fixture
def scheduled() -> str:
    """Two PENDING events due, three scheduled (one of an ordered key: the other due
    index), one FAILED waiting for its retry an hour from now (not scheduled: failed)."""
    destination = unique_destination()
    stage_events(2, destination)
    for seconds in (3600, 7200):
        _schedule(destination, seconds)
    later = db.database_now("default") + HOUR
    OutboxMessageFactory(ordering_key="k", sequence=1, available_at=later)
    OutboxMessageFactory(status=OutboxMessage.Status.FAILED, attempts=1,
                         last_error="RuntimeError: x", available_at=later)  # fmt: skip
    return destination


@pytest.mark.parametrize("one_statement", [True, False], ids=["postgresql", "orm"])
def test_the_backlog_counts_the_pending_rows_due_and_the_scheduled_ones_apart(
    scheduled, monkeypatch, one_statement
):
    """summary() (the admin's, the metrics', the minute's sample) counts PENDING as the
    rows due; the scheduled ones are a figure of their own (before: pending 5)."""
    if not one_statement:  # the portable path, as on a database without the statement
        monkeypatch.setattr(status, "read_backlog", lambda *args, **kwargs: None)
    read = status.summary(blocked=True)
    assert read.counts["pending"] == RowCount(2, exact=True)
    assert read.scheduled == RowCount(3, exact=True)
    assert read.counts["failed"] == RowCount(1, exact=True)
    assert status.summary(states=("failed",)).scheduled is None  # not asked for


def test_the_scheduled_count_is_read_from_the_due_indexes_and_capped(scheduled, monkeypatch):
    """One statement still, every figure read through an index (sequential scans
    priced out); past EXACT_COUNT_LIMIT the scheduled rows are the planner's estimate."""
    with CaptureQueriesContext(connection) as queries:
        status.summary(blocked=True)
    (plan,) = _plans(queries).values()
    assert "Seq Scan" not in plan
    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", 2)
    capped = status.summary().scheduled
    assert capped is not None and not capped.exact and capped.value >= 3


def test_the_metrics_sample_and_outbox_status_show_the_scheduled_events_apart(scheduled):
    """The backlog gauge's pending is the due rows, outbox_scheduled_messages the
    others; the chart's sample counts the due ones; outbox_status prints both."""
    families = {family.name: family for family in BacklogCollector("default", 0).collect()}
    assert [s.value for s in families["outbox_scheduled_messages"].samples] == [3]
    backlog = {s.labels["status"]: s.value for s in families["outbox_backlog_messages"].samples}
    assert backlog["pending"] == 2
    assert record_sample()
    assert OutboxSample.objects.get().pending == 2
    report = status.report()
    assert (report.counts["pending"], report.scheduled) == (2, 3)
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    assert "pending      2\n" in out.getvalue()
    assert "scheduled    3 (pending, not due yet: not in pending)\n" in out.getvalue()
    out = io.StringIO()
    call_command("outbox_status", "--json", stdout=out)
    printed = json.loads(out.getvalue())
    assert (printed["counts"]["pending"], printed["scheduled"]) == (2, 3)


def test_the_admin_summary_shows_the_scheduled_events_apart(admin_client, scheduled):
    response = admin_client.get(CHANGELIST)
    summary = response.context["outbox_summary"]
    counts = {value: count for value, _label, count in summary["states"]}
    assert counts["pending"] == RowCount(2, exact=True)
    assert summary["scheduled"] == RowCount(3, exact=True)
    html = response.content.decode()
    assert 'class="outbox-summary-scheduled"' in html
    assert "Scheduled:\n      <strong>3</strong>" in html


# ---------------------------------------------------------------- ordered routes


@pytest.mark.parametrize(("ordered", "order"), [(True, [1, 2]), (False, [2, 1])])
def test_a_later_event_of_an_ordered_key_waits_behind_its_scheduled_one(
    destination, ordered, order
):
    """Event 1 of key K is scheduled two seconds ahead, event 2 of K is staged after it
    for now. On an ordered route 2 waits for 1 (the claim's gate: 1 is unfinished
    before it) and both go out in sequence once 1 is due; on an unordered route the
    same events go out 2 first, which is what the ordered run must not do."""
    routes = {destination: {"queue": destination, "ordered": ordered}}
    outbox = {**settings.OUTBOX, "ROUTES": routes, "POLL_INTERVAL": POLL_INTERVAL}
    with override_settings(OUTBOX=outbox):
        first = _schedule(destination, 2, n=1, key="K")
        with transaction.atomic():
            second = stage("t.scheduled", {"n": 2}, destination=destination, key="K")
    with running_relay(**outbox):
        received = consume(destination, 2, timeout=40, idle=3.0)
    assert [json.loads(message.body)["n"] for message in received] == order
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.published_at is not None and second.published_at is not None
    if ordered:
        assert [message.headers["sequence"] for message in received] == [1, 2]
        assert second.published_at >= first.available_at
