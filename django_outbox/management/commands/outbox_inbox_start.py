"""``manage.py outbox_inbox_start``: start a consumer in the middle of ordered streams."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.inbox import positions_of, start_positions
from django_outbox.models import InboxSequence
from django_outbox.ops.cli import add_database_option, key_position, require_tables


class Command(BaseCommand):
    help = (
        "Set the last handled sequence of ordered keys for a consumer, which otherwise "
        "waits for sequence 1 of every key: for a new consumer on a stream others consumed "
        "before it. Keys only move forward."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--consumer", required=True, help="the consumer to start")
        parser.add_argument("--like", metavar="CONSUMER", help="copy this consumer's positions")
        parser.add_argument("--destination", help="the ordered destination of --position")
        parser.add_argument(
            "--position",
            dest="positions",
            nargs="+",
            type=key_position,
            default=[],
            metavar="KEY=LAST",
            help="count the key's events up to LAST as handled (needs --destination)",
        )
        add_database_option(parser, "inbox")

    def handle(self, *args: Any, **options: Any) -> None:
        using, consumer, destination = (
            options["database"],
            options["consumer"],
            options["destination"],
        )
        if options["positions"] and not destination:
            raise CommandError("--position needs --destination (the keys' ordered destination)")
        require_tables(using, InboxSequence)
        positions = positions_of(options["like"], using) if options["like"] else {}
        positions.update(((destination, key), last) for key, last in options["positions"])
        if not positions:
            raise CommandError("nothing to set: give --like CONSUMER or --position KEY=LAST")
        try:
            moved = start_positions(consumer, positions, using)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"{consumer}: {moved} of {len(positions)} key(s) moved forward")
