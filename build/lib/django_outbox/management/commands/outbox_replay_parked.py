"""``manage.py outbox_replay_parked``: put parked inbox messages back on their queue."""

from __future__ import annotations

import argparse
import uuid
from typing import Any

import kombu.exceptions
from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.exceptions import OutboxError
from django_outbox.models import InboxFailure
from django_outbox.replay import replay_parked

from ._options import add_database_option


def event_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an event id (UUID)") from None


class Command(BaseCommand):
    help = (
        "Publish parked inbox messages (kept in InboxFailure) to the queue they came from "
        "and unpark them with a fresh delivery count. Fix the handler first."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--dry-run", action="store_true", help="list what would be replayed; change nothing"
        )
        parser.add_argument("--consumer", help="only messages parked by this inbox consumer")
        parser.add_argument("--queue", help="only messages parked from this queue")
        parser.add_argument(
            "--event-id",
            dest="event_ids",
            nargs="+",
            type=event_id,
            default=[],
            metavar="EVENT_ID",
            help="only these events; each must be parked (matching the other filters)",
        )
        add_database_option(parser, "inbox failures")

    def handle(self, *args: Any, **options: Any) -> None:
        parked = InboxFailure.objects.using(options["database"]).parked()
        for field in ("consumer", "queue"):
            if options[field]:
                parked = parked.filter(**{field: options[field]})
        if options["event_ids"]:
            parked = parked.filter(event_id__in=options["event_ids"])
            found = set(parked.values_list("event_id", flat=True))
            missing = [str(i) for i in options["event_ids"] if i not in found]
            if missing:
                raise CommandError(
                    f"no parked message matches {', '.join(missing)}; nothing replayed"
                )
        if options["dry_run"]:
            self._report("would replay", list(parked.order_by("id")))
            return
        try:
            self._report("replayed", replay_parked(parked))
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc
        except (kombu.exceptions.OperationalError, OSError) as exc:
            raise CommandError(f"cannot reach the broker: {exc}") from exc

    def _report(self, verb: str, failures: list[InboxFailure]) -> None:
        for failure in failures:
            self.stdout.write(
                f"{verb} {failure.event_id} ({failure.event_type or 'no event type'}) "
                f"of {failure.consumer} to {failure.queue}: {_first_line(failure.last_error)}"
            )
        count = len(failures)
        self.stdout.write(f"{verb} {count} parked message{'s' if count != 1 else ''}")


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else "no error recorded"
