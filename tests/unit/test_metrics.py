"""The metrics exporter without services: what a batch adds to the relay's counters and
histograms, and the guards that keep the Grafana dashboard and docs/metrics.md in step
with the metrics the exporter serves."""

from __future__ import annotations

import datetime as dt
import json
import re
import uuid

import pytest
from django.utils import timezone

from django_outbox.envelope import ClaimedMessage
from django_outbox.ops.metrics import ConsumerMetrics, RelayMetrics
from django_outbox.relay import BatchStats
from django_outbox.transports.base import Failure
from tests.support import REPO

DASHBOARD = REPO / "docs" / "grafana" / "outbox-dashboard.json"
METRIC = re.compile(r"\b(?:outbox|inbox)_[a-z_]+\b")
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def served() -> set[str]:
    return RelayMetrics().sample_names() | ConsumerMetrics().sample_names()


def samples(*collectors) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for collector in collectors
        for family in collector.collect()
        for sample in family.samples
    }


def message(destination: str, age_seconds: float) -> ClaimedMessage:
    return ClaimedMessage(
        id=1,
        event_id=uuid.uuid4(),
        event_type="t",
        destination=destination,
        payload="{}",
        headers={},
        ordering_key="",
        attempts=0,
        created_at=timezone.now() - dt.timedelta(seconds=age_seconds),
    )


def test_a_batch_counts_by_destination_and_error_type_and_observes_each_published_row():
    metrics = RelayMetrics()
    refused = Failure.from_exception(ConnectionRefusedError("refused"))
    no_route = Failure("destination 'old' has no route", permanent=True, kind="no_route")
    stats = BatchStats(
        claimed=6,
        published=3,
        failed=1,
        abandoned=2,
        lost=1,
        published_rows=[message("orders", 0.001), message("orders", 3), message("bills", 7200)],
        failed_rows=[
            (refused, False, [message("orders", 1)]),
            (no_route, True, [message("old", 1), message("old", 1)]),
        ],
        seconds=0.2,
    )
    metrics.batch(stats)
    metrics.batch(BatchStats())  # nothing claimed: nothing observed
    found = samples(
        metrics.published, metrics.failures, metrics.abandoned, metrics.lease_lost,
        metrics.batch_seconds, metrics.commit_to_publish,
    )  # fmt: skip

    def at(name: str, **labels: str) -> float:
        return found[(name, frozenset(labels.items()))]

    assert at("outbox_messages_published_total", destination="orders") == 2
    assert at("outbox_messages_published_total", destination="bills") == 1
    assert at("outbox_publish_failures_total", destination="orders",
              error_type="ConnectionRefusedError") == 1  # fmt: skip
    assert at("outbox_publish_failures_total", destination="old", error_type="no_route") == 2
    assert at("outbox_messages_abandoned_total", destination="old") == 2
    assert at("outbox_lease_lost_total") == 1
    assert at("outbox_batch_duration_seconds_count") == 1
    assert at("outbox_commit_to_publish_seconds_count") == 3
    # Cumulative buckets: the 1 ms row by 1 s (made a moment before it is observed: on a
    # busy machine more than the first bucket's 5 ms), the 3 s row by 5 s, the 2 h row by 4 h.
    assert at("outbox_commit_to_publish_seconds_bucket", le="1.0") == 1
    assert at("outbox_commit_to_publish_seconds_bucket", le="5.0") == 2
    assert at("outbox_commit_to_publish_seconds_bucket", le="3600.0") == 2
    assert at("outbox_commit_to_publish_seconds_bucket", le="14400.0") == 3
    assert at("outbox_commit_to_publish_seconds_bucket", le="+Inf") == 3
    assert at("outbox_commit_to_publish_seconds_sum") == pytest.approx(7203.001, abs=1)


def test_every_metric_the_grafana_dashboard_queries_is_served():
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    used = {name for expression in expressions for name in METRIC.findall(expression)}
    assert len(used) >= 10  # the scan found the dashboard's queries
    assert sorted(used - served()) == []


def test_docs_metrics_lists_exactly_the_served_metrics():
    text = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `((?:outbox|inbox)_[a-z_]+)` \| (?:counter|gauge|histogram)",
                                text, re.MULTILINE))  # fmt: skip
    names = served()
    families = {n.removesuffix(s) for n in names for s in HISTOGRAM_SUFFIXES if n.endswith(s)}
    expected = {n for n in names if not n.endswith(HISTOGRAM_SUFFIXES)} | families
    assert sorted(documented) == sorted(expected)
