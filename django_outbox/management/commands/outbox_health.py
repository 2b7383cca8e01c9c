"""``manage.py outbox_health``: exit 0 when the outbox is healthy, for probes and cron."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.ops.cli import UNHEALTHY, add_health_options, checked_health


class Command(BaseCommand):
    requires_system_checks: list[str] = []  # a failing check exits 2, not 1: see checked_health
    help = (
        "Check the outbox: exit 0 when healthy, 1 when the oldest due row waited longer "
        "than --max-due-age or no relay has a live heartbeat, 2 when the database cannot "
        "be read."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_health_options(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"]
        try:
            health = checked_health(using, lambda: self.check(display_num_errors=False), options)
        except CommandError as exc:
            if options["json"]:
                self.stdout.write(
                    json.dumps({"healthy": None, "database": using, "error": str(exc)})
                )
            raise
        self.stdout.write(json.dumps(health.as_dict()) if options["json"] else health.summary())
        if not health.healthy:
            raise CommandError(health.summary(), returncode=UNHEALTHY)
