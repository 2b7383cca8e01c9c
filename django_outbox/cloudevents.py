"""CloudEvents 1.0 on the wire: an outbox event as a CloudEvent, and back.

A route with ``"envelope": "cloudevents"`` (or ``OUTBOX["DEFAULT_ENVELOPE"]``) has its
events published as CloudEvents (https://github.com/cloudevents/spec, version 1.0.2). The
attributes come from the event's wire headers (:meth:`ClaimedMessage.wire_headers`):

==================  =====================================================================
attribute           from
==================  =====================================================================
``id``              the event id (``event_id``)
``type``            the event type (``event_type``)
``source``          ``OUTBOX["CLOUDEVENTS_SOURCE"]``
``specversion``     ``1.0``
``time``            when it was staged (``occurred_at``, RFC 3339)
``subject``         the ordering key (``ordering_key``); absent without one
``datacontenttype`` ``application/json``
extensions          :data:`EXTENSIONS`: correlation and causation ids, an ordered route's
                    sequence and destination, a skip marker, and the W3C trace context
                    (the Distributed Tracing extension's ``traceparent``/``tracestate``)
==================  =====================================================================

The data is the payload's JSON text, as stored. Every other header (the user's own, the
relay's ``outbox_signature``) travels as a plain message header beside the CloudEvent:
its name need not follow CloudEvents' rules for extension names.

**Binary content mode** (:func:`binary`), RabbitMQ's: the attributes are ``ce-``
headers, each value a string, ``datacontenttype`` the message's content type, and the
body the payload. **Structured mode** (:func:`structured`), on Redis, or where a route
asks for it (``"cloudevents-structured"``): the body is the event as a JSON object
(``application/cloudevents+json``), its ``data`` member first and written as the
payload's own text, so that a signature over the payload (:mod:`django_outbox.signing`)
still covers the same bytes.

:func:`received` reads a CloudEvent in either mode back into the same
:class:`~django_outbox.envelope.ReceivedEvent` as the outbox's own envelope gives,
headers and all; what it cannot read is :class:`~django_outbox.exceptions.InvalidMessage`.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping
from typing import Any

from .envelope import CONTENT_ENCODING, CONTENT_TYPE, ClaimedMessage, ReceivedEvent
from .exceptions import InvalidMessage

SPECVERSION = "1.0"
#: The content type of structured mode with the JSON event format.
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
#: The prefix of an attribute's header in binary mode (RabbitMQ's binding).
BINARY_PREFIX = "ce-"
SPECVERSION_HEADER = BINARY_PREFIX + "specversion"
#: The envelopes of ``routes.ENVELOPES``.
OUTBOX, BINARY, STRUCTURED = "outbox", "cloudevents", "cloudevents-structured"

#: The outbox headers that are CloudEvents attributes: header -> attribute.
ATTRIBUTES = {
    "event_id": "id",
    "event_type": "type",
    "occurred_at": "time",
    "ordering_key": "subject",
}
#: The outbox headers carried as extension attributes: header -> extension. Names are
#: lowercase letters and digits, 20 at most (the specification's naming rules).
EXTENSIONS = {
    "correlation_id": "correlationid",
    "causation_id": "causationid",
    "sequence": "sequence",
    "destination": "outboxdestination",
    "skipped": "outboxskipped",
    "traceparent": "traceparent",
    "tracestate": "tracestate",
}
_HEADERS = {**ATTRIBUTES, **EXTENSIONS}
_NAMES = {attribute: header for header, attribute in _HEADERS.items()}
#: The attributes a CloudEvent must have (besides ``specversion``).
REQUIRED = ("id", "source", "type")
#: The prefix of a relay's structured body: its ``data`` member comes first.
DATA_FIRST = '{"data": '


@dataclasses.dataclass(frozen=True, slots=True)
class Wire:
    """A message as it goes to the broker: body, headers and content type."""

    body: bytes
    headers: dict[str, Any]
    content_type: str = CONTENT_TYPE


def split(
    message: ClaimedMessage, source: str, keyed: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The CloudEvents attributes of ``message`` (by their names), and the headers that
    travel beside them (the user's own, the signature; ``keyed``, the ordering key as
    the ``ordering_key`` header too, which a partitioned route's exchange hashes)."""
    attributes: dict[str, Any] = {"specversion": SPECVERSION, "source": source}
    plain: dict[str, Any] = {}
    for header, value in message.wire_headers().items():
        name = _HEADERS.get(header)
        if name is None:
            plain[header] = value
        elif value is not None and value != "":
            attributes[name] = value
    attributes["datacontenttype"] = CONTENT_TYPE
    if keyed:
        plain["ordering_key"] = message.ordering_key
    return attributes, plain


def binary(message: ClaimedMessage, source: str, keyed: bool = False) -> Wire:
    """``message`` in binary content mode: the attributes as ``ce-`` headers (strings,
    ``datacontenttype`` aside: it is the content type), after the plain headers."""
    attributes, headers = split(message, source, keyed)
    del attributes["datacontenttype"]
    for name, value in attributes.items():
        headers[BINARY_PREFIX + name] = _text(value)
    return Wire(message.body, headers)


def structured(message: ClaimedMessage, source: str, keyed: bool = False) -> Wire:
    """``message`` in structured mode: the event as one JSON object, ``data`` first
    (the payload's text as stored), with the plain headers beside it."""
    attributes, headers = split(message, source, keyed)
    rest = json.dumps(attributes)[1:]  # the cached encoder: non-ASCII as \u escapes
    body = f"{DATA_FIRST}{message.wire_payload}, {rest}".encode(CONTENT_ENCODING)
    return Wire(body, headers, STRUCTURED_CONTENT_TYPE)


def wire(message: ClaimedMessage, envelope: str, source: str, keyed: bool = False) -> Wire:
    """``message`` in ``envelope`` (one of ``routes.ENVELOPES``); ``keyed`` (a partitioned
    route's), with the ``ordering_key`` header beside a CloudEvent's attributes."""
    if envelope == BINARY:
        return binary(message, source, keyed)
    if envelope == STRUCTURED:
        return structured(message, source, keyed)
    return Wire(message.body, message.wire_headers())


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- reading ---------------------------------------------------------------------------


def is_cloudevent(content_type: str | None, headers: Mapping[str, Any] | None) -> bool:
    """Whether a message of ``content_type`` with ``headers`` is a CloudEvent: structured
    (its content type ``application/cloudevents...``) or binary (a ``ce-specversion``
    header, which every binary-mode CloudEvent has: another ``ce-`` header alone may be
    a user's header on an outbox envelope)."""
    if _is_structured(content_type):
        return True
    return any(str(name).lower() == SPECVERSION_HEADER for name in headers or ())


def is_attribute_header(name: str) -> bool:
    """Whether ``name`` is the header of a CloudEvents attribute in binary mode (``ce-``,
    in any case, as the SDK reads it): no user header takes one, since a consumer would
    read it as the event's attribute (``ce-specversion`` makes the message a CloudEvent)."""
    return name.lower().startswith(BINARY_PREFIX)


def _is_structured(content_type: str | None) -> bool:
    return (content_type or "").lower().startswith("application/cloudevents")


def received(
    content_type: str | None, headers: Mapping[str, Any] | None, body: str, max_bytes: int
) -> tuple[ReceivedEvent, str]:
    """The event in a CloudEvent message (:func:`is_cloudevent`) and its payload's JSON
    text (a structured body's ``data`` member as it came, when the relay wrote it).
    ``max_bytes`` bounds a structured body: twice the payload the relays may stage.
    :class:`InvalidMessage` says, in one line, what is wrong with it."""
    attributes, plain = _binary(headers or {})
    if _is_structured(content_type):
        attributes, text = _structured(content_type, body, max_bytes)
    else:
        text = body
        if not _json_type(content_type):
            raise InvalidMessage(
                f"the CloudEvent's datacontenttype {content_type!r} is not {CONTENT_TYPE}: "
                "run_outbox_consumer takes JSON data only"
            )
        if content_type is not None:
            attributes["datacontenttype"] = content_type
    payload = _loads(text, "the CloudEvent's data")
    return _event(attributes, plain, payload), text


def _binary(headers: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The attributes in ``ce-`` headers (by their names), and the other headers."""
    attributes: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    for name, value in headers.items():
        lowered = str(name).lower()
        if lowered.startswith(BINARY_PREFIX):
            attributes[lowered[len(BINARY_PREFIX) :]] = value
        else:
            plain[name] = value
    return attributes, plain


def _structured(content_type: str | None, body: str, max_bytes: int) -> tuple[dict[str, Any], str]:
    """The attributes in a structured ``body`` (a ``ce-`` header beside it is ignored,
    as the SDK ignores it), and its data's JSON text."""
    if not (content_type or "").lower().startswith(STRUCTURED_CONTENT_TYPE):
        raise InvalidMessage(
            f"content type {content_type!r} is a CloudEvents format other than JSON "
            f"({STRUCTURED_CONTENT_TYPE})"
        )
    size = len(body.encode(CONTENT_ENCODING, "surrogatepass"))
    if size > max_bytes:
        raise InvalidMessage(
            f"the CloudEvent's structured body is {size} bytes, over {max_bytes} (twice "
            "OUTBOX['MAX_PAYLOAD_BYTES']): no relay sends one this large"
        )
    document = _loads(body, "the CloudEvent's structured body")
    if not isinstance(document, dict):
        raise InvalidMessage("the CloudEvent's structured body is not a JSON object")
    if "data_base64" in document:
        raise InvalidMessage(
            "the CloudEvent carries data_base64 (binary data): run_outbox_consumer takes "
            "JSON data only"
        )
    kind = document.get("datacontenttype")
    if not _json_type(kind):
        raise InvalidMessage(
            f"the CloudEvent's datacontenttype {kind!r} is not {CONTENT_TYPE}: "
            "run_outbox_consumer takes JSON data only"
        )
    data = document.pop("data", None)
    return document, _data_text(body, data)


def _json_type(content_type: object) -> bool:
    """Whether data of ``content_type`` is JSON: ``application/json`` (parameters aside),
    or none (JSON, by the JSON event format's rule; no type at all in binary mode)."""
    if content_type is None:
        return True
    return isinstance(content_type, str) and (
        content_type.partition(";")[0].strip().lower() == CONTENT_TYPE
    )


def _data_text(body: str, data: Any) -> str:
    """The text of a structured body's ``data``: as it came when it is the body's first
    member (a relay's: its signature covers these bytes), else ``data`` as JSON."""
    if body.startswith(DATA_FIRST):
        try:
            _, end = json.JSONDecoder().raw_decode(body, len(DATA_FIRST))
        except ValueError:  # (the body decoded as a whole: cannot happen)
            pass
        else:
            return body[len(DATA_FIRST) : end]
    return json.dumps(data)


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise InvalidMessage(f"{what} is not JSON text: {exc}") from None


def _event(attributes: dict[str, Any], plain: dict[str, Any], payload: Any) -> ReceivedEvent:
    """The event of a CloudEvent's ``attributes`` (by their names; ``data`` apart) and
    the ``plain`` headers beside them."""
    version = attributes.get("specversion")
    if version != SPECVERSION:
        raise InvalidMessage(
            f"the CloudEvent's specversion is {version!r}, not {SPECVERSION!r}"
            if version is not None
            else "the CloudEvent has no specversion"
        )
    missing = [name for name in REQUIRED if not isinstance(attributes.get(name), str)]
    if missing or not all(attributes[name] for name in REQUIRED):
        raise InvalidMessage(
            f"the CloudEvent has no {', '.join(missing) or 'non-empty id, source and type'} "
            "(required attributes, each a non-empty string)"
        )
    headers = dict(plain)
    for name, value in attributes.items():
        header = _NAMES.get(name)
        if header is not None:
            headers[header] = _typed(header, value)
    headers["event_id"] = str(event_id(attributes["source"], attributes["id"]))
    headers.setdefault("correlation_id", None)
    headers.setdefault("causation_id", None)
    headers.setdefault("ordering_key", None)
    kept = {name: value for name, value in attributes.items() if name == "id" or name not in _NAMES}
    return ReceivedEvent.from_wire(payload, headers, cloudevent=kept)


def _typed(header: str, value: Any) -> Any:
    """A binary header's text as the outbox header's type: a sequence's number, a skip
    marker's flag (a structured body has them typed already)."""
    if header == "sequence" and isinstance(value, str) and value.isdigit() and value.isascii():
        return int(value)
    if header == "skipped" and isinstance(value, str):
        return value == "true"
    return value


#: The namespace of the event ids made for CloudEvents whose id is not a UUID.
ID_NAMESPACE = uuid.UUID("4a7d2f3e-1c0b-5e8a-9f6d-2b3c4d5e6f70")


def event_id(source: str, id: str) -> uuid.UUID:
    """The event id of the CloudEvent ``id`` from ``source``: the id itself when it is a
    UUID, else a UUID of both (version 5), as source and id together are unique."""
    try:
        return uuid.UUID(id)
    except ValueError:
        return uuid.uuid5(ID_NAMESPACE, f"{source}\x00{id}")
