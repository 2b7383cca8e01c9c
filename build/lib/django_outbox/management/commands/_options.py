"""Helpers shared by the outbox commands: argparse types, the database option,
and the stop-on-signal handlers of the long-running commands."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType

from django.core.management.base import CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, connections, models

from django_outbox import db
from django_outbox.exceptions import OutboxConfigurationError


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


def require_tables(using: str, *tables: type[models.Model]) -> None:
    """A one-line CommandError when database ``using`` lacks the table of a model of
    ``tables`` (``migrate`` not run), before a command's first query fails on it."""
    try:
        db.require_tables(using, *tables)
    except OutboxConfigurationError as exc:
        raise CommandError(str(exc)) from None


def stop_on_signals(stop: threading.Event, logger: logging.Logger, after: str) -> None:
    """SIGTERM or SIGINT sets ``stop`` (the loop finishes ``after`` first); a
    second one exits at once, with status 1."""

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            logger.warning("%s again: exiting at once", name, extra={"action": "outbox.stopping"})
            _exit_now(1)
        logger.info("%s: stopping after %s", name, after, extra={"action": "outbox.stopping"})
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _exit_now(status: int) -> None:
    """Exit without unwinding: no ``finally`` and no atexit hook runs, because those
    close broker channels and join the database thread, and each of those waits for
    a peer that may have stopped answering (the very reason for a second signal).
    What was in hand is left to its lease (relay) or to the broker (consumer)."""
    logging.shutdown()  # flush the log handlers
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
