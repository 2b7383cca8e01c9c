"""Prometheus metrics of the relay and the consumer, served by ``--metrics-port``.

The only module that imports ``prometheus_client`` (the ``[prometheus]`` extra); the
commands import it only when ``--metrics-port`` is given. Each exporter has a
:class:`~prometheus_client.CollectorRegistry` of its own, never the global one, so two
relays (or tests) in one process do not share counters.

The relay's counters and histograms are updated once per batch from its
:class:`~django_outbox.relay.BatchStats` (``Relay.run(on_batch=...)``), on the relay's
thread. The backlog gauges are read from the database when Prometheus scrapes, on the
HTTP server's thread with a connection of its own, closed after the scrape; a database
error there sets ``outbox_scrape_error`` to 1 and leaves the gauges out, the relay
carries on. The consumer's counters are its :class:`~django_outbox.consumer.ConsumerStats`,
read at scrape time. See docs/metrics.md for every metric.
"""

from __future__ import annotations

import bisect
import collections
import datetime as dt
import functools
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from django.db import DatabaseError, connections
from django.utils import timezone
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from .. import db
from ..conf import outbox_settings
from ..conf.redact import SecretFilter
from ..consumer import ConsumerStats, InboxConsumer
from ..envelope import ReceivedEvent
from ..relay.loop import BatchStats
from ..state.status import summary

logger = logging.getLogger("django_outbox.metrics")
logger.addFilter(SecretFilter(outbox_settings.redact))  # the driver's error on a failed scrape
C = TypeVar("C", bound=Collector)
_destination = operator.attrgetter("destination")
_created_at = operator.attrgetter("created_at")

#: Seconds one batch takes, claim to finalize: milliseconds when the broker keeps up.
BATCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Seconds from staging to publish: milliseconds with LISTEN/NOTIFY, up to the retries'
#: minutes and an outage's hours.
LATENCY_BUCKETS = (
    *(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
    *(60.0, 300.0, 900.0, 3600.0, 14400.0),
)
#: Seconds a consumer's handler runs.
HANDLER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: The states ``outbox_backlog_messages`` reports: the rows not published yet.
BACKLOG_STATES = ("pending", "processing", "failed", "abandoned")
#: ``inbox_messages_total``'s outcomes, each the ConsumerStats field that counts it.
INBOX_OUTCOMES = {
    "handled": "handled",
    "duplicate": "duplicates",
    "ignored": "ignored",
    "failed": "failed",
    "held": "held",
    "parked": "parked",
    "rejected": "rejected",
}


#: The samples a family of each type shows, by suffix (a counter's ``_created`` aside).
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum"),
}


class Exporter:
    """A registry of its own, served over HTTP at ``/metrics`` by :meth:`serve`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.collectors: list[Collector] = []
        self._server: WSGIServer | None = None

    def add(self, collector: C) -> C:
        """Register ``collector``; returns it."""
        self.registry.register(collector)
        self.collectors.append(collector)
        return collector

    def sample_names(self) -> set[str]:
        """The names of the samples ``/metrics`` shows, found without a database read
        (from each collector's ``describe()``): what a dashboard or an alert may query."""
        return {
            family.name + suffix
            for collector in self.collectors
            for family in collector.describe()  # type: ignore[attr-defined]  # each of ours has one
            for suffix in SAMPLE_SUFFIXES[family.type]
        }

    def serve(self, port: int, address: str = "127.0.0.1") -> int:
        """Serve the registry on ``address:port`` (0: any free port) on a daemon thread;
        returns the port. An ``OSError`` when the address cannot be bound (in use)."""
        self._server, _thread = start_http_server(port, address, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RelayMetrics(Exporter):
    """The relay's metrics: counters and histograms fed by :meth:`batch` (give it to
    ``Relay.run(on_batch=...)``), and the backlog of the database ``using`` read on scrape."""

    def __init__(self, using: str = "default") -> None:
        super().__init__()
        self.published = self.add(
            Counter(
                "outbox_messages_published",
                "Messages the broker took (confirmed where it confirms), by destination.",
                ["destination"],
                registry=None,
            )
        )
        self.failures = self.add(
            Counter(
                "outbox_publish_failures",
                "Messages not published by a batch (retried or abandoned), by destination "
                "and kind of failure.",
                ["destination", "error_type"],
                registry=None,
            )
        )
        self.abandoned = self.add(
            Counter(
                "outbox_messages_abandoned",
                "Messages abandoned (poison, or attempts exhausted), by destination.",
                ["destination"],
                registry=None,
            )
        )
        self.lease_lost = self.add(
            Counter(
                "outbox_lease_lost",
                "Claimed messages whose lease another relay took over before the batch ended.",
                registry=None,
            )
        )
        self._histograms()
        self.add(BacklogCollector(using))

    def _histograms(self) -> None:
        self.batch_seconds = self.add(
            Histogram(
                "outbox_batch_duration_seconds",
                "Seconds from the start of a batch's claim to the end of its finalize.",
                buckets=BATCH_BUCKETS,
                registry=None,
            )
        )
        self.commit_to_publish = self.add(
            BatchHistogram(
                "outbox_commit_to_publish_seconds",
                "Seconds from a message's created_at (its staging) to the end of its batch.",
                LATENCY_BUCKETS,
            )
        )

    def batch(self, stats: BatchStats) -> None:
        """Count one batch of the relay (a ``Relay.run`` ``on_batch`` callback)."""
        if not stats.claimed:
            return
        self.batch_seconds.observe(stats.seconds)
        if stats.lost:
            self.lease_lost.inc(stats.lost)
        if stats.published_rows:
            self._published(stats)
        for failure, abandoned, rows in stats.failed_rows:
            for destination, count in collections.Counter(map(_destination, rows)).items():
                self.failures.labels(destination, failure.error_type).inc(count)
                if abandoned:
                    self.abandoned.labels(destination).inc(count)

    def _published(self, stats: BatchStats) -> None:
        """The published rows counted by destination, and their ages (by one clock
        reading) into the commit-to-publish histogram, without Python code per row."""
        rows = stats.published_rows
        self.commit_to_publish.observe_ages(timezone.now(), list(map(_created_at, rows)))
        for destination, count in collections.Counter(map(_destination, rows)).items():
            self.published.labels(destination).inc(count)


class BatchHistogram(Collector):
    """A histogram of ages that takes a batch of them under one lock, at the cost of a
    sort and a bisection per bucket: ``Histogram.observe`` takes a lock per bucket
    update and per sum, and the relay observes every message it publishes."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self._deltas = [dt.timedelta(seconds=bound) for bound in self.bounds]
        self._counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_ages(self, now: dt.datetime, since: list[dt.datetime]) -> None:
        """Observe the seconds from each moment of ``since`` (sorted here) to ``now``."""
        since.sort()
        # How many ages are above each bound: the moments before now - bound.
        above = [bisect.bisect_left(since, now - bound) for bound in self._deltas]
        counts = map(operator.sub, [len(since), *above], [*above, 0])  # in each bucket
        ages = sum(map(operator.sub, itertools.repeat(now, len(since)), since), dt.timedelta())
        with self._lock:
            for place, count in enumerate(counts):
                self._counts[place] += count
            self._sum += ages.total_seconds()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, buckets=[("+Inf", 0)])


class BacklogCollector(Collector):
    """The outbox's backlog, read through :mod:`django_outbox.state.status` (``summary()``,
    blocked keys included: on PostgreSQL one statement), with a connection of the
    scraping thread's own, closed afterwards. A scrape within ``interval`` seconds
    (``METRICS_BACKLOG_INTERVAL``) of the last read is served that read's gauges:
    during a drain a read costs PostgreSQL tens of milliseconds, and a scraper may ask
    every second. A database error is logged and exported as ``outbox_scrape_error 1``,
    without the gauges; it is not kept, so the next scrape reads again."""

    def __init__(self, using: str, interval: float | None = None) -> None:
        self.using = using
        self.interval = outbox_settings.METRICS_BACKLOG_INTERVAL if interval is None else interval
        self._lock = threading.Lock()  # one read at a time; scrapes meanwhile wait for it
        self._last: tuple[float, list[Metric]] | None = None  # when read, its gauges

    def collect(self) -> Iterator[Metric]:
        error = _scrape_error()
        with self._lock:
            gauges = self._recent() or self._read()
        error.add_metric([], 0 if gauges else 1)
        yield from gauges
        yield error

    def _recent(self) -> list[Metric]:
        """The last read's gauges while they are under ``interval`` seconds old."""
        if self._last is None or time.monotonic() - self._last[0] >= self.interval:
            return []
        return self._last[1]

    def _read(self) -> list[Metric]:
        started = time.monotonic()
        try:
            gauges = self._gauges()
        except DatabaseError as exc:
            logger.warning(
                "metrics: could not read the outbox backlog (%s: %s)",
                type(exc).__name__,
                exc,
                extra={"action": "outbox.metrics_scrape_failed", "using": self.using},
            )
            gauges = []
        finally:
            connections[self.using].close()  # this thread's: each scrape has its own
        self._last = (started, gauges) if gauges else None
        return gauges

    def describe(self) -> Iterator[Metric]:
        """The families, without a database read."""
        yield from _backlog_families()
        yield _scrape_error()

    def _gauges(self) -> list[Metric]:
        backlog = summary(self.using, BACKLOG_STATES, blocked=True)
        rows, age, blocked, scheduled, snapshot = _backlog_families()
        for status in BACKLOG_STATES:
            rows.add_metric([status], backlog.counts[status].value)
        oldest = backlog.oldest_due_age
        age.add_metric([], 0.0 if oldest is None else oldest.total_seconds())
        assert backlog.blocked is not None and backlog.scheduled is not None  # asked for
        blocked.add_metric([], backlog.blocked.value)
        scheduled.add_metric([], backlog.scheduled.value)
        held = db.oldest_snapshot(self.using)
        snapshot.add_metric([], 0.0 if held is None else held.held)
        return [rows, age, blocked, scheduled, snapshot]


def _backlog_families() -> tuple[GaugeMetricFamily, ...]:
    return (
        GaugeMetricFamily(
            "outbox_backlog_messages",
            "Outbox rows not published, by state; pending: those due, the scheduled ones "
            "apart (large counts are the planner's estimates).",
            labels=["status"],
        ),
        GaugeMetricFamily(
            "outbox_oldest_due_age_seconds",
            "Seconds the oldest due row has waited (0 when none is due).",
            labels=[],
        ),
        GaugeMetricFamily(
            "outbox_blocked_keys",
            "Ordered keys held back by an ABANDONED head (until it is requeued or skipped).",
            labels=[],
        ),
        GaugeMetricFamily(
            "outbox_scheduled_messages",
            "Pending rows not due yet (scheduled with a later available_at), not in the "
            "backlog (large counts are the planner's estimates).",
            labels=[],
        ),
        GaugeMetricFamily(
            "outbox_oldest_snapshot_age_seconds",
            "Seconds another session of the database has held its snapshot open (0 when "
            "none, and off PostgreSQL): vacuum keeps every row finished since.",
            labels=[],
        ),
    )


def _scrape_error() -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "outbox_scrape_error",
        "1 when the last scrape could not read the backlog from the database, else 0.",
        labels=[],
    )


class ConsumerMetrics(Exporter):
    """A consumer's metrics: ``inbox_messages_total`` read from the consumers it
    :meth:`watch` es, and the handler's duration, timed by :meth:`timed`."""

    def __init__(self) -> None:
        super().__init__()
        self.handler_seconds = self.add(
            Histogram(
                "inbox_handler_duration_seconds",
                "Seconds a consumer's handler ran (failed runs included; not the inbox's commit).",
                ["consumer"],
                buckets=HANDLER_BUCKETS,
                registry=None,
            )
        )
        self.inbox = self.add(_InboxCollector())

    def timed(
        self, handler: Callable[[ReceivedEvent], object], consumer: str
    ) -> Callable[[ReceivedEvent], object]:
        """``handler``, its every run observed in ``inbox_handler_duration_seconds``."""
        timer = self.handler_seconds.labels(consumer).time

        @functools.wraps(handler)
        def run(event: ReceivedEvent) -> object:
            with timer():
                return handler(event)

        return run

    def watch(self, consumer: InboxConsumer) -> None:
        """Export ``consumer``'s counts (its :class:`ConsumerStats`)."""
        self.inbox.watched.append((consumer.consumer, consumer.stats))


class _InboxCollector(Collector):
    """``inbox_messages_total``, read from the stats of the watched consumers."""

    def __init__(self) -> None:
        self.watched: list[tuple[str, ConsumerStats]] = []

    def collect(self) -> Iterator[Metric]:
        family = next(self.describe())
        for consumer, stats in self.watched:
            for outcome, field in INBOX_OUTCOMES.items():
                family.add_metric([consumer, outcome], getattr(stats, field))
        yield family

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "inbox_messages",
            "Messages a consumer received, by what became of them.",
            labels=["consumer", "outcome"],
        )
