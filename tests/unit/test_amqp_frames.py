"""The relay's AMQP frames are the bytes py-amqp would write for the same message.

py-amqp's own encoders (``dumps`` for the method arguments, ``Message`` for the
content header) are the reference; no broker is needed to compare bytes (the
integration tests publish these frames to a real RabbitMQ and read them back)."""

from __future__ import annotations

import datetime as dt
import struct
from decimal import Decimal

import amqp
import pytest
from amqp.serialization import dumps, loads

from django_outbox.transports.amqp_frames import (
    FRAME_END,
    FrameTooLarge,
    HeaderTable,
    PublishFrames,
    chunks,
    method_frame,
)

FRAME_MAX = 4096


def split_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, channel, payload) of each frame in ``data``, checking each frame's end."""
    frames, offset = [], 0
    while offset < len(data):
        kind, channel, size = struct.unpack_from(">BHI", data, offset)
        payload = data[offset + 7 : offset + 7 + size]
        assert data[offset + 7 + size : offset + 8 + size] == FRAME_END
        frames.append((kind, channel, payload))
        offset += 8 + size
    return frames


def reference_properties(headers: dict, message_id: str) -> bytes:
    message = amqp.Message(
        b"",
        content_type="application/json",
        content_encoding="utf-8",
        application_headers=headers,
        delivery_mode=2,
        priority=0,  # kombu's producer always sets one (its default, 0)
        message_id=message_id,
    )
    return message._serialize_properties()


def test_the_method_frame_is_py_amqps_basic_publish_with_mandatory():
    [(kind, channel, payload)] = split_frames(method_frame(3, "shop", "order.é"))
    assert (kind, channel) == (1, 3)
    assert payload == struct.pack(">HH", 60, 40) + dumps(
        "Bssbb", (0, "shop", "order.é", True, False)
    )


HEADERS = {
    "correlation_id": "7f0c4c7e-2b1e-4d8e-9a59-3d1f0d1c6b11",
    "causation_id": None,
    "x-text": "crème brûlée \U0001f600",
    "x-empty": "",
    "x-true": True,
    "x-false": False,
    "x-int-top": 2147483647,
    "x-int-bottom": -2147483647,
    "x-int-past-top": 2147483648,
    "x-int-past-bottom": -2147483648,
    "x-int64": -(2**63),
    "x-float": 1.5,
    "x-map": {"a": [1, "b", None], "c": {"d": True}},
    "x-list": [1, 2.5, "three"],
    "x-decimal": Decimal("12.34"),
    "x-datetime": dt.datetime(2026, 11, 25, 6, 30, tzinfo=dt.UTC),
    "sequence": 12,
}


@pytest.mark.parametrize("body_size", [0, 1, FRAME_MAX - 8, FRAME_MAX - 7, 3 * FRAME_MAX])
def test_a_message_is_py_amqps_header_and_body_frames(body_size):
    frames = PublishFrames(5, FRAME_MAX, "application/json", "utf-8")
    method = method_frame(5, "shop", "orders")
    body = bytes(range(256)) * (body_size // 256) + b"x" * (body_size % 256)
    data = frames.message(method, body, HEADERS, "id-1")
    assert data.startswith(method)
    header, *bodies = split_frames(data[len(method) :])
    assert header[:2] == (2, 5)
    assert header[2] == struct.pack(">HHQ", 60, 0, body_size) + reference_properties(
        HEADERS, "id-1"
    )
    assert all(kind == 2 + 1 and channel == 5 for kind, channel, _ in bodies)
    assert all(len(piece) <= FRAME_MAX - 8 for *_, piece in bodies)
    assert b"".join(piece for *_, piece in bodies) == body
    assert len(bodies) == -(-body_size // (FRAME_MAX - 8))  # no empty body frame


def test_the_table_reads_back_as_the_headers_with_py_amqps_types():
    table = HeaderTable().encode(HEADERS)
    [decoded], _ = loads("F", table, 0)
    assert decoded == {
        **HEADERS,
        "x-decimal": Decimal("12.34"),
        "x-datetime": dt.datetime(2026, 11, 25, 6, 30),  # AMQP timestamps are naive UTC
    }


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({"huge": 10**19}, struct.error),  # beyond AMQP's 64-bit signed int
        ({"x" * 256: 1}, struct.error),  # a name over 255 bytes
        ({"é" * 128: "v"}, struct.error),
        ({"x-object": object()}, amqp.exceptions.FrameSyntaxError),
    ],
)
def test_what_amqp_cannot_carry_raises_py_amqps_error(headers, error):
    with pytest.raises(error):
        amqp.Message(b"", application_headers=headers)._serialize_properties()
    with pytest.raises(error):
        HeaderTable().encode(headers)


def test_a_message_id_or_routing_key_over_255_bytes_raises_before_a_byte_is_written():
    frames = PublishFrames(1, FRAME_MAX, "application/json", "utf-8")
    with pytest.raises(struct.error):
        frames.message(method_frame(1, "", "q"), b"{}", {}, "é" * 128)
    with pytest.raises(struct.error):
        method_frame(1, "shop", "k" * 256)


def test_a_content_header_over_the_frames_payload_raises_frame_too_large():
    """The header frame's payload may take frame_max less the frame's 8 bytes, not one more
    (a broker closes the connection on a larger frame): refused before a byte is written."""
    frames = PublishFrames(1, FRAME_MAX, "application/json", "utf-8")
    method = method_frame(1, "", "q")
    empty = frames.message(method, b"", {"pad": ""}, "id-1")[len(method) :]
    room = FRAME_MAX - 8 - struct.unpack_from(">I", empty, 3)[0]
    data = frames.message(method, b"{}", {"pad": "p" * room}, "id-1")[len(method) :]
    assert [len(payload) for _, _, payload in split_frames(data)] == [FRAME_MAX - 8, 2]
    with pytest.raises(FrameTooLarge, match=r"frame_max \(4096 bytes, 4088 of them payload\)"):
        frames.message(method, b"{}", {"pad": "p" * (room + 1)}, "id-1")


def test_writes_join_whole_messages_up_to_about_the_size():
    messages = [bytes([n]) * 100 for n in range(10)]
    writes = list(chunks(messages, 250))
    assert [len(write) for write in writes] == [300, 300, 300, 100]
    assert b"".join(writes) == b"".join(messages)
    assert list(chunks([], 250)) == []
