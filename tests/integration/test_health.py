"""Heartbeats, ``outbox_health``, ``outbox_status --json``, the health view and the
django-health-check check, on real PostgreSQL and RabbitMQ with real relay processes."""

from __future__ import annotations

import datetime as dt
import json
import signal
import socket
import time

import psycopg
import pytest
from django.db import connections, transaction
from django.test.utils import override_settings
from django.utils import timezone

from django_outbox import stage
from django_outbox.consumer import InboxConsumer
from django_outbox.models import OutboxMessage, OutboxSample, WorkerHeartbeat, WorkerKind
from django_outbox.ops.health import check_health
from django_outbox.ops.metrics import BacklogCollector
from django_outbox.relay import retention
from django_outbox.workers.heartbeat import Heartbeat, WorkerState, live_relays, state_of, workers
from tests.support import (
    delete_queue,
    manage,
    run_python,
    run_relay,
    start_relay,
    stop,
    unique_destination,
    unreachable_broker_url,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])

#: ``manage.py outbox_health`` run by :func:`run_python`.
HEALTH_COMMAND = (
    "import sys; from django.core.management import execute_from_command_line; "
    "execute_from_command_line(['manage.py', 'outbox_health'])"
)
#: Beats this fast keep the tests short: live within 3 s, stale after, dead after 30 s.
INTERVAL = 1


@pytest.fixture
def destination():
    name = unique_destination("health")
    yield name
    delete_queue(name)


def stage_one(destination: str) -> OutboxMessage:
    with transaction.atomic():
        return stage("health.checked", {"n": 1}, destination=destination)


def relay_rows() -> list[WorkerHeartbeat]:
    return list(WorkerHeartbeat.objects.filter(kind=WorkerKind.RELAY))


def status_json() -> dict:
    result = manage("outbox_status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_heartbeat_writes_once_per_interval_and_its_stop():
    clock = _Clock()
    beat = Heartbeat(WorkerKind.RELAY, "host:1", interval=10, clock=clock)
    assert beat.beat({"published": 1})
    first = WorkerHeartbeat.objects.get()
    assert not beat.beat({"published": 2})  # within the interval: nothing written
    clock.now = 10.0
    assert beat.beat({"published": 3}, last_batch_at=timezone.now())
    row = WorkerHeartbeat.objects.get()
    assert (row.counts, row.started_at, row.interval) == ({"published": 3}, first.started_at, 10)
    assert row.beat_at >= first.beat_at and row.last_batch_at is not None
    assert state_of(row) is WorkerState.LIVE
    beat.stopped({"published": 4})
    row = WorkerHeartbeat.objects.get()
    assert row.stopped_at is not None and state_of(row) is WorkerState.STOPPED
    assert live_relays() == 0


def test_a_heartbeat_row_ages_live_stale_dead_by_its_own_interval():
    Heartbeat(WorkerKind.RELAY, "host:2", interval=2).beat({})
    row = WorkerHeartbeat.objects.get()
    at = row.beat_at
    assert state_of(row, at + dt.timedelta(seconds=6)) is WorkerState.LIVE  # 3 intervals
    assert state_of(row, at + dt.timedelta(seconds=6.1)) is WorkerState.STALE
    assert state_of(row, at + dt.timedelta(seconds=60)) is WorkerState.STALE  # 30 intervals
    assert state_of(row, at + dt.timedelta(seconds=60.1)) is WorkerState.DEAD


def test_two_processes_with_one_host_and_pid_keep_a_row_each():
    """Containers on the host's network can both be pid 1 under one host name: each
    process has its own row (keyed by a UUID it draws), so neither hides the other."""
    first, second = Heartbeat(WorkerKind.RELAY, "pod:1"), Heartbeat(WorkerKind.RELAY, "pod:1")
    first.beat({"published": 5})
    second.beat({"published": 0})
    first.stopped({"published": 6})
    states = sorted((w.row.counts["published"], w.state) for w in workers())
    assert states == [(0, WorkerState.LIVE), (6, WorkerState.STOPPED)]
    assert live_relays() == 1


def test_ages_are_read_by_the_database_clock_not_the_readers(monkeypatch):
    """A reader whose clock runs an hour ahead still sees a relay that just beat as
    live: beats are written and read by the database's clock."""
    Heartbeat(WorkerKind.RELAY, "host:6").beat({})
    ahead = timezone.now() + dt.timedelta(hours=1)
    monkeypatch.setattr("django.utils.timezone.now", lambda: ahead)
    ((worker, state),) = [(w.row.worker, w.state) for w in workers()]
    assert (worker, state) == ("host:6", WorkerState.LIVE)
    assert live_relays() == 1
    assert state_of(WorkerHeartbeat.objects.get()) is WorkerState.DEAD  # by the reader's clock


def test_retention_deletes_heartbeat_rows_a_week_old():
    Heartbeat(WorkerKind.RELAY, "old:1").stopped({})
    Heartbeat(WorkerKind.RELAY, "new:2").beat({})
    week_ago = timezone.now() - retention.HEARTBEAT_RETENTION - dt.timedelta(minutes=1)
    WorkerHeartbeat.objects.filter(worker="old:1").update(beat_at=week_ago)
    assert retention.cleanup()["workers"] == 1
    assert [row.worker for row in WorkerHeartbeat.objects.all()] == ["new:2"]


def test_a_consumer_keeps_beating_while_its_handler_runs(destination):
    """The beat comes from a thread of its own: a handler that takes several
    intervals does not make its consumer look stale."""
    stage_one(destination)
    run_relay("--drain")
    beats = []

    def last_beat() -> dt.datetime | None:
        return WorkerHeartbeat.objects.values_list("beat_at", flat=True).first()

    def slow(event) -> None:
        first = wait_until(last_beat, timeout=10 * INTERVAL, what="the first beat")
        wait_until(
            lambda: last_beat() > first, timeout=10 * INTERVAL, what="a beat during the handler"
        )
        beats.append(first)

    with override_settings(OUTBOX={**_outbox(), "HEARTBEAT_INTERVAL": INTERVAL}):
        InboxConsumer(destination, slow, "slow").run(idle_timeout=2)
    assert len(beats) == 1


def test_a_beat_on_a_database_that_is_down_is_swallowed():
    """The loop meets the outage in its own work; a heartbeat never raises it."""
    code = (
        "import django; django.setup()\n"
        "from django_outbox.workers.heartbeat import Heartbeat\n"
        "from django_outbox.models import WorkerKind\n"
        "print(Heartbeat(WorkerKind.RELAY, 'host:3').beat({}))\n"
    )
    result = run_python(code, DATABASE_URL="postgres://outbox@127.0.0.1:1/nowhere")
    assert (result.returncode, result.stdout.strip()) == (0, "False"), result.stderr


@pytest.mark.slow
def test_a_running_relay_beats_is_healthy_and_its_death_makes_the_outbox_unhealthy(destination):
    relay = start_relay(HEARTBEAT_INTERVAL=INTERVAL)
    try:
        staged = stage_one(destination)
        wait_until(
            lambda: OutboxMessage.objects.filter(pk=staged.pk, status="published").exists(),
            timeout=60,
            what="the event published",
        )
        wait_until(
            lambda: any(r.counts.get("published") for r in relay_rows()),
            timeout=30,
            what="a beat with the publish counted",
        )
        (row,) = relay_rows()
        assert (row.database, row.worker.endswith(f":{relay.pid}")) == ("default", True)
        health = manage("outbox_health")
        assert (health.returncode, health.stdout.split(":")[0]) == (0, "healthy"), health
        report = status_json()
        (worker,) = report["workers"]
        assert (worker["kind"], worker["state"], worker["counts"]["published"]) == (
            "relay",
            "live",
            1,
        )
        assert report["counts"]["published"] == 1 and report["oldest_due_age"] is None
        relay.kill()  # SIGKILL: no last beat
        relay.communicate(timeout=30)
        wait_until(lambda: state_of(relay_rows()[0]) is WorkerState.STALE, timeout=30, what="stale")
        health = manage("outbox_health")
        assert health.returncode == 1, health
        assert "no relay of database 'default' has a live heartbeat" in health.stderr
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.communicate(timeout=30)


@pytest.mark.slow
def test_a_relay_stopped_by_sigterm_writes_its_stop(destination):
    relay = start_relay(HEARTBEAT_INTERVAL=INTERVAL)
    wait_until(relay_rows, timeout=60, what="the first beat")
    # Its beat takes the minute's sample of the outbox for the admin's chart.
    wait_until(OutboxSample.objects.exists, timeout=30, what="the minute's sample")
    code, _, err = stop(relay, signal.SIGTERM)
    assert code == 0, err
    (row,) = relay_rows()
    assert state_of(row) is WorkerState.STOPPED
    assert [w.state for w in workers()] == [WorkerState.STOPPED]


def test_a_broker_down_longer_than_the_limit_makes_the_outbox_unhealthy_and_names_it(
    destination,
):
    """A relay puts each row of a broker that is down back due at its next check of the
    broker, no attempt spent: the oldest due row never ages past a few seconds, so the
    due age alone called an outbox healthy after an hour without its broker."""
    stage_one(destination)
    relay = start_relay(HEARTBEAT_INTERVAL=INTERVAL, BROKER_URL=unreachable_broker_url("s3cret"))
    try:
        health = wait_until(
            lambda: unhealthy(manage("outbox_health", "--max-due-age", "4")),
            timeout=90,
            what="outbox_health to name the broker that is down",
            process=relay,
        )
        status = manage("outbox_status").stdout
    finally:
        code, _out, err = stop(relay)
    assert code == 0, err
    problem = next(line for line in health.stderr.split("; ") if "has been down" in line)
    assert problem.startswith("broker 'default' has been down for "), health.stderr
    assert f"more than 4s (relay {socket.gethostname()}:{relay.pid}): its rows wait" in problem
    assert "s3cret" not in health.stderr + status
    assert "broker 'default' down " in status, status
    # The refused connection of its first publish spent an attempt; the outage since, none.
    (row,) = OutboxMessage.objects.all()
    assert (row.attempts, row.status) == (1, "failed"), row.last_error


def unhealthy(result) -> object:
    """``result`` of ``outbox_health`` when it says a broker is down; None otherwise."""
    return result if result.returncode == 1 and "has been down for" in result.stderr else None


def test_outbox_health_fails_on_a_due_row_older_than_the_limit(destination):
    stage_one(destination)
    time.sleep(0.2)
    result = manage("outbox_health", "--max-due-age", "0.1", "--no-relay-required")
    assert result.returncode == 1, result
    assert "unhealthy: the oldest due row has waited" in result.stderr
    assert "more than 0.1s" in result.stderr
    ok = manage("outbox_health", "--max-due-age", "3600", "--no-relay-required", "--json")
    assert ok.returncode == 0, ok
    outcome = json.loads(ok.stdout)
    assert (outcome["healthy"], outcome["problems"], outcome["live_relays"]) == (True, [], 0)
    assert outcome["oldest_due_age_seconds"] > 0


def test_a_snapshot_held_open_past_the_limit_makes_the_outbox_unhealthy_and_names_its_session():
    """A report's REPEATABLE READ transaction left open (psql, idle in transaction) holds
    vacuum back from the rows the relays finish: outbox_health names its backend, the
    health check with a limit it has not reached says nothing, and 0 turns the check off;
    the metrics' gauge shows how long it has been held."""
    params = connection_params()
    with psycopg.connect(**params, application_name="monthly-report") as report:
        began = time.monotonic()
        report.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        report.execute("SELECT count(*) FROM django_outbox_outboxmessage").fetchone()
        pid = report.info.backend_pid
        time.sleep(1.2)
        held = snapshot_gauge()
        assert 1.2 <= held <= time.monotonic() - began + 1, held  # +1: two clocks
        result = manage(
            "outbox_health", "--no-relay-required", HEALTH_MAX_SNAPSHOT_AGE=1, HEALTH_MAX_DUE_AGE=60
        )
        assert result.returncode == 1, result
        line = result.stderr.strip()
        assert f"backend {pid} (user 'postgres', application 'monthly-report', idle in " in line
        assert "has held a snapshot open for" in line and "more than 1s" in line
        assert f"SELECT pg_terminate_backend({pid})" in line
        assert check_health(require_relay=False, max_snapshot_age=3600).problems == []
        assert check_health(require_relay=False, max_snapshot_age=0).problems == []
    assert check_health(require_relay=False, max_snapshot_age=1).problems == []  # ended
    assert snapshot_gauge() < 1.2


def snapshot_gauge() -> float:
    """``outbox_oldest_snapshot_age_seconds`` as a scrape of the relay's metrics reads it."""
    (family,) = (
        family
        for family in BacklogCollector("default", 0).collect()
        if family.name == "outbox_oldest_snapshot_age_seconds"
    )
    (sample,) = family.samples
    return float(sample.value)


def connection_params() -> dict[str, object]:
    """libpq's parameters of the tests' database (``default``)."""
    settings = connections["default"].settings_dict
    return {
        "host": settings["HOST"],
        "port": settings["PORT"],
        "user": settings["USER"],
        "dbname": settings["NAME"],
        "autocommit": True,
    }


def test_outbox_health_without_a_relay_is_unhealthy_even_when_nothing_is_due():
    result = manage("outbox_health")
    assert result.returncode == 1
    assert result.stderr.strip().endswith("no relay of database 'default' has a live heartbeat")


def test_outbox_health_exits_2_with_one_line_when_the_database_cannot_be_read():
    url = "postgres://outbox:s3cret-pw@127.0.0.1:1/nowhere"
    result = run_python(HEALTH_COMMAND, DATABASE_URL=url)
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "CommandError: cannot check the outbox: database 'default' cannot be read (OperationalError"
    ), lines
    assert "s3cret-pw" not in result.stderr + result.stdout


def test_outbox_health_exits_2_when_a_system_check_fails_and_json_says_why():
    code = HEALTH_COMMAND.replace("'outbox_health']", "'outbox_health', '--json']")
    result = run_python(code, OUTBOX_OVERRIDES=json.dumps({"BATCH_SIZE": "lots"}))
    assert result.returncode == 2, result
    message = "cannot check the outbox: the system checks failed (run manage.py check)"
    assert result.stderr.strip() == f"CommandError: {message}"
    assert json.loads(result.stdout) == {"healthy": None, "database": "default", "error": message}


def test_the_health_view_answers_200_or_503_with_json_and_refuses_post(client, destination):
    response = client.get("/outbox/health/")
    assert response.status_code == 503
    assert response.json()["problems"] == ["no relay of database 'default' has a live heartbeat"]
    assert "no-cache" in response["Cache-Control"]
    Heartbeat(WorkerKind.RELAY, "host:4").beat({})
    response = client.get("/outbox/health/")
    assert (response.status_code, response.json()["live_relays"]) == (200, 1)
    assert client.post("/outbox/health/").status_code == 405
    with override_settings(OUTBOX={**_outbox(), "HEALTH_MAX_DUE_AGE": 0.05}):
        stage_one(destination)
        time.sleep(0.1)
        response = client.get("/outbox/health/")
    assert response.status_code == 503
    assert response.json()["problems"][0].startswith("the oldest due row has waited")


def _outbox() -> dict:
    from django.conf import settings

    return dict(settings.OUTBOX)


def test_django_health_check_reports_the_outbox_check(client):
    response = client.get("/health-check/", HTTP_ACCEPT="application/json")
    assert response.status_code == 500
    assert response.json() == {
        "OutboxHealthCheck(using='default', max_due_age=None, require_relay=True)": (
            "Unavailable: no relay of database 'default' has a live heartbeat"
        )
    }
    Heartbeat(WorkerKind.RELAY, "host:5").beat({})
    response = client.get("/health-check/", HTTP_ACCEPT="application/json")
    assert response.status_code == 200, response.content
    assert list(response.json().values()) == ["OK"]


def test_a_consumer_beats_with_its_name_and_counts_and_writes_its_stop(destination):
    stage_one(destination)
    run_relay("--drain")
    received = []
    with override_settings(OUTBOX={**_outbox(), "HEARTBEAT_INTERVAL": INTERVAL}):
        consumer = InboxConsumer(destination, received.append, "beats")
        consumer.run(idle_timeout=2)
    assert len(received) == 1
    row = WorkerHeartbeat.objects.get(kind=WorkerKind.CONSUMER)
    assert row.name == f"beats@{destination}"
    assert (row.counts["received"], row.counts["handled"]) == (1, 1)
    assert row.stopped_at is not None and row.last_batch_at is not None
    text = manage("outbox_status")
    assert text.returncode == 0, text.stderr
    assert "relays and consumers (latest beat first): 1 stopped" in text.stdout
    assert f"consumer stopped {row.worker} beats@{destination}: beat " in text.stdout
