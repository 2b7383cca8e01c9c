"""``manage.py outbox_health``: exit 0 when the outbox is healthy, for probes and cron."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser, SystemCheckError
from django.db import DatabaseError

from django_outbox.conf import outbox_settings
from django_outbox.models import OutboxMessage, WorkerHeartbeat
from django_outbox.ops.cli import add_database_option, non_negative_seconds, require_tables
from django_outbox.ops.health import Health, check_health
from django_outbox.ops.text import one_line

#: Exit codes: healthy, unhealthy, could not check (see docs/commands.md).
HEALTHY, UNHEALTHY, UNKNOWN = 0, 1, 2


class Command(BaseCommand):
    requires_system_checks: list[str] = []  # a failing check exits 2, not 1: see _check()
    help = (
        "Check the outbox: exit 0 when healthy, 1 when the oldest due row waited longer "
        "than --max-due-age or no relay has a live heartbeat, 2 when the database cannot "
        "be read."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_database_option(parser)
        parser.add_argument(
            "--max-due-age",
            type=non_negative_seconds,
            default=None,
            metavar="SECONDS",
            help='how long the oldest due row may wait (default: OUTBOX["HEALTH_MAX_DUE_AGE"])',
        )
        parser.add_argument(
            "--no-relay-required",
            action="store_true",
            help="do not require a live relay (relays that run as --drain from cron do not beat)",
        )
        parser.add_argument("--json", action="store_true", help="print the outcome as JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"]
        try:
            health = self._check(using, options)
        except CommandError as exc:
            if options["json"]:
                self.stdout.write(
                    json.dumps({"healthy": None, "database": using, "error": str(exc)})
                )
            raise
        self.stdout.write(json.dumps(health.as_dict()) if options["json"] else health.summary())
        if not health.healthy:
            raise CommandError(health.summary(), returncode=UNHEALTHY)

    def _check(self, using: str, options: dict[str, Any]) -> Health:
        """The outcome; a :class:`CommandError` exiting 2 when it cannot be had."""
        try:
            self.check(display_num_errors=False)  # requires_system_checks is off: exit 2
            require_tables(using, OutboxMessage, WorkerHeartbeat)
            return check_health(
                using,
                max_due_age=options["max_due_age"],
                require_relay=not options["no_relay_required"],
            )
        except SystemCheckError:
            problem = "the system checks failed (run manage.py check)"
        except CommandError as exc:
            problem = str(exc)
        except DatabaseError as exc:
            error = one_line(outbox_settings.redact(f"{type(exc).__name__}: {exc}"))
            problem = f"database {using!r} cannot be read ({error})"
        raise CommandError(f"cannot check the outbox: {problem}", returncode=UNKNOWN)
