"""``manage.py outbox_cleanup``: delete outbox and inbox rows past their retention."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.ops.cli import add_database_option
from django_outbox.relay.retention import cleanup, describe


class Command(BaseCommand):
    help = (
        "Delete PUBLISHED rows older than OUTBOX['PUBLISHED_RETENTION'], ABANDONED rows and "
        "parked inbox messages older than OUTBOX['ABANDONED_RETENTION'], and inbox marks and "
        "failure records older than OUTBOX['INBOX_RETENTION'], in bounded batches."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="count what would be deleted; delete nothing"
        )
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        counts = cleanup(options["database"], dry_run=options["dry_run"])
        verb = "would delete" if options["dry_run"] else "deleted"
        self.stdout.write(f"{verb} {describe(counts)}")
