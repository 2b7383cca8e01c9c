"""The value parsers of the ``OUTBOX`` settings: each takes the raw value and returns
the parsed one, or raises :class:`Invalid` with what the value should have been.

Nothing here reads settings; :mod:`.catalog` pairs each setting with its parser.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from ..signing import Keyring, parse_keys
from .routes import ENVELOPES, is_valid_destination


class Invalid(ValueError):
    """Raised by a parser with what the value should have been."""


def positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise Invalid("must be a positive integer")
    return value


#: The longest duration a setting takes: what a ``timedelta`` holds (about 2.7 million years).
MAX_SECONDS = dt.timedelta.max.total_seconds()


def seconds(value: object) -> float:
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0 < value < MAX_SECONDS)
    ):
        raise Invalid("must be a positive number of seconds or a timedelta")
    return float(value)


def is_zero(value: object) -> bool:
    """0 or 0.0 (a number, not False): what turns a feature off, or keeps nothing."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def seconds_or_zero(value: object) -> float:
    """A number of seconds that may be 0 (a feature turned off)."""
    if is_zero(value):
        return 0.0
    try:
        return seconds(value)
    except Invalid:
        raise Invalid("must be 0 or a positive number of seconds") from None


def duration(value: object) -> dt.timedelta:
    """A positive duration; one under a microsecond, which a timedelta cannot hold, is
    refused rather than read as 0 (a retention of 0 would delete rows at once)."""
    duration = dt.timedelta(seconds=seconds(value))
    if not duration:
        raise Invalid("must be a positive number of seconds or a timedelta")
    return duration


def duration_or_zero(value: object) -> dt.timedelta:
    """A duration that may be 0 (nothing kept), else as :func:`duration`."""
    seconds = value.total_seconds() if isinstance(value, dt.timedelta) else value
    if is_zero(seconds):
        return dt.timedelta(0)
    try:
        return duration(seconds)
    except Invalid:
        raise Invalid("must be 0, a positive number of seconds or a timedelta") from None


#: What ``OUTBOX["PARTITIONING"]`` holds when a key is left out.
PARTITIONING_DEFAULTS = {"rows": 1_000_000, "ahead": 2}


def partitioning(value: object) -> dict[str, int] | None:
    """None, or the sizes of a partitioned outbox: ``rows`` ids per partition, ``ahead``
    empty partitions kept above the ids drawn."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not set(value) <= set(PARTITIONING_DEFAULTS):
        raise Invalid('must be None or {"rows": ids per partition, "ahead": partitions ahead}')
    try:
        return {key: positive_int(value.get(key, d)) for key, d in PARTITIONING_DEFAULTS.items()}
    except Invalid:
        raise Invalid('must have a positive integer as "rows" and as "ahead"') from None


def fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise Invalid("must be a number between 0 and 1")
    return float(value)


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise Invalid("must be True or False")
    return value


def optional_str(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise Invalid("must be a non-empty string or None")
    return value


def exchange_name(value: object) -> str:
    if not isinstance(value, str) or not is_valid_destination(value):
        raise Invalid("must be an exchange name of letters, digits and ._:/-")
    return value


def envelope(value: object) -> str:
    if not isinstance(value, str) or value not in ENVELOPES:
        raise Invalid(f"must be one of {', '.join(map(repr, ENVELOPES))}")
    return value


def text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Invalid("must be a non-empty string")
    return value


def string_dict(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise Invalid("must be a dict with string keys")
    return dict(value)


def signing_keys(value: object) -> Keyring:
    try:
        return parse_keys(value)
    except ValueError as exc:
        raise Invalid(str(exc)) from None


#: The keys of one broker of ``OUTBOX["BROKERS"]``.
BROKER_KEYS = ("URL", "OPTIONS")


def broker_table(value: object) -> dict[str, dict[str, Any]]:
    """``OUTBOX["BROKERS"]``: alias -> ``{"URL": kombu URL, "OPTIONS": transport options}``.
    The reasons name the alias and the key, never a value (a URL or an option may hold
    a password)."""
    if not isinstance(value, Mapping):
        raise Invalid(
            'must be a dict of alias -> {"URL": ..., "OPTIONS": {...}}; '
            f"got {type(value).__name__}"
        )
    table = {}
    for alias, spec in value.items():
        if not isinstance(alias, str) or not alias:
            raise Invalid(f"has an alias that is not a non-empty string: {type(alias).__name__}")
        where = f'["{alias}"]'
        if not isinstance(spec, Mapping):
            raise Invalid(
                f'{where} must be a dict with "URL" and optional "OPTIONS"; '
                f"got {type(spec).__name__}"
            )
        if unknown := sorted(str(key) for key in spec if key not in BROKER_KEYS):
            raise Invalid(f"{where} has unknown keys {unknown}; a broker takes URL and OPTIONS")
        if "URL" not in spec:
            raise Invalid(f'{where} has no "URL"')
        if not isinstance(spec["URL"], str) or not spec["URL"]:
            raise Invalid(f'{where}["URL"] must be a non-empty string')
        try:
            options = string_dict(spec.get("OPTIONS", {}))
        except Invalid as exc:
            kind = type(spec["OPTIONS"]).__name__
            raise Invalid(f'{where}["OPTIONS"] {exc}; got {kind}') from None
        table[alias] = {"URL": spec["URL"], "OPTIONS": options}
    return table
