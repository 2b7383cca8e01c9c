"""``manage.py outbox_requeue``: send FAILED/ABANDONED rows back to PENDING."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.exceptions import RequeueRefused
from django_outbox.models import REQUEUEABLE
from django_outbox.ops.cli import add_database_option, row_id
from django_outbox.state import store


class Command(BaseCommand):
    help = (
        "Move FAILED and ABANDONED outbox rows back to PENDING with attempts reset. "
        "Naming a row (--id) that is in another state refuses the whole requeue."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--status",
            choices=[status.value for status in REQUEUEABLE],
            help="only rows in this state (default: both failed and abandoned)",
        )
        parser.add_argument("--event-type", help="only rows of this event type")
        ids_help = "only these rows: row ids or event ids"
        parser.add_argument(
            "--id", dest="ids", nargs="+", type=row_id, default=[], metavar="ID", help=ids_help
        )
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        selection = {key: options[key] for key in ("ids", "status", "event_type")}
        try:
            count = store.requeue_selected(options["database"], **selection)
        except RequeueRefused as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"requeued {count} row{'s' if count != 1 else ''}")
