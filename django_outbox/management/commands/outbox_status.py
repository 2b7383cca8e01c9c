"""``manage.py outbox_status``: what is in the outbox right now."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.status import report

from ._options import add_database_option


class Command(BaseCommand):
    help = "Show outbox counts per state, the oldest due row's age, failing attempts and busy keys."

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        status = report(options["database"])
        self.stdout.write("state        rows")
        for state, count in status.counts.items():
            self.stdout.write(f"{state:<12} {count}")
        age = status.oldest_due_age
        self.stdout.write(
            "oldest due row: "
            + ("none (nothing is due)" if age is None else f"{age.total_seconds():.1f}s old")
        )
        if status.failing_attempts:
            self.stdout.write("failed rows by attempts made:")
            for attempts, count in status.failing_attempts.items():
                self.stdout.write(f"  {attempts:>3} attempts: {count}")
        if status.top_keys:
            self.stdout.write("ordering keys with the most rows waiting:")
            for key, count in status.top_keys:
                self.stdout.write(f"  {count:>7}  {key}")
