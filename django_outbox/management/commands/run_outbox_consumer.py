"""``manage.py run_outbox_consumer``: handle the events of one queue, once each."""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from django_outbox.ops.cli import (
    add_consumer_options,
    consumer_from_options,
    consumer_metrics,
    finish,
    serving,
    stop_on_signals,
)
from django_outbox.ops.reporting import consumer_result

logger = logging.getLogger("django_outbox.consumer")


class Command(BaseCommand):
    help = (
        "Consume a queue and run a handler for each event through the inbox, so a "
        "redelivered event is acknowledged without running the handler again. Runs until "
        "SIGTERM/SIGINT, then finishes the message in hand and exits 0; a second signal "
        "exits at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        add_consumer_options(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        metrics = consumer_metrics(options)  # the [prometheus] extra missing: said first
        stop = threading.Event()
        consumer = consumer_from_options(options, stop, metrics)
        stop_on_signals(stop, logger, "the message in hand")
        with serving(metrics, options):
            result = consumer_result(consumer, options["idle_timeout"])
        finish(self.stdout, result)
