"""``manage.py run_outbox_relay``: publish staged events until stopped."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from django_outbox.db import EXACT_COUNT_LIMIT, RowCount
from django_outbox.exceptions import OutboxError
from django_outbox.models import OutboxMessage
from django_outbox.relay import BatchStats, Relay
from django_outbox.status import due_rows, retry_wait

from ._options import add_database_option, positive_int, require_tables, stop_on_signals
from ._text import duration, one_line

logger = logging.getLogger("django_outbox.relay")
#: How many failure reasons --once and --drain print, most rows first.
TOP_REASONS = 5


class Command(BaseCommand):
    help = (
        "Relay staged outbox events to the broker. Runs until SIGTERM/SIGINT, then finishes "
        "the batch in hand and exits 0; a second signal exits at once. With --once or "
        "--drain, exits 1 when a row failed or was abandoned."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--once", action="store_true", help="relay one batch and exit")
        mode.add_argument(
            "--drain",
            action="store_true",
            help="relay until nothing is due, then exit (a progress line on a terminal)",
        )
        parser.add_argument(
            "--batch-size",
            type=positive_int,
            default=None,
            help="rows claimed per batch (default: OUTBOX['BATCH_SIZE'])",
        )
        add_database_option(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        using: str = options["database"]
        require_tables(using, OutboxMessage)
        try:
            relay = Relay(using, batch_size=options["batch_size"])
        except OutboxError as exc:  # a broker URL it cannot use (with --skip-checks)
            raise CommandError(str(exc)) from exc
        if options["once"]:
            with relay:
                stats = relay.run_once()
            self.stdout.write(_summary(stats))
            self._failures(stats, using)
            return
        stop = threading.Event()
        stop_on_signals(stop, logger, "the batch in hand")
        progress = _Progress(self.stdout, using) if options["drain"] else None
        started = time.monotonic()
        totals = relay.run(
            stop, drain=options["drain"], on_batch=progress.update if progress else None
        )
        if progress is not None:
            progress.finish()
        elapsed = time.monotonic() - started
        self.stdout.write(
            f"{_summary(totals)} in {elapsed:.1f}s "
            f"({totals.published / elapsed if elapsed else 0:.0f} events/s)"
        )
        if options["drain"]:
            gave_up = f"--drain gave up: {totals.gave_up}" if totals.gave_up else ""
            self._failures(totals, using, error=gave_up, untried=True)

    def _failures(
        self, stats: BatchStats, using: str, error: str = "", *, untried: bool = False
    ) -> None:
        """Print why rows were not published, how many wait for a retry and (``untried``:
        a drain) how many are due but were never tried; then exit 1 (with ``error``, or
        the counts) if any row failed or was abandoned."""
        reasons, rest = stats.reasons.most_common(TOP_REASONS)
        for reason, count in reasons:
            fate = "abandoned" if reason.abandoned else "failed"
            self.stdout.write(f"{fate} {count} to {reason.destination!r}: {one_line(reason.error)}")
        if rest:
            self.stdout.write(f"and {rest} more {'row' if rest == 1 else 'rows'} for other reasons")
        wait = retry_wait(using)
        if wait.rows.value and wait.next_due_in is not None:
            self.stdout.write(
                f"{_rows(wait.rows, 'waits', 'wait')} for a retry; "
                f"the next is due in {duration(wait.next_due_in)}"
            )
        due = due_rows(using) if untried else None
        if due is not None and due.value:
            self.stdout.write(
                f"{_rows(due, 'is', 'are')} due and {'was' if due.value == 1 else 'were'} "
                "not tried: the drain stopped first"
            )
        if error or stats.unpublished:
            raise CommandError(
                error
                or f"{stats.unpublished} of {stats.claimed} claims in this run were not published: "
                f"failed {stats.failed}, abandoned {stats.abandoned}"
            )


def _rows(count: RowCount, one: str, many: str) -> str:
    """``1 row waits``, ``3 rows wait``, ``more than 10000 rows wait``: a count of rows and
    a verb. Past ``EXACT_COUNT_LIMIT`` the planner's estimate is not shown: after many
    changes since the last ANALYZE it can be off several times over."""
    if not count.exact:
        return f"more than {EXACT_COUNT_LIMIT} rows {many}"
    return f"1 row {one}" if count.value == 1 else f"{count.value} rows {many}"


def _summary(stats: BatchStats) -> str:
    return (
        f"claimed {stats.claimed}, published {stats.published}, failed {stats.failed}, "
        f"abandoned {stats.abandoned}, lease lost {stats.lost}"
    )


class _Progress:
    """A one-line progress display for --drain, shown only on a terminal."""

    def __init__(self, out: Any, using: str) -> None:
        self.out = out
        self.tty = out.isatty()
        self.started = time.monotonic()
        self.done = 0
        self.total = OutboxMessage.objects.using(using).due().count() if self.tty else 0

    def update(self, stats: BatchStats) -> None:
        self.done += stats.claimed
        if not self.tty:
            return
        rate = self.done / max(time.monotonic() - self.started, 1e-9)
        remaining = max(self.total - self.done, 0)
        width = 30
        filled = width if not self.total else min(width, width * self.done // self.total)
        bar = "#" * filled + "-" * (width - filled)
        self.out.write(
            f"\r[{bar}] {self.done}/{self.total} {rate:,.0f} events/s, {remaining} remaining",
            ending="",
        )
        self.out.flush()

    def finish(self) -> None:
        if self.tty and self.done:
            self.out.write("")
