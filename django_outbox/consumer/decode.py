"""What a consumed message says: the one place a broker's message becomes an event.

* ``application/json`` only (a pickled message is refused, never unpickled, and
  kombu's raw ``application/data`` and text types are refused too), in the outbox's
  envelope or as a CloudEvent (binary or structured: :mod:`~django_outbox.cloudevents`);
  a message of
  another content type, a body that does not decode or one that carries no event id
  is not an outbox event (:class:`~django_outbox.exceptions.InvalidMessage`);
* a message with a ``compression`` header is refused as kombu builds it, without
  inflating its body (:func:`uninflated`);
* with signatures verified, :func:`signature_problem` says why a message is not
  signed by one of the keys.
"""

from __future__ import annotations

import functools
import json
import reprlib
import uuid
from typing import Any, cast

import kombu
import kombu.transport.virtual

from .. import cloudevents
from ..conf import outbox_settings
from ..conf.redact import describe
from ..envelope import COMPRESSION_HEADER, CONTENT_ENCODING, CONTENT_TYPE, ReceivedEvent
from ..exceptions import InvalidMessage
from ..signing import SIGNATURE_HEADER, Keyring


def decode(message: Any) -> ReceivedEvent:
    """The event in ``message``, in the outbox's envelope or a CloudEvent (binary or
    structured: :mod:`~django_outbox.cloudevents`); :class:`InvalidMessage` if it is
    neither."""
    if cloudevents.is_cloudevent(message.content_type, message.headers):
        limit = 2 * outbox_settings.MAX_PAYLOAD_BYTES
        event, payload = cloudevents.received(
            message.content_type, message.headers, _body_text(message), limit
        )
        message.outbox_payload = payload  # what text() gives from now on: the payload
        return event
    if message.content_type != CONTENT_TYPE:
        raise InvalidMessage(
            f"content type {message.content_type!r} is not {CONTENT_TYPE}: "
            "it was not published by an outbox relay"
        )
    return ReceivedEvent.from_wire(
        _json_body(message), message.headers, message.properties.get("message_id")
    )


def signature_problem(keys: Keyring, message: Any, event: ReceivedEvent) -> str | None:
    """Why ``message`` is not signed by one of ``keys`` (None: it is)."""
    # surrogatepass: a codec such as unicode_escape can decode a body to text
    # UTF-8 cannot hold; its signature fails instead of the encoding.
    body = text(message).encode(CONTENT_ENCODING, "surrogatepass")
    return keys.problem(event.headers.get(SIGNATURE_HEADER), event.envelope(body))


def _json_body(message: Any) -> Any:
    """The body as plain JSON, exactly as the relay sent it. Not ``message.decode()``:
    kombu's JSON decoder turns an object with a ``__type__`` key into a datetime,
    Decimal or UUID, so a payload holding one would reach the handler changed."""
    body = _body_text(message)
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deeply
        raise InvalidMessage(NOT_JSON % exc) from None


#: Why a message's body is refused: its content encoding cannot decode it, or it is not JSON.
NOT_JSON = "the body is not JSON text: %s"


def _body_text(message: Any) -> str:
    """:func:`text`, or :class:`InvalidMessage` when the body does not decode by its
    content encoding (kombu's ``binary``, of bytes published without one, is none)."""
    try:
        return text(message)
    except (ValueError, LookupError) as exc:  # LookupError: an unknown content encoding
        raise InvalidMessage(NOT_JSON % exc) from None


def text(message: Any) -> str:
    """The body as text, read by its content encoding (py-amqp hands it over decoded
    already, kombu's virtual transports as bytes); of a CloudEvent, its payload's JSON
    text (what a signature covers, and what a parked message keeps to be replayed in
    the outbox's envelope)."""
    payload = getattr(message, "outbox_payload", None)
    if payload is not None:
        return payload
    body = message.body
    return body if isinstance(body, str) else body.decode(message.content_encoding or "utf-8")


def message_key(message: Any) -> Any:
    """What tells a message's deliveries apart from others': its message id (the relay
    makes it the event id), else its ``event_id`` header."""
    return message.properties.get("message_id") or (message.headers or {}).get("event_id")


@functools.cache
def uninflated(message_class: type[kombu.Message]) -> type[kombu.Message]:
    """``message_class`` (a kombu transport's message), except that one whose headers ask
    for decompression is not inflated but refused as it is built, before the consumer
    sees it, through kombu's decode errors (the consumer's ``on_decode_error``).

    kombu inflates the body of any message with a ``compression`` header while it builds
    the message, before any callback and without a bound: 185 bytes of bzip2 become 200
    MB. The relay never compresses, and ``stage()`` refuses the header, so only a message
    from someone else has one. The headers are set just after ``errors`` and just before
    kombu reads ``compression``: recording an error there skips the inflating."""

    virtual = issubclass(message_class, kombu.transport.virtual.Message)

    class Uninflated(message_class):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                super().__init__(*args, **kwargs)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                if not virtual:
                    raise  # py-amqp's frames have their types: kombu's own error
                payload = kwargs.get("payload", args[0] if args else None)
                channel = kwargs.get("channel", args[1] if len(args) > 1 else None)
                _refused_shape(self, payload, channel, exc)

        @property
        def headers(self) -> dict[str, Any]:
            return self._outbox_headers

        @headers.setter
        def headers(self, value: dict[str, Any]) -> None:
            self._outbox_headers = value
            compression = value.get(COMPRESSION_HEADER) if value else None
            if compression and not self.errors:
                refused = InvalidMessage(
                    f"the message has a {COMPRESSION_HEADER} header "
                    f"({reprlib.repr(compression)}), and an outbox relay never compresses: "
                    "its body is not inflated"
                )
                self.errors.append((InvalidMessage, refused, None))

    Uninflated.__name__ = Uninflated.__qualname__ = f"Uninflated{message_class.__name__}"
    return Uninflated


def _refused_shape(message: kombu.Message, payload: Any, channel: Any, exc: Exception) -> None:
    """Make ``message`` the refusal of a virtual transport's ``payload`` whose JSON kombu
    cannot read as a message (headers that are a list, properties that are text, a
    number for a body: anyone who can push to a Redis list writes all of it): empty,
    with :class:`InvalidMessage` in its decode errors, so that the consumer rejects it
    (and the transport forgets it) instead of stopping on kombu's error."""
    properties = payload.get("properties") if isinstance(payload, dict) else None
    properties = properties if isinstance(properties, dict) else {}
    tag, info = properties.get("delivery_tag"), properties.get("delivery_info")
    if not (isinstance(info, dict) and {"exchange", "routing_key"} <= info.keys()):
        info = {"exchange": "", "routing_key": ""}
    kombu.Message.__init__(
        message,
        body=b"",
        channel=channel,
        delivery_tag=tag if isinstance(tag, str) and tag else str(uuid.uuid4()),
        delivery_info=info,
        properties=properties,
    )
    refused = InvalidMessage(
        f"kombu cannot read it as a message ({describe(exc)}): "
        "it was not published by an outbox relay"
    )
    errors = cast("list[Any]", message.errors)  # a list once kombu's __init__ ran
    errors[:] = [(InvalidMessage, refused, None)]
