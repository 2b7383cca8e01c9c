"""The HPUB frames of a relay's NATS messages, and their hand-over to nats-py's connection.

nats-py's ``publish()`` checks and encodes each header of each message on its own (a
regular expression per name, ``str.translate`` of each value, a few ``bytearray``
appends each), then queues the frame: about half the relay's event loop thread's time
per message on NATS (docs/benchmarks.md, what NATS costs). A relay's headers are its
own, so :func:`header_block` checks and encodes a message's headers once, on the relay's
claim thread (``NatsTransport.encoder``), into the bytes nats-py would have written, and
:func:`write` queues a batch's frames on the connection in one go, through nats-py's
outgoing buffer and its flusher task, as ``publish()`` does for one.

The bytes are the ones nats-py's ``publish()`` writes for the same subject, reply
subject, headers and payload (the tests compare them). A header NATS cannot carry is a
``ValueError`` here, where nats-py raised its ``BadHeaderError`` while publishing.
"""

from __future__ import annotations

import functools
import re
from typing import Any

#: The first line of every header block (NATS's protocol version of headers).
HEADER_LINE = b"NATS/1.0\r\n"
CRLF = b"\r\n"
#: The names a NATS header may have (HTTP's tokens, as nats-py checks them).
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@functools.lru_cache(maxsize=1024)
def header_name(name: str) -> str:
    """``name`` as its header line starts (``"name: "``), or ``ValueError`` for a name
    NATS cannot carry. Remembered: a relay meets the same few names in every message."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"header {name!r} cannot travel as a NATS header")
    return f"{name}: "


def header_line(name: str, value: str) -> str:
    """The line of a header (text) in a header block, its value stripped of surrounding
    white space as nats-py strips it; ``ValueError`` for a name NATS cannot carry, or a
    line break among what is stripped (one within the value: :func:`header_block`)."""
    stripped = value.strip()
    if len(stripped) != len(value) and ("\r" in value or "\n" in value):
        raise ValueError(f"header {name!r} cannot travel as a NATS header (a line break)")
    return header_name(name) + stripped + "\r\n"


def header_block(lines: list[str]) -> bytes:
    """The header block of a message whose header lines (:func:`header_line`) are
    ``lines``, as nats-py writes it. ``ValueError`` for a value with a line break (nats-py
    would write a space for it: a value that would not arrive as it was)."""
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        broken = next(line for line in lines if line.count("\n") + line.count("\r") > 2)
        name = broken.partition(":")[0]
        raise ValueError(f"header {name!r} cannot travel as a NATS header (a line break)")
    return HEADER_LINE + text.encode() + CRLF


def hpub(subject: bytes, reply: bytes, block: bytes, body: bytes) -> bytes:
    """The HPUB frame of a message to ``subject`` with ``reply`` as its reply subject."""
    return b"HPUB %b %b %d %d\r\n%b%b\r\n" % (
        subject,
        reply,
        len(block),
        len(block) + len(body),
        block,
        body,
    )


async def write(client: Any, frames: list[bytes]) -> None:
    """Queue ``frames`` on ``client``'s connection and have its flusher send them, as
    nats-py's ``publish()`` does with one. A connection closed, draining or reconnecting
    raises nats-py's error for it: nothing is queued (``publish()`` would buffer them
    while reconnecting; the relay publishes them again once it is back instead)."""
    import nats.errors

    if client.is_closed:
        raise nats.errors.ConnectionClosedError
    if client.is_draining_pubs:
        raise nats.errors.ConnectionDrainingError
    if not client.is_connected:
        raise nats.errors.ConnectionReconnectingError
    await client._send_command(b"".join(frames))
    if client._flush_queue is not None and client._flush_queue.empty():
        await client._flush_pending()


def oversize(client: Any, frame_payload: int) -> str | None:
    """Why a message of ``frame_payload`` bytes (its header block and body) cannot go to
    ``client``'s server: larger than its ``max_payload``, which the server would answer
    by closing the connection; None when it fits."""
    limit = client.max_payload
    if frame_payload <= limit:
        return None
    return (
        f"MaxPayloadError: the message ({frame_payload} bytes with its headers) is larger "
        f"than the server's max_payload ({limit} bytes)"
    )
