"""Signed envelopes: an HMAC-SHA256 the relay puts on each message and a consumer checks.

With ``OUTBOX["SIGNING_KEYS"]`` set, the relay adds the header ``outbox_signature``
to every message it publishes, ``v1:<key id>:<signature>``: the first key signs, every
key of the list verifies (to rotate, put the new key first and drop the old one once no
unverified message can be left). The key id is the first 16 hex digits of
SHA-256 over ``b"django-outbox signing key\\x00"`` and the key, so a verifier picks the
key without trying each, and no key travels.

The signature is the lowercase hex HMAC-SHA256, under the key, of the **canonical
encoding**: the fields below, each as UTF-8 bytes written as a netstring
(``<length in bytes, decimal ASCII>:<bytes>,``), one after the other:

1. ``outbox-envelope-v1`` (the version);
2. the event id, lowercase and hyphenated (``str(uuid)``);
3. the event type;
4. the ordering key, or nothing when the event has none;
5. the destination (the ``destination`` header of an ordered route's event), or nothing;
6. the sequence in decimal, or nothing;
7. ``1`` for a skip marker, else nothing;
8. the body, its bytes exactly as sent (the payload's JSON text).

Length prefixes make it unambiguous: no two different envelopes encode alike, whatever
their texts hold. docs/hostile-input.md has the same definition, for verifiers in other
languages.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid
from collections.abc import Sequence

#: The header that carries the signature.
SIGNATURE_HEADER = "outbox_signature"
VERSION = "v1"
#: The canonical encoding: the version, then seven netstrings (``%d`` length, ``%s`` bytes).
_FORMAT = b"18:outbox-envelope-v1," + b"%d:%s," * 7
#: The shortest key accepted, in bytes: HMAC-SHA256's own block of strength.
MIN_KEY_BYTES = 32
_KEY_ID_PREFIX = b"django-outbox signing key\x00"


def key_id(key: bytes) -> str:
    """The id a signature names ``key`` by: 16 hex digits of a hash of it."""
    return hashlib.sha256(_KEY_ID_PREFIX + key).hexdigest()[:16]


def canonical(
    event_id: uuid.UUID | str,
    event_type: str,
    ordering_key: str | None,
    destination: str | None,
    sequence: int | None,
    skipped: bool,
    body: bytes,
) -> bytes:
    """The bytes a signature covers (see the module docstring), in one formatting: the
    relay makes one per message it publishes."""
    eid = str(event_id).encode()
    kind = event_type.encode()
    key = ordering_key.encode() if ordering_key else b""
    where = destination.encode() if destination else b""
    number = b"" if sequence is None else b"%d" % sequence
    skip = b"1" if skipped else b""
    return _FORMAT % (
        *(len(eid), eid, len(kind), kind, len(key), key, len(where), where),
        *(len(number), number, len(skip), skip, len(body), body),
    )


class Keyring:
    """``OUTBOX["SIGNING_KEYS"]``, parsed: the first key signs, every key verifies.
    Falsy when there are none. Its keys are never shown (its repr names their ids)."""

    __slots__ = ("_by_id", "_prefix", "_signing")

    def __init__(self, keys: Sequence[bytes] = ()) -> None:
        self._by_id = {key_id(key): key for key in keys}
        self._signing = keys[0] if keys else b""
        self._prefix = f"{VERSION}:{key_id(self._signing)}:" if keys else ""

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __repr__(self) -> str:
        return f"Keyring(key ids {', '.join(self._by_id) or 'none'})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Keyring) and other._by_id == self._by_id

    __hash__ = None  # type: ignore[assignment]

    def sign(self, envelope: bytes) -> str:
        """The ``outbox_signature`` header's value for the canonical ``envelope``."""
        return self._prefix + hmac.digest(self._signing, envelope, "sha256").hex()

    def problem(self, header: object, envelope: bytes) -> str | None:
        """Why ``header`` (the ``outbox_signature`` a message carries) is not a signature
        of ``envelope`` by one of the keys, in one line; None when it is."""
        if header is None:
            return f"unsigned: the message has no {SIGNATURE_HEADER} header"
        version, _, rest = header.partition(":") if isinstance(header, str) else ("", "", "")
        kid, _, signature = rest.partition(":")
        if version != VERSION or not kid or not signature or not signature.isascii():
            return f"the {SIGNATURE_HEADER} header is not {VERSION}:<key id>:<hex HMAC-SHA256>"
        key = self._by_id.get(kid)
        if key is None:
            return (
                f"signed with key id {kid[:16]!r}, which is none of OUTBOX['SIGNING_KEYS'] "
                f"({', '.join(self._by_id)})"
            )
        expected = hmac.digest(key, envelope, "sha256").hex()
        if not hmac.compare_digest(expected, signature):
            return f"the signature (key id {kid}) does not match: the message was altered"
        return None


def parse_keys(value: object) -> Keyring:
    """``OUTBOX["SIGNING_KEYS"]`` as a :class:`Keyring`; :class:`ValueError` saying why
    it is not one, naming positions and lengths, never a key."""
    if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
        raise ValueError(
            "must be a list of keys (str or bytes; the first signs, all verify); "
            f"got {type(value).__name__}"
        )
    keys: list[bytes] = []
    for number, item in enumerate(value, 1):
        if not isinstance(item, str | bytes):
            raise ValueError(f"key {number} is a {type(item).__name__}, not str or bytes")
        key = item.encode() if isinstance(item, str) else item
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(
                f"key {number} is {len(key)} bytes long, under {MIN_KEY_BYTES}: make one "
                "with secrets.token_urlsafe(32)"
            )
        if key in keys:
            raise ValueError(f"key {number} is key {keys.index(key) + 1} again")
        keys.append(key)
    return Keyring(keys)
