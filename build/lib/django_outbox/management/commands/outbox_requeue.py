"""``manage.py outbox_requeue``: send FAILED/ABANDONED rows back to PENDING."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction
from django.db.models import Q

from django_outbox.models import REQUEUEABLE, OutboxMessage

from ._options import add_database_option


def row_id(value: str) -> int | uuid.UUID:
    """A row's primary key or its event id."""
    if value.isdigit():
        return int(value)
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a row id (integer) nor an event id (UUID)"
        ) from None


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
        parser.add_argument(
            "--id",
            dest="ids",
            nargs="+",
            type=row_id,
            default=[],
            metavar="ID",
            help="only these rows: row ids or event ids",
        )
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        rows = OutboxMessage.objects.using(options["database"])
        if options["ids"]:
            ints = [i for i in options["ids"] if isinstance(i, int)]
            uuids = [i for i in options["ids"] if isinstance(i, uuid.UUID)]
            rows = rows.filter(Q(id__in=ints) | Q(event_id__in=uuids))
        if options["status"]:
            rows = rows.filter(status=options["status"])
        if options["event_type"]:
            rows = rows.filter(event_type=options["event_type"])
        with transaction.atomic(using=options["database"]):
            if options["ids"]:
                self._refuse_unrequeueable(rows, options["ids"])
            count = rows.requeue()
        self.stdout.write(f"requeued {count} row{'s' if count != 1 else ''}")

    def _refuse_unrequeueable(self, rows: Any, ids: list[int | uuid.UUID]) -> None:
        found = {
            key: (pk, status)
            for pk, event_id, status in rows.values_list("id", "event_id", "status")
            for key in (pk, event_id)
        }
        missing = [str(i) for i in ids if i not in found]
        if missing:
            raise CommandError(f"no outbox row matches {', '.join(missing)}; nothing requeued")
        refused = sorted(
            {found[i] for i in ids if found[i][1] not in {s.value for s in REQUEUEABLE}}
        )
        if refused:
            listed = ", ".join(f"{pk} ({status})" for pk, status in refused)
            raise CommandError(
                f"refused: only failed or abandoned rows can be requeued; not {listed}; "
                "nothing requeued"
            )
