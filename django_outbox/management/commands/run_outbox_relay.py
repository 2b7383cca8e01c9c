"""``manage.py run_outbox_relay``: publish staged events until stopped."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.models import OutboxMessage
from django_outbox.ops.cli import (
    add_relay_options,
    finish,
    library_errors,
    relay_metrics,
    relay_until_stopped,
    require_tables,
)
from django_outbox.ops.reporting import once_result
from django_outbox.relay import Relay


class Command(BaseCommand):
    help = (
        "Relay staged outbox events to the broker. Runs until SIGTERM/SIGINT, then finishes "
        "the batch in hand and exits 0; a second signal exits at once. With --once or "
        "--drain, exits 1 when a row failed or was abandoned."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_relay_options(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"]
        metrics = relay_metrics(options)  # the [prometheus] extra missing: said first
        require_tables(using, OutboxMessage)
        with library_errors():  # a broker URL it cannot use (with --skip-checks)
            relay = Relay(using, batch_size=options["batch_size"])
        if options["once"]:
            with relay:
                finish(self.stdout, once_result(relay.run_once(), using))
            return
        finish(self.stdout, relay_until_stopped(relay, self.stdout, options, metrics))
