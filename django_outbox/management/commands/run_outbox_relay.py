"""``manage.py run_outbox_relay``: publish staged events until stopped."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.models import OutboxMessage
from django_outbox.ops.cli import (
    add_relay_options,
    each,
    finish,
    library_errors,
    relay_metrics,
    require_tables,
    serving,
    stop_on_signals,
)
from django_outbox.ops.reporting import DrainProgress, once_result, run_result
from django_outbox.relay import BatchStats, Relay
from django_outbox.state.status import due_count

logger = logging.getLogger("django_outbox.relay")


class Command(BaseCommand):
    help = (
        "Relay staged outbox events to the broker. Runs until SIGTERM/SIGINT, then finishes "
        "the batch in hand and exits 0; a second signal exits at once. With --once or "
        "--drain, exits 1 when a row failed or was abandoned."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_relay_options(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        using, drain = options["database"], options["drain"]
        metrics = relay_metrics(options)  # the [prometheus] extra missing: said first
        require_tables(using, OutboxMessage)
        with library_errors():  # a broker URL it cannot use (with --skip-checks)
            relay = Relay(using, batch_size=options["batch_size"])
        if options["once"]:
            with relay:
                finish(self.stdout, once_result(relay.run_once(), using))
            return
        stop = threading.Event()
        stop_on_signals(stop, logger, "the batch in hand")
        progress = None
        if drain and self.stdout.isatty():
            progress = DrainProgress(due_count(using))
        started = time.monotonic()
        show = None if progress is None else lambda stats: self._show(progress, stats)
        with serving(metrics, options):
            on_batch = each(show, None if metrics is None else metrics.batch)
            totals = relay.run(stop, drain=drain, on_batch=on_batch)
        if progress is not None and progress.done:
            self.stdout.write("")  # end the progress line
        finish(self.stdout, run_result(totals, time.monotonic() - started, using, drain=drain))

    def _show(self, progress: DrainProgress, stats: BatchStats) -> None:
        self.stdout.write(progress.add(stats), ending="")
        self.stdout.flush()
