"""``manage.py outbox_status``: what is in the outbox right now."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.cli import add_database_option, require_tables
from django_outbox.heartbeat import workers
from django_outbox.models import InboxFailure, OutboxMessage, WorkerHeartbeat
from django_outbox.reporting import blocked_lines, status_json, worker_lines
from django_outbox.status import RECENT_ROWS, StatusReport, report
from django_outbox.text import one_line


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
        self._text(status)
        for line in worker_lines(beats):
            self.stdout.write(line)

    def _text(self, status: StatusReport) -> None:
        self.stdout.write("state        rows")
        for state, count in status.counts.items():
            self.stdout.write(f"{state:<12} {count}")
        self.stdout.write(f"scheduled    {status.scheduled} (pending, not due yet: not in pending)")
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
        for line in blocked_lines(status.blocked):
            self.stdout.write(line)
        if status.recent_errors:
            self.stdout.write(
                f"most frequent errors of the latest {RECENT_ROWS} failed and abandoned rows:"
            )
            for error in status.recent_errors:
                text = one_line(error.error or "no error recorded")  # abandoned by an operator
                self.stdout.write(f"  {error.rows:>7}  {error.status:<9}  {text}")
        if status.parked:
            self.stdout.write("parked inbox messages by consumer (the newest one's error):")
            for parked in status.parked:
                self.stdout.write(
                    f"  {parked.rows:>7}  {parked.consumer}: {one_line(parked.newest_error)}"
                )
