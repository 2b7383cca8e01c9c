"""Metrics and tracing switched on, for the rounds that measure what they cost.

A relay worker started with ``--telemetry`` (:func:`switched_on`) records spans through
the OpenTelemetry SDK (a batch processor whose exporter drops them: the cost of making
spans, not of shipping them) and serves its Prometheus metrics, scraped once a second
by a thread of its own (a busier scraper than any real Prometheus). The backlog of those
rounds is staged under a span (:func:`creation_span`), so each row carries a
``traceparent`` and the relay links its send spans to them.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

#: Seconds between two scrapes of the relay's /metrics.
SCRAPE_INTERVAL = 1.0


@contextlib.contextmanager
def creation_span() -> Iterator[None]:
    """A recording span, current inside: what ``stage()`` captures as the creation
    context. Its provider is a local one, so the runner's other scenarios stay untraced."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("benchmarks")
    with tracer.start_as_current_span("POST /orders"):
        yield


@contextlib.contextmanager
def switched_on(using: str = "default") -> Iterator[Callable[[Any], None]]:
    """Tracing and metrics on in this process; yields the relay's ``on_batch``."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from django_outbox.ops.metrics import RelayMetrics

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    trace.set_tracer_provider(provider)
    metrics = RelayMetrics(using)
    port = metrics.serve(0)
    stop = threading.Event()
    scraper = threading.Thread(target=_scrape, args=(port, stop), daemon=True)
    scraper.start()
    try:
        yield metrics.batch
    finally:
        stop.set()
        scraper.join()
        metrics.close()
        provider.shutdown()


def _scrape(port: int, stop: threading.Event) -> None:
    while not stop.wait(SCRAPE_INTERVAL):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            reply.read()
