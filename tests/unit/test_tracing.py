"""django_outbox.tracing without services: the W3C text it writes and reads, what it
takes from a span context, and what it refuses (the hostile headers of a row or a message)."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from django_outbox import tracing
from django_outbox.envelope import ReceivedEvent

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def in_span(trace_state: TraceState | None = None) -> NonRecordingSpan:
    """A span whose context is TRACEPARENT's (no SDK needed to make it current)."""
    return NonRecordingSpan(
        SpanContext(TRACE_ID, SPAN_ID, False, TraceFlags(1), trace_state=trace_state)
    )


def test_a_traceparent_is_written_and_read_back():
    assert tracing.format_traceparent(TRACE_ID, SPAN_ID, 1) == TRACEPARENT
    assert tracing.parse_traceparent(TRACEPARENT) == (TRACE_ID, SPAN_ID, 1)


def test_a_later_version_may_add_fields_after_the_four():
    later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-what-comes"
    assert tracing.parse_traceparent(later) == (TRACE_ID, SPAN_ID, 0)


HOSTILE_TRACEPARENTS = {
    "garbage": "not a traceparent",
    "too long": "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-" + "x" * 500,
    "version ff": "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "version 00 with more": TRACEPARENT + "-extra",
    "NUL": TRACEPARENT[:20] + "\x00" + TRACEPARENT[21:],
    "trailing NUL": TRACEPARENT + "\x00",
    "upper case": TRACEPARENT.upper(),
    "zero trace id": "00-" + "0" * 32 + "-00f067aa0ba902b7-01",
    "zero span id": "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    "surrounding spaces": f" {TRACEPARENT} ",
    "a number": 42,
    "a list": [TRACEPARENT],
    "a dict": {"traceparent": TRACEPARENT},
    "null": None,
}


@pytest.mark.parametrize("value", HOSTILE_TRACEPARENTS.values(), ids=HOSTILE_TRACEPARENTS)
def test_a_malformed_traceparent_is_ignored(value):
    headers = {"traceparent": value, "tracestate": "a=b"}
    assert tracing.parse_traceparent(value) is None
    assert tracing.creation_context(headers) is None
    with tracing.continue_trace(headers) as continued:
        assert (continued, trace.get_current_span()) == (False, trace.INVALID_SPAN)


@pytest.mark.parametrize(
    "value",
    [
        "x" * 513,
        "a=b\x00",
        "a=é",
        7,
        ["a=b"],
        "Upper=1",
        "a=1,a=2",
        "a=",
        "=b",
        "a=b=c",
        ",".join(f"k{n}=v" for n in range(33)),
    ],
    ids=[
        "long",
        "NUL",
        "non-ASCII",
        "int",
        "list",
        "uppercase key",
        "duplicate key",
        "empty value",
        "no key",
        "= in value",
        "33 members",
    ],
)
def test_a_malformed_tracestate_is_dropped_and_the_traceparent_kept(value, caplog):
    assert tracing.valid_tracestate(value) is None
    context = tracing.creation_context({"traceparent": TRACEPARENT, "tracestate": value})
    assert context is not None
    assert (context.trace_id, context.span_id, len(context.trace_state)) == (TRACE_ID, SPAN_ID, 0)
    assert caplog.records == []  # nothing of a hostile value reaches a log


def test_a_well_formed_tracestate_with_tenants_and_spaces_is_kept():
    value = "congo=t61rcWkgMzE, rojo=00f067aa0ba902b7,tenant@vendor=x/y*z"
    assert tracing.valid_tracestate(value) == value


def test_the_creation_context_is_remote_with_its_flags_and_state():
    context = tracing.creation_context({"traceparent": TRACEPARENT, "tracestate": "v=1,w=2"})
    assert context == SpanContext(
        TRACE_ID, SPAN_ID, True, TraceFlags(1), TraceState([("v", "1"), ("w", "2")])
    )


def test_stamp_adds_the_current_span_context():
    with trace.use_span(in_span(TraceState([("v", "1")]))):
        assert tracing.stamp({"a": 1}) == {"a": 1, "traceparent": TRACEPARENT, "tracestate": "v=1"}


def test_stamp_adds_no_empty_tracestate():
    with trace.use_span(in_span()):
        assert tracing.stamp({}) == {"traceparent": TRACEPARENT}


def test_stamp_adds_nothing_without_a_current_span():
    assert tracing.stamp({"a": 1}) == {"a": 1}


@pytest.mark.parametrize("given", [{"traceparent": "mine"}, {"tracestate": "mine=1"}])
def test_stamp_keeps_a_callers_own_trace_headers(given):
    with trace.use_span(in_span()):
        assert tracing.stamp(dict(given)) == given


def test_continue_trace_makes_the_creation_context_current_in_the_block():
    event = ReceivedEvent(uuid.uuid4(), "t", {}, {"traceparent": TRACEPARENT})
    with tracing.continue_trace(event.headers) as continued:
        current = trace.get_current_span().get_span_context()
        assert (continued, current.trace_id, current.span_id) == (True, TRACE_ID, SPAN_ID)
    assert trace.get_current_span() is trace.INVALID_SPAN


@pytest.mark.parametrize(
    ("url", "attributes"),
    [
        (
            "amqp://user:s3cret@rabbit.example:5671//",
            {
                "messaging.system": "rabbitmq",
                "server.address": "rabbit.example",
                "server.port": 5671,
            },
        ),
        (
            "rediss://:s3cret@cache.example/0",
            {"messaging.system": "redis", "server.address": "cache.example"},
        ),
        ("amqp://a:1//;amqp://b:2//", {"messaging.system": "rabbitmq"}),
        ("filesystem://", {"messaging.system": "filesystem"}),
        ("sqs://key:s3cret@", {"messaging.system": "sqs"}),
    ],
)
def test_broker_attributes_name_the_system_and_server_never_the_credentials(url, attributes):
    assert tracing.broker_attributes(url) == attributes


class Unreadable:
    """A claimed row whose headers may not be read."""

    event_id = uuid.UUID(int=1)

    @property
    def headers(self):
        raise AssertionError("a row's headers were read for a span that records nothing")


def test_a_send_span_that_records_nothing_reads_no_row(monkeypatch):
    """A batch its sampler drops (here an SDK whose sampler drops every span): the span
    records nothing, so no row's headers are read for links no one would keep."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    tracer = TracerProvider(sampler=ALWAYS_OFF).get_tracer("test")
    monkeypatch.setattr(tracing, "_tracer", lambda: tracer)
    with tracing.sending("orders", {}, [Unreadable(), Unreadable()]) as span:
        assert span.span is not None and not span.span.is_recording()


class Message:
    def __init__(self, headers: dict[str, object]) -> None:
        self.event_id = uuid.uuid4()
        self.headers = headers


def test_a_send_span_links_each_span_once_and_counts_only_valid_ones_left_out(monkeypatch):
    """Two traceparents that differ in their flags name one span: one link. Past the
    limit, the contexts left out are counted, a malformed traceparent never."""
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    monkeypatch.setattr(tracing, "_tracer", lambda: tracer)
    distinct = [tracing.format_traceparent(n, n, 1) for n in range(1, tracing.MAX_LINKS + 4)]
    messages = [Message({"traceparent": value}) for value in HOSTILE_TRACEPARENTS.values()]
    messages += [Message({"traceparent": value}) for value in distinct]
    messages.append(Message({"traceparent": distinct[-1][:-2] + "00"}))  # the last span again
    with tracing.sending("orders", {}, messages) as span:
        pass
    linked = [(link.context.trace_id, link.context.span_id) for link in span.span.links]
    assert linked == [(n, n) for n in range(4, tracing.MAX_LINKS + 4)]
    assert span.span.attributes[tracing.LINKS_DROPPED] == 3
