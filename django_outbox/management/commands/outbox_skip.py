"""``manage.py outbox_skip``: give up on the blocked head of an ordered key."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.exceptions import SkipRefused
from django_outbox.ops.cli import add_database_option, row_id
from django_outbox.state import store


class Command(BaseCommand):
    help = (
        "Skip the failed or abandoned head of an ordered key: the relay publishes a skip "
        "marker (body null, header skipped, the event's sequence) in its place and the key "
        "moves on. Naming a row that is not such a head refuses the whole skip."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--id",
            dest="ids",
            nargs="+",
            type=row_id,
            required=True,
            metavar="ID",
            help="the heads to skip: row ids or event ids (outbox_status lists them)",
        )
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            count = store.skip(options["database"], options["ids"])
        except SkipRefused as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(
            f"skipped {count} row{'s' if count != 1 else ''}: "
            "the relay publishes a skip marker in place of each"
        )
