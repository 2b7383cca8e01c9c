"""``manage.py outbox_partition``: partition the outbox table by ranges of id."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.ops.cli import add_database_option
from django_outbox.ops.partitioning import partition


class Command(BaseCommand):
    help = (
        "Turn the outbox table into one partitioned by ranges of id (PostgreSQL; sizes from "
        "OUTBOX['PARTITIONING']), holding the table alone meanwhile; on a partitioned "
        "table, make the partitions ahead. Prints each partition and what keeps it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            lines = partition(options["database"])
        except OutboxConfigurationError as error:
            raise CommandError(str(error)) from None
        for line in lines:
            self.stdout.write(line)
