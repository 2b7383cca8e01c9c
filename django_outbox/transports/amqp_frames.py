"""The AMQP 0-9-1 frames of a batch of ``basic.publish``, built in one buffer.

py-amqp builds each message through its generic encoders (a method frame, a
content header frame, body frames) and writes it with a ``sendall`` of its own.
A relay's batch to one destination repeats most of that work: the exchange, the
routing key, the content type and encoding, the delivery mode and the header
names are the same for every message. :class:`PublishFrames` encodes those once
and each message's own parts (its header values, message id and body) with a few
bytes operations, so the transport can hand the socket a batch in a few writes.

The bytes are the ones kombu's ``Producer.publish`` has py-amqp write for the same
message (kombu's producer always sets a priority, 0 by default): the tests compare
them with py-amqp's own encoders, and with what kombu's producer writes to a real
connection's socket. A header value of a type this module
does not encode itself (a float, a map, a list, a large int ...) goes through
py-amqp's table encoder, so it is encoded, or refused with py-amqp's error, as
before.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

from amqp.serialization import dumps  # type: ignore[import-untyped]

#: Every frame ends with this octet.
FRAME_END = b"\xce"
METHOD_FRAME, HEADER_FRAME, BODY_FRAME = 1, 2, 3
#: The frame type, channel and payload size before a payload; FRAME_END after it.
FRAME_OVERHEAD = 8
BASIC_CLASS = 60
BASIC_PUBLISH = 40
#: The properties a relay's message carries: content type and encoding, headers,
#: delivery mode, priority and message id (bits 15, 14, 13, 12, 11 and 7 of AMQP's
#: property flags), as kombu's producer writes them.
PROPERTY_FLAGS = 0x8000 | 0x4000 | 0x2000 | 0x1000 | 0x0800 | 0x0080
#: Delivery mode 2 (persistent), then priority 0 (kombu's producer's default).
PERSISTENT_PRIORITY_0 = b"\x02\x00"
#: A content header frame's payload before its property list: class, weight, body size
#: and property flags.
CONTENT_HEAD_SIZE = 14
#: The ints py-amqp writes as a 32-bit ``I`` (beyond them a 64-bit ``L``).
INT32_LIMIT = 2147483647
#: Header names whose encoded bytes are kept (the standard ones and a user's few).
MAX_CACHED_NAMES = 1024

_frame_head = struct.Struct(">BHI").pack
#: A content header frame up to its property list: frame head, class, weight, body
#: size, property flags.
_content_head = struct.Struct(">BHIHHQH").pack
_uint32 = struct.Struct(">I").pack
_int32 = struct.Struct(">i").pack
_octet = struct.Struct("B").pack


def shortstr(text: str) -> bytes:
    """AMQP's short string: one length octet, then UTF-8. Over 255 bytes it raises
    py-amqp's ``struct.error``."""
    data = text.encode("utf-8", "surrogatepass")
    return _octet(len(data)) + data


def method_frame(channel_id: int, exchange: str, routing_key: str) -> bytes:
    """The ``basic.publish`` method frame: ``mandatory`` set, ``immediate`` not."""
    arguments = b"".join(
        (
            struct.pack(">HHH", BASIC_CLASS, BASIC_PUBLISH, 0),
            shortstr(exchange),
            shortstr(routing_key),
            b"\x01",
        )
    )
    return _frame_head(METHOD_FRAME, channel_id, len(arguments)) + arguments + FRAME_END


class HeaderTable:
    """Encodes header tables as AMQP field tables; each name's bytes are kept."""

    def __init__(self) -> None:
        self._names: dict[str, bytes] = {}

    def _name(self, key: str) -> bytes:
        name = self._names.get(key)
        if name is None:
            name = shortstr(key)
            if len(self._names) < MAX_CACHED_NAMES:
                self._names[key] = name
        return name

    def encode(self, headers: Mapping[str, Any]) -> bytes:
        """The table: its size, then each entry (name, type octet, value)."""
        parts: list[bytes] = []
        append = parts.append
        for key, value in headers.items():
            kind = type(value)
            if kind is str:
                data = value.encode("utf-8", "surrogatepass")
                parts += (self._name(key), b"S", _uint32(len(data)), data)
            elif value is None:
                parts += (self._name(key), b"V")
            elif kind is bool:
                parts += (self._name(key), b"t\x01" if value else b"t\x00")
            elif kind is int and -INT32_LIMIT <= value <= INT32_LIMIT:
                parts += (self._name(key), b"I", _int32(value))
            else:  # py-amqp's own encoding of the entry, or its error
                append(dumps("F", [{key: value}])[4:])
        data = b"".join(parts)
        return _uint32(len(data)) + data


class FrameTooLarge(ValueError):
    """A message's content header (its properties: the headers, mostly) does not fit in
    one frame of the connection's negotiated ``frame_max``. AMQP cannot split a header
    frame, and a broker that receives one too large closes the whole connection (501
    FRAME_ERROR), so the message is refused before anything is written: it can never
    be published on that broker as it is."""


def check_content_header(properties_size: int, frame_max: int) -> None:
    """Raise :class:`FrameTooLarge` when a content header whose property list takes
    ``properties_size`` bytes does not fit in one frame of ``frame_max``: the check of
    every message the relay publishes to RabbitMQ, its own frames' and a Celery task's."""
    size = CONTENT_HEAD_SIZE + properties_size
    if size > frame_max - FRAME_OVERHEAD:
        raise FrameTooLarge(
            f"the message's content header frame ({size} bytes, its headers mostly) does not "
            f"fit in a frame of the broker's frame_max ({frame_max} bytes, "
            f"{frame_max - FRAME_OVERHEAD} of them payload), and AMQP cannot split it: make "
            "the event's headers smaller, or raise the broker's frame_max"
        )


class PublishFrames:
    """The frames of messages published on one channel with one content type and
    encoding, persistent, each with its headers and message id."""

    def __init__(
        self, channel_id: int, frame_max: int, content_type: str, content_encoding: str
    ) -> None:
        self.channel_id = channel_id
        self.frame_max = frame_max
        self._body_chunk = frame_max - FRAME_OVERHEAD
        self._encoding = content_encoding
        self._constant = shortstr(content_type) + shortstr(content_encoding)
        self._table = HeaderTable()

    def message(
        self,
        method: bytes,
        body: bytes,
        headers: Mapping[str, Any],
        message_id: str,
        content_type: str | None = None,
    ) -> bytes:
        """One message's frames after ``method`` (from :func:`method_frame`), of the
        channel's content type unless ``content_type`` is given (a CloudEvent's
        structured mode). Raises py-amqp's errors for what AMQP cannot carry, and
        :class:`FrameTooLarge` for a content header over ``frame_max``, before anything
        is written."""
        constant = self._constant
        if content_type is not None:
            constant = shortstr(content_type) + shortstr(self._encoding)
        properties = b"".join(
            (
                constant,
                self._table.encode(headers),
                PERSISTENT_PRIORITY_0,
                shortstr(message_id),
            )
        )
        check_content_header(len(properties), self.frame_max)
        size, channel = len(body), self.channel_id
        parts = [
            method,
            _content_head(
                HEADER_FRAME,
                channel,
                CONTENT_HEAD_SIZE + len(properties),
                BASIC_CLASS,
                0,
                size,
                PROPERTY_FLAGS,
            ),
            properties,
            FRAME_END,
        ]
        for start in range(0, size, self._body_chunk):
            piece = body[start : start + self._body_chunk]
            parts += (_frame_head(BODY_FRAME, channel, len(piece)), piece, FRAME_END)
        return b"".join(parts)


def chunks(frames: Iterable[bytes], size: int) -> Iterable[bytes]:
    """``frames`` joined into writes of about ``size`` bytes (a message is never split)."""
    pending: list[bytes] = []
    length = 0
    for frame in frames:
        pending.append(frame)
        length += len(frame)
        if length >= size:
            yield b"".join(pending)
            pending, length = [], 0
    if pending:
        yield b"".join(pending)
