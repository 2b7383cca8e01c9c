"""OpenTelemetry tracing on real PostgreSQL, RabbitMQ and Redis, recorded by the SDK's
in-memory exporter: one trace runs from a request that stages an event, through the
relay's ``send`` span (linked) to the consumer's ``process`` span and the handler's spans."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from urllib.parse import urlsplit

import kombu
import pytest
from django.db import transaction
from django.db.models.expressions import RawSQL
from django.test import override_settings
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode

from django_outbox import ReceivedEvent, stage, stage_many
from django_outbox.consumer import InboxConsumer
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from django_outbox.tracing import MAX_LINKS
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    REPO,
    broker_connection,
    delete_queue,
    drain_raw,
    publish_raw,
    relay_env,
    unique_destination,
)

pytestmark = pytest.mark.django_db(transaction=True)

EXPORTER = InMemorySpanExporter()
tracer = trace.get_tracer("tests")
BROKERS = {
    "rabbitmq": (AMQP_URL, "rabbitmq"),
    "redis": (REDIS_URL, "redis"),
}


#: Stages, relays and consumes one event with OpenTelemetry blocked (argv: destination,
#: traceparent); prints what it saw as JSON.
NO_OTEL_SCRIPT = textwrap.dedent(
    """
    import json, sys

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "opentelemetry":
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, Blocker())
    import django

    django.setup()
    from django.db import transaction
    from django_outbox import stage, tracing
    from django_outbox.consumer import InboxConsumer
    from django_outbox.relay import Relay

    destination, parent = sys.argv[1:]
    with transaction.atomic():
        row = stage("a", {}, destination=destination, headers={"traceparent": parent})
    with Relay() as relay:
        published = relay.run_once().published
    handled = []
    InboxConsumer(destination, handled.append, "audit").run(idle_timeout=1)
    print(json.dumps({
        "enabled": tracing.trace is not None,
        "headers": row.headers,
        "published": published,
        "handled": [event.headers["traceparent"] for event in handled],
        "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry")),
    }))
    """
)


@pytest.fixture
def spans():
    """The spans finished in the test (the SDK's provider is set once per process)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
        trace.set_tracer_provider(provider)
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


@pytest.fixture(params=BROKERS)
def broker(request):
    url, system = BROKERS[request.param]
    destination = unique_destination("trace")
    with override_settings(OUTBOX={"BROKER_URL": url}):
        yield destination, url, system
    delete_queue(destination, url)


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in spans.get_finished_spans() if span.name == name]


def ids(context: SpanContext | None) -> tuple[int, int] | None:
    """A span context's trace and span ids (a context read from headers is remote)."""
    return None if context is None else (context.trace_id, context.span_id)


def server(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    return {"server.address": parts.hostname, "server.port": parts.port}


def relay_and_consume(destination: str, handler) -> None:  # type: ignore[no-untyped-def]
    with Relay() as relay:
        relay.run_once()
    InboxConsumer(destination, handler, "audit", max_deliveries=1).run(idle_timeout=1)


def test_one_trace_runs_from_the_request_to_the_handler(client, spans, broker):
    destination, url, system = broker
    with tracer.start_as_current_span("GET /orders/") as request_span:
        event_id = client.get("/orders/", {"destination": destination}).json()["event_id"]

    def handle(event: ReceivedEvent) -> None:
        with tracer.start_as_current_span("handle order"):
            pass

    relay_and_consume(destination, handle)
    request = request_span.get_span_context()
    (send,) = named(spans, f"send {destination}")
    assert (send.kind, send.status.status_code, [ids(link.context) for link in send.links]) == (
        SpanKind.CLIENT,
        StatusCode.UNSET,
        [ids(request)],
    )
    assert dict(send.attributes) == {
        "messaging.system": system,
        **server(url),
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.destination.name": destination,
        "messaging.message.id": event_id,
    }
    (process,) = named(spans, f"process {destination}")
    (handled,) = named(spans, "handle order")
    assert (process.kind, process.status.status_code) == (SpanKind.CONSUMER, StatusCode.UNSET)
    assert (ids(process.parent), handled.parent) == (ids(request), process.context)
    assert {request.trace_id, process.context.trace_id, handled.context.trace_id} == {
        request.trace_id
    }
    assert dict(process.attributes) == {
        "messaging.system": system,
        **server(url),
        "messaging.consumer.group.name": "audit",
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": destination,
        "messaging.message.id": event_id,
    }


def test_a_batch_links_the_rows_staged_in_a_span_and_a_hostile_traceparent_is_ignored(spans):
    destination = unique_destination("trace")
    hostile = {"traceparent": "00-" + "f" * 600, "tracestate": "x=\u00e9"}
    with tracer.start_as_current_span("request") as request_span, transaction.atomic():
        stage("a", {}, destination=destination)
        stage("b", {}, destination=destination, headers=hostile)
    with transaction.atomic():
        stage("c", {}, destination=destination)
    parents = {}

    def handle(event: ReceivedEvent) -> None:
        parents[event.event_type] = ids(trace.get_current_span().parent)

    try:
        relay_and_consume(destination, handle)
    finally:
        delete_queue(destination)
    (send,) = named(spans, f"send {destination}")
    assert send.attributes["messaging.batch.message_count"] == 3
    assert "messaging.message.id" not in send.attributes
    assert [ids(link.context) for link in send.links] == [ids(request_span.get_span_context())]
    assert parents == {"a": ids(request_span.get_span_context()), "b": None, "c": None}


def test_a_batch_links_each_creation_context_once(spans):
    """Rows staged in one request share their creation context: the send span links
    it once, however many of them the batch holds."""
    destination = unique_destination("trace")
    contexts = []
    for request, count in (("first", 100), ("second", 50)):
        with tracer.start_as_current_span(request) as span, transaction.atomic():
            stage_many({"event_type": "a", "payload": {}, "destination": destination}
                       for _ in range(count))  # fmt: skip
        contexts.append(ids(span.get_span_context()))
    try:
        with Relay(batch_size=200) as relay:
            assert relay.run_once().published == 150
    finally:
        delete_queue(destination)
    (send,) = named(spans, f"send {destination}")
    assert [ids(link.context) for link in send.links] == contexts
    assert "outbox.links_dropped" not in send.attributes


def test_a_large_batch_links_its_last_contexts_up_to_the_limit_and_counts_the_others(spans):
    destination = unique_destination("trace")
    contexts = []
    for request in range(MAX_LINKS + 22):
        with tracer.start_as_current_span(f"request {request}") as span, transaction.atomic():
            stage("a", {}, destination=destination)
            if request % 2:  # a second event of the request: no second link
                stage("b", {}, destination=destination)
        contexts.append(ids(span.get_span_context()))
    try:
        with Relay(batch_size=500) as relay:
            assert relay.run_once().published == MAX_LINKS + 22 + (MAX_LINKS + 22) // 2
    finally:
        delete_queue(destination)
    (send,) = named(spans, f"send {destination}")
    assert [ids(link.context) for link in send.links] == contexts[22:]
    assert send.attributes["outbox.links_dropped"] == 22
    assert send.dropped_links == 0


@pytest.mark.parametrize(
    "traceparent",
    ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\x00", "ff-" + "1" * 1000, 42],
    ids=["NUL", "long", "number"],
)
def test_a_message_with_a_hostile_traceparent_is_handled_in_a_new_trace(spans, traceparent):
    destination = unique_destination("trace")
    event_id = str(uuid.uuid4())
    with broker_connection() as connection:
        kombu.Queue(destination, channel=connection.channel()).declare()
    publish_raw(
        destination,
        "{}",
        content_type="application/json",
        headers={"event_id": event_id, "traceparent": traceparent, "tracestate": "\x00"},
    )
    handled: list[ReceivedEvent] = []
    try:
        InboxConsumer(destination, handled.append, "audit").run(idle_timeout=1)
    finally:
        delete_queue(destination)
    (process,) = named(spans, f"process {destination}")
    assert ([str(event.event_id) for event in handled], process.parent) == ([event_id], None)
    assert process.attributes["messaging.message.id"] == event_id


def test_a_handler_error_fails_the_process_span_with_its_class_name(spans):
    destination = unique_destination("trace")
    with transaction.atomic():
        stage("a", {}, destination=destination)

    def fail(event: ReceivedEvent) -> None:
        raise LookupError("customer 7 s3cret")

    try:
        relay_and_consume(destination, fail)
    finally:
        delete_queue(destination)
    (process,) = named(spans, f"process {destination}")
    assert process.attributes["error.type"] == "LookupError"
    assert (process.status.status_code, process.status.description) == (
        StatusCode.ERROR,
        "LookupError raised",
    )
    assert process.events == ()  # the exception's text (which may hold data) is not recorded


class _Raising(SpanProcessor):
    """A project's span processor with a bug: raises when a span ends, while active."""

    active = added = False

    def on_end(self, span: ReadableSpan) -> None:
        if self.active:
            raise RuntimeError("the exporter's queue is gone")


RAISING = _Raising()


def test_a_span_processor_that_raises_loses_no_publish_and_fails_no_handler(spans, caplog):
    """Ending a span runs the project's processors: one that raises is logged, and the
    publish the broker confirmed and the handler that committed stand."""
    if not RAISING.added:  # the provider is the process's; the processor stays, inactive
        trace.get_tracer_provider().add_span_processor(RAISING)
        RAISING.added = True
    destination = unique_destination("trace")
    with transaction.atomic():
        row = stage("a", {}, destination=destination)
    handled: list[ReceivedEvent] = []
    RAISING.active = True
    try:
        with Relay() as relay:
            published = relay.run_once().published
        consumer = InboxConsumer(destination, handled.append, "audit", max_deliveries=1)
        stats = consumer.run(idle_timeout=1)
    finally:
        RAISING.active = False
        delete_queue(destination)
    row.refresh_from_db()
    assert (published, row.status, [e.event_id for e in handled]) == (
        1,
        "published",
        [row.event_id],
    )
    assert (stats.handled, stats.failed) == (1, 0)
    failed = [r for r in caplog.records if getattr(r, "action", "") == "outbox.span_failed"]
    assert [r.args[0] for r in failed] == [
        f"send {destination}",
        f"process {destination}",
    ]


def test_an_unroutable_batch_fails_the_send_span(spans):
    destination = unique_destination("trace")
    routes = {destination: {"exchange": f"{destination}-x"}}  # an exchange, no queue bound
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        with transaction.atomic():
            stage("a", {}, destination=destination)
            stage("b", {}, destination=destination)
        with Relay() as relay:
            assert relay.run_once().failed == 2
    (send,) = named(spans, f"send {destination}")
    assert (send.attributes["error.type"], send.status.status_code) == (
        "unroutable",
        StatusCode.ERROR,
    )
    assert send.status.description == "2 of 2 not published"


#: A well-formed W3C trace context, as a request's span would leave in staged rows.
TRACEPARENT = f"00-{'1' * 32}-{'2' * 16}-01"


@pytest.mark.parametrize("headers", ["[1]", '"text"', "null"])
def test_a_row_whose_headers_are_no_object_is_abandoned_alone_with_tracing_on(spans, headers):
    """A row written around stage() (raw SQL here) with headers that are no JSON object:
    the tracing reads every message's headers as a mapping and would stop the relay at
    each claim of it; it is abandoned for good instead, and its neighbour published."""
    destination = unique_destination("trace")
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL}):
        with transaction.atomic():
            bad = stage("bad", {}, destination=destination, headers={"traceparent": TRACEPARENT})
            stage("good", {}, destination=destination, headers={"traceparent": TRACEPARENT})
        OutboxMessage.objects.filter(pk=bad.pk).update(headers=RawSQL(f"'{headers}'::jsonb", []))
        with Relay() as relay:
            stats = relay.run_once()
    assert (stats.published, stats.abandoned) == (1, 1)
    bad.refresh_from_db()
    assert (bad.status, bad.attempts) == (OutboxMessage.Status.ABANDONED, 1)
    assert "headers are not a JSON object" in bad.last_error
    assert len(drain_raw(destination)) == 1
    delete_queue(destination)


def test_celerys_instrumentation_continues_the_stored_trace(spans):
    """The relay sends the task in the row's context: the ``apply_async`` span of
    opentelemetry-instrumentation-celery is its child, and the task carries that span."""
    from celery import Celery
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    queue = unique_destination("celery")
    app = Celery("outbox-tests-tracing", broker=AMQP_URL, set_as_current=True)
    app.conf.task_default_queue = queue
    routes = {"payments": {"celery_task": "testapp.record_payment"}}
    with tracer.start_as_current_span("request") as request_span, transaction.atomic():
        stage("payment.made", {"amount": 1}, destination="payments")
    CeleryInstrumentor().instrument()
    try:
        with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
            with Relay() as relay:
                assert relay.run_once().published == 1
        (message,) = drain_raw(queue)
    finally:
        CeleryInstrumentor().uninstrument()
        delete_queue(queue)
    (apply_async,) = named(spans, "apply_async/testapp.record_payment")
    context = apply_async.context
    assert ids(apply_async.parent) == ids(request_span.get_span_context())
    assert message.headers["traceparent"] == (
        f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
    )


def test_without_opentelemetry_staging_relaying_and_consuming_work_and_import_none_of_it():
    """A meta-path blocker stands for an environment without the otel extra."""
    destination = unique_destination("trace")
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    try:
        done = subprocess.run(
            [sys.executable, "-c", NO_OTEL_SCRIPT, destination, parent],
            cwd=REPO,
            env=relay_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        delete_queue(destination)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "enabled": False,
        "headers": {"traceparent": parent},
        "published": 1,
        "handled": [parent],
        "imported": [],
    }
