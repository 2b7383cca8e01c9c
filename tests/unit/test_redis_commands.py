"""The commands the relay's Redis writer sends are written in Redis's protocol (RESP)
by the writer itself: each must be the bytes redis-py's own packer writes for the same
words, ASCII or not (redis-py's packer is the reference; no Redis is needed to compare
bytes; tests/integration/test_redis_wire.py sends them to a real Redis)."""

from __future__ import annotations

import pytest
from redis.connection import Connection

from django_outbox.transports.redis_wire import _bulk, _command

WORDS = [
    ("LPUSH", "orders", '{"body": "e30=", "headers": {}}'),
    ("LPUSH", "app:orders\x06\x169", *[f"message {n}" for n in range(600)]),
    ("PEXPIRE", "orders", "60000"),
    ("LPUSH", "commandes-été", '{"note": "caf\\u00e9"}', ""),
    ("LPUSH", "q", "x" * 7000),  # past redis-py's cut-off for a value written in its own chunk
]


@pytest.mark.parametrize("words", WORDS, ids=["one", "many", "pexpire", "not ascii", "large"])
def test_a_command_is_the_bytes_redis_pys_packer_writes(words):
    assert _command(*words) == b"".join(Connection().pack_command(*words))


def test_a_word_that_is_not_ascii_is_counted_in_its_utf8_bytes():
    assert _command("LPUSH", "été") == b"*2\r\n$5\r\nLPUSH\r\n$5\r\n\xc3\xa9t\xc3\xa9\r\n"


def test_values_written_as_bulk_strings_ahead_make_the_same_command():
    """The writer writes each message as a bulk string when it builds it (``bulks``)."""
    values = [*(f"message {n}" for n in range(3)), "caf\u00e9", ""]
    bulks = [_bulk(value) for value in values]
    expected = b"".join(Connection().pack_command("LPUSH", "q", *values))
    assert _command("LPUSH", "q", bulks=bulks) == expected
