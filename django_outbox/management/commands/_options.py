"""Helpers shared by the outbox commands: argparse types, the database option,
and the stop-on-signal handlers of the long-running commands."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from types import FrameType

from django.core.management.base import CommandParser
from django.db import DEFAULT_DB_ALIAS, connections


def _number(value: str, parse: type[int] | type[float], minimum: float, what: str) -> float:
    try:
        number = parse(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}; got {value!r}") from None
    if not number >= minimum or number != number:  # NaN fails both
        raise argparse.ArgumentTypeError(f"must be {what}; got {value}")
    return number


def positive_int(value: str) -> int:
    return int(_number(value, int, 1, "a positive integer"))


def non_negative_int(value: str) -> int:
    return int(_number(value, int, 0, "an integer of 0 or more"))


def positive_seconds(value: str) -> float:
    seconds = _number(value, float, 0, "a positive number of seconds")
    if seconds == 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds; got {value}")
    return seconds


def non_negative_seconds(value: str) -> float:
    seconds = _number(value, float, 0, "a number of seconds of 0 or more")
    if seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds; got {value}")
    return seconds


def database_alias(value: str) -> str:
    if value not in connections.settings:
        known = ", ".join(connections.settings)
        raise argparse.ArgumentTypeError(f"unknown database alias {value!r} (known: {known})")
    return value


def add_database_option(parser: CommandParser, what: str = "outbox") -> None:
    parser.add_argument(
        "--database",
        type=database_alias,
        default=DEFAULT_DB_ALIAS,
        help=f"database alias whose {what} to use (default: %(default)r)",
    )


def stop_on_signals(stop: threading.Event, logger: logging.Logger, after: str) -> None:
    """SIGTERM or SIGINT sets ``stop`` (the loop finishes ``after`` first); a
    second one exits at once."""

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            # SystemExit, not an Exception: no handler in the loop may swallow it.
            raise SystemExit(f"{name} again: exiting at once")
        logger.info("%s: stopping after %s", name, after, extra={"action": "outbox.stopping"})
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
