"""``manage.py outbox_replay_parked``: put parked inbox messages back on their queue."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.ops.cli import add_replay_options, finish
from django_outbox.ops.reporting import replay_result


class Command(BaseCommand):
    help = (
        "Publish parked inbox messages (kept in InboxFailure) to the queue they came from "
        "and unpark them with a fresh delivery count. Fix the handler first."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_replay_options(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        result = replay_result(
            options["database"],
            consumer=options["consumer"],
            queue=options["queue"],
            event_ids=options["event_ids"],
            dry_run=options["dry_run"],
            confirm_timeout=options["confirm_timeout"],
        )
        finish(self.stdout, result)
