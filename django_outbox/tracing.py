"""OpenTelemetry tracing, when ``opentelemetry-api`` is installed (the ``otel`` extra).

The only module that imports OpenTelemetry: without it every function here is a
cheap no-op and nothing of OpenTelemetry is imported. With it:

* staging stores the current span's context in the row's headers as W3C
  ``traceparent`` (and ``tracestate``), unless the caller gave either header
  (:func:`stamp`); the relay sends headers as they are, so the message carries it;
* the relay wraps each destination's batch in a ``send {destination}`` span (kind
  CLIENT) linked to every row's creation context (:func:`sending`), and makes a
  row's creation context current around a Celery ``send_task`` (:func:`continue_trace`);
* the consumer runs each message in a ``process {queue}`` span (kind CONSUMER) whose
  parent is the message's creation context (:func:`processing`).

A ``traceparent`` or ``tracestate`` that is not well-formed W3C text (garbage, too
long, version ``ff``, a NUL) is ignored: no link, a fresh root. See docs/tracing.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
except ImportError:  # the otel extra is not installed: tracing is off
    otel_context = None  # type: ignore[assignment]
    trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Span, SpanContext

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: The longest ``traceparent`` or ``tracestate`` read: W3C asks vendors to propagate a
#: ``tracestate`` of at least 512 characters; a ``traceparent`` of version 00 has 55.
MAX_HEADER_LENGTH = 512
#: A W3C traceparent: version, trace id, parent span id, flags, and what a later version
#: may add after them (version 00 adds nothing).
_TRACEPARENT = re.compile(
    r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[\x21-\x7e]*)?", re.ASCII
)
#: The links a ``send`` span takes at most: the SDK's default ``SpanLimits.max_links``,
#: one per distinct creation context. The SDK would keep the last of them and drop the
#: others; the relay does not build those, and counts them in ``outbox.links_dropped``.
MAX_LINKS = 128
LINKS_DROPPED = "outbox.links_dropped"
#: Printable ASCII, spaces and tabs: the only characters a W3C tracestate holds.
#: One W3C ``tracestate`` member, ``key=value``: a simple or a multi-tenant key, and a
#: value of printable ASCII but "," and "=" that does not end in a space.
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]",
    re.ASCII,
)
#: The most members a ``tracestate`` may have.
MAX_TRACESTATE_MEMBERS = 32
#: ``messaging.system`` of a kombu URL's scheme, where the conventions name the system.
_SYSTEMS = {
    "amqp": "rabbitmq",
    "amqps": "rabbitmq",
    "pyamqp": "rabbitmq",
    "librabbitmq": "rabbitmq",
    "redis": "redis",
    "rediss": "redis",
}
_NO_ATTRIBUTES: dict[str, Any] = {}


class Carrier(Protocol):
    """A staged event: a claimed row or a received message."""

    @property
    def event_id(self) -> object: ...

    @property
    def headers(self) -> Mapping[str, Any]: ...


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """The W3C ``traceparent`` (version 00) of a span context."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def parse_traceparent(value: object) -> tuple[int, int, int] | None:
    """``(trace id, span id, flags)`` of a well-formed W3C ``traceparent``; None for
    anything else: not a string, too long, version ``ff``, a version 00 with more
    fields, an all-zero id, any other character."""
    fields = _traceparent_fields(value)
    if fields is None:
        return None
    trace_id, span_id, flags = fields
    return int(trace_id, 16), int(span_id, 16), int(flags, 16)


def _traceparent_fields(value: object) -> tuple[str, str, str] | None:
    """The trace id, span id and flags (hex) of a well-formed ``traceparent``
    (:func:`parse_traceparent`), read without turning them into numbers."""
    if not isinstance(value, str) or len(value) > MAX_HEADER_LENGTH:
        return None
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if not trace_id.strip("0") or not span_id.strip("0"):  # an all-zero id
        return None
    return trace_id, span_id, flags


def valid_tracestate(value: object) -> str | None:
    """``value`` if it is a W3C ``tracestate`` of at most :data:`MAX_HEADER_LENGTH`
    characters: up to 32 well-formed members with distinct keys. Anything else is
    dropped whole here, before OpenTelemetry would log a warning quoting it."""
    if not isinstance(value, str) or len(value) > MAX_HEADER_LENGTH:
        return None
    members = [member.strip(" \t") for member in value.split(",")]
    members = [member for member in members if member]
    keys = {member.partition("=")[0] for member in members}
    well_formed = all(_TRACESTATE_MEMBER.fullmatch(member) for member in members)
    if not well_formed or len(keys) != len(members) or len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    return value


def stamp(headers: dict[str, Any]) -> dict[str, Any]:
    """Add the current span's context to ``headers`` (a staged event's), unless there
    is no valid one or the caller set ``traceparent`` or ``tracestate`` (theirs stay)."""
    if trace is None or TRACEPARENT in headers or TRACESTATE in headers:
        return headers
    current = trace.get_current_span().get_span_context()
    if current.is_valid:
        headers[TRACEPARENT] = format_traceparent(
            current.trace_id, current.span_id, current.trace_flags
        )
        if current.trace_state:
            headers[TRACESTATE] = current.trace_state.to_header()
    return headers


def creation_context(headers: Mapping[str, Any] | None) -> SpanContext | None:
    """The span context an event was staged in, read from its headers; None without
    OpenTelemetry or a well-formed ``traceparent``."""
    if trace is None or not headers:
        return None
    return _span_context(headers.get(TRACEPARENT), headers.get(TRACESTATE))


def _span_context(traceparent: object, tracestate: object) -> SpanContext | None:
    fields = _traceparent_fields(traceparent)
    return None if fields is None else _remote_context(fields, tracestate)


def _remote_context(fields: tuple[str, str, str], tracestate: object) -> SpanContext:
    """The remote span context of a ``traceparent``'s fields and a ``tracestate`` (kept
    only if valid)."""
    trace_id, span_id, flags = fields
    state = valid_tracestate(tracestate)
    return trace.SpanContext(
        int(trace_id, 16),
        int(span_id, 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(flags, 16)),
        trace_state=trace.TraceState.from_header([state]) if state else None,
    )


def _parent(headers: Mapping[str, Any] | None) -> Context | None:
    creation = creation_context(headers)
    if creation is None:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(creation), otel_context.Context())


@contextlib.contextmanager
def continue_trace(headers: Mapping[str, Any] | None) -> Iterator[bool]:
    """Make the creation context in an event's ``headers`` (an
    :class:`~django_outbox.envelope.ReceivedEvent`'s, a task's) the current context
    in the block, so that the spans started in it join the event's trace. Yields
    whether it did: False without OpenTelemetry or a well-formed ``traceparent``,
    and the current context is left as it is."""
    parent = _parent(headers)
    if parent is None:
        yield False
        return
    token = otel_context.attach(parent)
    try:
        yield True
    finally:
        otel_context.detach(token)


def broker_attributes(url: str) -> dict[str, Any]:
    """``messaging.system`` and, for a single-host URL, ``server.address`` and
    ``server.port`` of a kombu broker URL (never its user name or password)."""
    scheme, _, rest = url.partition("://")
    attributes: dict[str, Any] = {"messaging.system": _SYSTEMS.get(scheme, scheme)}
    if ";" in rest or not rest:  # a failover list: the host in use varies
        return attributes
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return attributes
    if host:
        attributes["server.address"] = host
    if port:
        attributes["server.port"] = port
    return attributes


class SendSpan:
    """What :func:`sending` yields: the relay reports a batch's failures to it."""

    __slots__ = ("span",)

    def __init__(self, span: Span | None) -> None:
        self.span = span

    def failed(self, error_type: str, description: str) -> None:
        """Mark the span failed: ``error.type`` and status ERROR."""
        if self.span is not None and self.span.is_recording():
            _fail(self.span, error_type, description)


_NOT_SENDING = SendSpan(None)


def sending(
    destination: str, attributes: Mapping[str, Any], messages: Sequence[Carrier]
) -> contextlib.AbstractContextManager[SendSpan]:
    """The relay's ``send {destination}`` span (kind CLIENT) around the publish of
    ``messages``, current in the block, linked to their creation contexts;
    ``attributes`` are the broker's (:func:`broker_attributes`)."""
    if trace is None:
        return contextlib.nullcontext(_NOT_SENDING)
    return _sending(destination, attributes, messages)


@contextlib.contextmanager
def _sending(
    destination: str, attributes: Mapping[str, Any], messages: Sequence[Carrier]
) -> Iterator[SendSpan]:
    span_attributes = _operation("send", destination, attributes)
    if len(messages) == 1:
        span_attributes["messaging.message.id"] = str(messages[0].event_id)
    else:
        span_attributes["messaging.batch.message_count"] = len(messages)
    span = _tracer().start_span(
        f"send {destination}", kind=trace.SpanKind.CLIENT, attributes=span_attributes
    )
    if span.is_recording():  # no per-row work when nothing records the span
        _link(span, messages)
    with _current(span):
        yield SendSpan(span)


@contextlib.contextmanager
def _current(span: Span) -> Iterator[None]:
    """``span`` current inside, ended on the way out. Ending runs the project's span
    processors: one that raises must not turn a publish the broker confirmed (or a
    handler that committed) into a failure, so its error is logged, not raised."""
    try:
        with trace.use_span(
            span, end_on_exit=False, record_exception=False, set_status_on_exception=False
        ):
            yield
    finally:
        try:
            span.end()
        except Exception:
            name = getattr(span, "name", "?")  # a recording span has one
            logger.exception(
                "ending the span %r failed", name, extra={"action": "outbox.span_failed"}
            )


def _link(span: Span, messages: Sequence[Carrier]) -> None:
    """Link ``span`` once to each distinct creation context of ``messages``, up to
    :data:`MAX_LINKS` (those seen last: the ones the SDK would keep); the number of
    the others is the span's ``outbox.links_dropped``."""
    contexts, left_out = _creation_contexts(messages)
    for creation in contexts:
        span.add_link(creation)
    if left_out:
        span.set_attribute(LINKS_DROPPED, left_out)


def _creation_contexts(messages: Sequence[Carrier]) -> tuple[list[SpanContext], int]:
    """The distinct creation contexts (spans) of ``messages``, the last :data:`MAX_LINKS`
    of them in order, and how many others there are. Walked from the last message: a
    ``traceparent`` seen before is skipped at once (the events staged in one request
    share theirs), and the contexts left out are checked but never built."""
    kept: list[SpanContext] = []
    spans: set[tuple[str, str]] = set()
    seen: set[str] = set()
    left_out = 0
    for message in reversed(messages):
        headers = message.headers or _NO_ATTRIBUTES
        traceparent = headers.get(TRACEPARENT)
        if not isinstance(traceparent, str) or traceparent in seen:
            continue  # no link (and a JSON list or object is no key), or linked already
        seen.add(traceparent)
        fields = _traceparent_fields(traceparent)
        if fields is None or fields[:2] in spans:
            continue
        spans.add(fields[:2])
        if len(kept) < MAX_LINKS:
            kept.append(_remote_context(fields, headers.get(TRACESTATE)))
        else:
            left_out += 1
    kept.reverse()
    return kept, left_out


def processing(
    queue: str, event: Carrier, attributes: Mapping[str, Any] = _NO_ATTRIBUTES
) -> contextlib.AbstractContextManager[object]:
    """The consumer's ``process {queue}`` span (kind CONSUMER) around the handling of
    ``event``, current in the block, whose parent is the event's creation context (a
    new trace when it has none). An exception leaving the block sets ``error.type``
    to its class name and the status to ERROR (its text is not recorded: it could
    hold data or a password)."""
    if trace is None:
        return contextlib.nullcontext()
    return _processing(queue, event, attributes)


@contextlib.contextmanager
def _processing(queue: str, event: Carrier, attributes: Mapping[str, Any]) -> Iterator[object]:
    span_attributes = _operation("process", queue, attributes)
    span_attributes["messaging.message.id"] = str(event.event_id)
    span = _tracer().start_span(
        f"process {queue}",
        context=_parent(event.headers) or otel_context.Context(),
        kind=trace.SpanKind.CONSUMER,
        attributes=span_attributes,
    )
    with _current(span):
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                _fail(span, type(exc).__qualname__, f"{type(exc).__qualname__} raised")
            raise


def _operation(name: str, destination: str, attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **attributes,
        "messaging.operation.name": name,
        "messaging.operation.type": name,
        "messaging.destination.name": destination,
    }


def _fail(span: Span, error_type: str, description: str) -> None:
    span.set_attribute("error.type", error_type)
    span.set_status(trace.Status(trace.StatusCode.ERROR, description))


@functools.cache
def _tracer() -> trace.Tracer:
    # The global provider's tracer: a proxy until an SDK's provider is set, then its.
    return trace.get_tracer("django_outbox")
