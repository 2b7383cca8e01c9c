"""``manage.py outbox_status``: what is in the outbox right now."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.models import InboxFailure, OutboxMessage, WorkerHeartbeat
from django_outbox.ops.cli import add_database_option, require_tables
from django_outbox.ops.reporting import status_json, status_lines, worker_lines
from django_outbox.state.status import report
from django_outbox.workers.heartbeat import workers


class Command(BaseCommand):
    help = (
        "Show outbox counts per state (pending: the rows due; scheduled ones apart), the "
        "oldest due row's age, failing attempts, busy keys, "
        "blocked keys (an abandoned head holds back its ordered key), the most frequent "
        "recent errors, the parked inbox messages per consumer, and the relays and "
        "consumers with their heartbeat (live, stale, dead or stopped)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_option(parser)
        parser.add_argument(
            "--json", action="store_true", help="print everything as one JSON object"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"]
        require_tables(using, OutboxMessage, InboxFailure, WorkerHeartbeat)
        status, beats = report(using), workers(using)
        if options["json"]:
            self.stdout.write(json.dumps(status_json(status, beats, using)))
            return
        for line in status_lines(status) + worker_lines(beats):
            self.stdout.write(line)
