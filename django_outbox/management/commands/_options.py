"""argparse helpers shared by the outbox commands."""

from __future__ import annotations

import argparse

from django.core.management.base import CommandParser
from django.db import DEFAULT_DB_ALIAS, connections


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {number}")
    return number


def database_alias(value: str) -> str:
    if value not in connections.settings:
        known = ", ".join(connections.settings)
        raise argparse.ArgumentTypeError(f"unknown database alias {value!r} (known: {known})")
    return value


def add_database_option(parser: CommandParser) -> None:
    parser.add_argument(
        "--database",
        type=database_alias,
        default=DEFAULT_DB_ALIAS,
        help="database alias whose outbox to use (default: %(default)r)",
    )
