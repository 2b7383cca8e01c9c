"""Prometheus metrics (``--metrics-port``, issue 16): real relay and consumer subprocesses
on real PostgreSQL and RabbitMQ, scraped over HTTP and parsed with prometheus_client's own
parser; a real Prometheus server (Debian's ``prometheus``) scraping a relay; the one-line
errors of a port in use and of the missing ``[prometheus]`` extra."""

from __future__ import annotations

import datetime as dt
import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
from django.db import transaction
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from django_outbox import stage
from django_outbox.models import OutboxMessage
from tests.support import (
    delete_queue,
    free_port,
    free_ports,
    manage,
    publish_raw,
    refused_port,
    run_python,
    run_relay,
    running,
    stage_events,
    start_command,
    start_relay,
    stop,
    unique_destination,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

Status = OutboxMessage.Status
PROMETHEUS = "/usr/bin/prometheus"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:port/metrics``, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def scraped(port: int, name: str, expected: float, **labels: str) -> Samples | None:
    """The samples once ``name{labels}`` is ``expected``; None before (or not serving yet)."""
    try:
        samples = scrape(port)
    except OSError:
        return None
    return samples if value(samples, name, **labels) == expected else None


@pytest.fixture
def destination() -> Iterator[str]:
    name = unique_destination("m")
    yield name
    delete_queue(name)


def blocked_key(destination: str) -> None:
    """An ordered key whose head (sequence 1) is ABANDONED and whose sequence 2 waits,
    due for an hour: one blocked key, one pending row."""
    hour_ago = timezone.now() - dt.timedelta(hours=1)
    for sequence, status in ((1, Status.ABANDONED), (2, Status.PENDING)):
        OutboxMessage.objects.create(
            event_type="order.changed",
            destination=destination,
            payload={},
            ordering_key="order-1",
            sequence=sequence,
            status=status,
            available_at=hour_ago,
            abandoned_at=hour_ago if status == Status.ABANDONED else None,
        )


def test_a_relay_serves_its_counts_and_the_backlog_read_from_the_database(destination):
    retired, ordered = unique_destination("retired"), unique_destination("ordered")
    stage_events(7, destination)
    stage_events(2, retired)  # no route in the relay's settings: abandoned at once
    blocked_key(ordered)
    OutboxMessage.objects.create(  # waits for its retry an hour from now
        event_type="t", destination=destination, payload={}, status=Status.FAILED, attempts=1,
        last_error="RuntimeError: failed",
        available_at=timezone.now() + dt.timedelta(hours=1),
    )  # fmt: skip
    port = free_port()
    routes = {destination: {"queue": destination}, ordered: {"ordered": True}}
    relay = start_relay(
        "--metrics-port",
        str(port),
        ROUTES=routes,
        DEFAULT_ROUTE=False,
        START_JITTER=0,
        METRICS_BACKLOG_INTERVAL=0,  # each scrape reads the backlog as it is then
    )
    with running(relay):
        samples = wait_until(
            lambda: scraped(port, "outbox_messages_abandoned_total", 2, destination=retired),
            timeout=60,
            what="the abandoned rows counted",
        )
    assert value(samples, "outbox_messages_published_total", destination=destination) == 7
    assert value(samples, "outbox_publish_failures_total", destination=retired,
                 error_type="no_route") == 2  # fmt: skip
    assert value(samples, "outbox_commit_to_publish_seconds_count") == 7
    assert value(samples, "outbox_batch_duration_seconds_count") >= 1
    assert value(samples, "outbox_lease_lost_total") == 0
    backlog = {
        status: value(samples, "outbox_backlog_messages", status=status)
        for status in ("pending", "processing", "failed", "abandoned")
    }
    assert backlog == {"pending": 1, "processing": 0, "failed": 1, "abandoned": 3}
    assert value(samples, "outbox_blocked_keys") == 1
    assert 3600 <= value(samples, "outbox_oldest_due_age_seconds") < 3600 * 2  # the blocked row
    assert value(samples, "outbox_scrape_error") == 0


#: Two scrapes of a relay's metrics (the collectors, as the HTTP server calls them) in a
#: process of its own, where the database alias "other" points at a port nothing listens
#: on (pytest-django forbids an alias that is not a test database in this process).
SCRAPE_TWICE = (
    "import django; django.setup(); "
    "from prometheus_client import generate_latest; "
    "from django_outbox.ops.metrics import RelayMetrics; "
    "print(generate_latest(RelayMetrics('other').registry).decode()); print('----'); "
    "print(generate_latest(RelayMetrics('default').registry).decode())"
)


def parse(text: str) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_a_database_error_on_scrape_is_a_gauge_and_a_warning_not_a_crash():
    nowhere = f"postgres://outbox@127.0.0.1:{refused_port()}/nowhere"
    result = run_python(SCRAPE_TWICE, OTHER_DATABASE_URL=nowhere)
    assert result.returncode == 0, result.stderr
    broken, healthy = map(parse, result.stdout.split("----\n"))
    assert value(broken, "outbox_scrape_error") == 1
    assert value(broken, "outbox_backlog_messages", status="pending") is None
    assert value(healthy, "outbox_scrape_error") == 0
    assert value(healthy, "outbox_backlog_messages", status="pending") == 0
    assert "metrics: could not read the outbox backlog (OperationalError: " in result.stderr


#: Scrapes of a backlog collector (argv[1]: its interval) before and after 3 events are
#: staged, then of the same collector once the interval has run out.
SCRAPE_AROUND_STAGING = """
import sys, django
django.setup()
from django.db import transaction
from prometheus_client import CollectorRegistry, generate_latest
from django_outbox import stage
from django_outbox.ops.metrics import BacklogCollector
registry, collector = CollectorRegistry(), BacklogCollector("default", float(sys.argv[1]))
registry.register(collector)
print(generate_latest(registry).decode(), "----")
with transaction.atomic():
    for _ in range(3):
        stage("t", {}, destination="m")
print(generate_latest(registry).decode(), "----")
collector.interval = 0
print(generate_latest(registry).decode())
"""


@pytest.mark.parametrize(("interval", "second"), [(3600, 0), (0, 3)])
def test_the_backlog_is_read_again_once_its_interval_is_over(interval, second):
    """A scrape within ``METRICS_BACKLOG_INTERVAL`` of the last read is served that
    read: a read costs PostgreSQL tens of milliseconds during a drain, and a scraper may
    ask every second. After the interval (0: always) the database is read again."""
    result = run_python(SCRAPE_AROUND_STAGING, str(interval))
    assert result.returncode == 0, result.stderr
    first, then, after = map(parse, result.stdout.split("----\n"))
    pending = [value(s, "outbox_backlog_messages", status="pending") for s in (first, then, after)]
    assert pending == [0, second, 3]
    assert [value(s, "outbox_scrape_error") for s in (first, then, after)] == [0, 0, 0]


def test_a_port_in_use_is_one_line_and_exit_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = manage("run_outbox_relay", "--metrics-port", str(port))
    assert result.returncode == 1
    assert result.stderr == (
        f"CommandError: --metrics-port {port}: cannot listen on 127.0.0.1:{port}: "
        "Address already in use\n"
    )


#: Runs manage.py with prometheus_client unimportable, as when the extra is not installed:
#: None in sys.modules makes ``import prometheus_client`` raise the ModuleNotFoundError
#: (name "prometheus_client") an absent package raises, without a second virtualenv.
WITHOUT_PROMETHEUS = (
    "import runpy, sys; sys.modules['prometheus_client'] = None; "
    "sys.argv = ['manage.py', *sys.argv[1:]]; runpy.run_path('manage.py', run_name='__main__')"
)


def without_prometheus(*args: str) -> subprocess.CompletedProcess[str]:
    return run_python(WITHOUT_PROMETHEUS, *args)


@pytest.mark.parametrize("command", ["run_outbox_relay", "run_outbox_consumer"])
def test_without_the_extra_metrics_port_names_it_and_nothing_runs(command):
    consumer = ["--queue", "q", "--handler", "tests.testapp.handlers.record", "--consumer", "a"]
    args = consumer if command == "run_outbox_consumer" else []
    result = without_prometheus(command, "--metrics-port", "9", *args)
    assert result.returncode == 1
    assert result.stderr == (
        "CommandError: --metrics-port needs prometheus_client, which is not installed: "
        "pip install 'django-transactional-outbox[prometheus]'\n"
    )


def test_without_the_extra_the_relay_runs_without_metrics(destination):
    stage_events(3, destination)
    result = without_prometheus("run_outbox_relay", "--once")
    assert (result.returncode, result.stdout.splitlines()[0]) == (
        0,
        "claimed 3, published 3, failed 0, abandoned 0, lease lost 0",
    ), result.stderr


def test_a_consumer_serves_its_outcomes_and_handler_runs(destination):
    stage_events(3, destination)
    with transaction.atomic():
        stage("test.event", {"fail": True}, destination=destination)  # the handler raises
    run_relay("--drain")
    publish_raw(destination, b"\x80 not json", content_type="application/json")
    port = free_port()
    consumer = start_command(
        "run_outbox_consumer", "--queue", destination, "--handler",
        "tests.testapp.handlers.record", "--consumer", "audit", "--max-deliveries", "1",
        "--metrics-port", str(port),
    )  # fmt: skip
    with running(consumer):
        samples = wait_until(
            lambda: scraped(port, "inbox_messages_total", 1, consumer="audit", outcome="rejected"),
            timeout=60,
            what="the undecodable message rejected, after the events",
            process=consumer,
        )
    outcomes = {
        outcome: value(samples, "inbox_messages_total", consumer="audit", outcome=outcome)
        for outcome in ("handled", "duplicate", "ignored", "failed", "held", "parked", "rejected")
    }
    assert outcomes == {
        "handled": 3, "duplicate": 0, "ignored": 0, "failed": 0, "held": 0, "parked": 1,
        "rejected": 1,
    }  # fmt: skip
    assert value(samples, "inbox_handler_duration_seconds_count", consumer="audit") == 4


@pytest.fixture
def prometheus(tmp_path) -> Iterator[tuple[int, int]]:
    """Debian's Prometheus scraping 127.0.0.1:<relay port> every second; yields (its API
    port, the relay's port). Stopped by its pid."""
    if shutil.which(PROMETHEUS) is None:
        pytest.skip(f"{PROMETHEUS} is not installed (apt-get install prometheus)")
    relay_port, api_port = free_ports(2)
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: outbox_relay\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{relay_port}']}}]\n"
    )
    server = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{api_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield api_port, relay_port
    finally:
        stop(server, timeout=30)


def query(api_port: int, expression: str) -> list[dict]:
    """The result of an instant query through Prometheus' HTTP API; [] before it answers."""
    url = f"http://127.0.0.1:{api_port}/api/v1/query?" + urllib.parse.urlencode(
        {"query": expression}
    )
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            answer = json.load(response)
    except OSError:
        return []
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


@pytest.mark.slow  # two servers start: Prometheus and the relay, about 7 s
def test_a_real_prometheus_scrapes_the_relay_and_answers_a_query(destination, prometheus):
    api_port, relay_port = prometheus
    stage_events(5, destination)
    relay = start_relay("--metrics-port", str(relay_port), START_JITTER=0)
    expression = f'outbox_messages_published_total{{destination="{destination}"}}'
    with running(relay):
        (series,) = wait_until(
            lambda: [s for s in query(api_port, expression) if s["value"][1] == "5"],
            timeout=60,
            what="Prometheus to scrape 5 published events",
        )
        # Asked while the relay runs: a scrape after its stop would make ``up`` 0.
        (up,) = query(api_port, 'up{job="outbox_relay"}')
    assert series["metric"]["job"] == "outbox_relay"
    assert series["metric"]["instance"] == f"127.0.0.1:{relay_port}"
    assert up["value"][1] == "1"
