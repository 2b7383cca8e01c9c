"""What the long-running and replay commands print, and when they exit 1: built
here as plain data (:class:`CommandResult`) so that the wording and the exit rules
are tested without argparse; the commands only print the lines and raise the error."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import kombu.exceptions

from ..consumer.loop import InboxConsumer
from ..consumer.replay import replay_parked
from ..db import EXACT_COUNT_LIMIT, RowCount
from ..exceptions import BrokerUnreachable, OutboxError
from ..models import InboxFailure
from ..relay.loop import BatchStats, RunStats
from ..state.status import (
    RECENT_ROWS,
    BlockedKeys,
    StatusReport,
    blocked_count,
    due_rows,
    retry_wait,
)
from ..workers.heartbeat import OUTAGES, Worker, outages_of
from .text import duration, one_line

#: How many failure reasons ``run_outbox_relay --once`` and ``--drain`` print, most rows first.
TOP_REASONS = 5
#: How many characters wide the progress bar of ``run_outbox_relay --drain`` is.
BAR_WIDTH = 30
#: How many relays and consumers ``outbox_status`` lists, latest beat first.
TOP_WORKERS = 20


@dataclasses.dataclass
class CommandResult:
    """The lines a command prints, and (when not empty) the error it exits 1 with."""

    lines: list[str] = dataclasses.field(default_factory=list)
    error: str = ""


def batch_summary(stats: BatchStats) -> str:
    """``claimed 3, published 2, failed 1, abandoned 0, lease lost 0``, then ``, held
    back 2`` when rows of ordered keys were put back behind a failed row of their key."""
    return (
        f"claimed {stats.claimed}, published {stats.published}, failed {stats.failed}, "
        f"abandoned {stats.abandoned}, lease lost {stats.lost}"
        f"{f', held back {stats.held}' if stats.held else ''}"
    )


def once_result(stats: BatchStats, using: str) -> CommandResult:
    """``run_outbox_relay --once``: the batch's summary and why rows were not published;
    exits 1 when a row failed or was abandoned."""
    return CommandResult([batch_summary(stats), *failure_lines(stats, using)], exit_error(stats))


def run_result(totals: RunStats, elapsed: float, using: str, *, drain: bool) -> CommandResult:
    """``run_outbox_relay`` (and ``--drain``): the run's summary with its rate; a drain
    also says why rows were not published and what it left untried, and exits 1 when a
    row failed or was abandoned, or when it gave up on the broker."""
    rate = totals.published / elapsed if elapsed else 0
    lines = [f"{batch_summary(totals)} in {elapsed:.1f}s ({rate:.0f} events/s)"]
    if not drain:
        return CommandResult(lines)
    gave_up = f"--drain gave up: {totals.gave_up}" if totals.gave_up else ""
    lines += failure_lines(totals, using, untried=True)
    return CommandResult(lines, gave_up or exit_error(totals))


def failure_lines(stats: BatchStats, using: str, *, untried: bool = False) -> list[str]:
    """Why rows were not published (the ``TOP_REASONS`` reasons with most rows), how
    many wait for a retry, (``untried``: a drain) how many are due but were never tried,
    and how many ordered keys are blocked (in the whole outbox, not only this run's)."""
    lines = reason_lines(stats)
    wait = retry_wait(using)
    if wait.rows.value and wait.next_due_in is not None:
        lines.append(
            f"{rows(wait.rows, 'waits', 'wait')} for a retry; "
            f"the next is due in {duration(wait.next_due_in)}"
        )
    due = due_rows(using) if untried else None
    if due is not None and due.value:
        lines.append(
            f"{rows(due, 'is', 'are')} due and {'was' if due.value == 1 else 'were'} "
            "not tried: the drain stopped first"
        )
    blocked = blocked_count(using)
    if blocked.value:
        lines.append(blocked_line(blocked))
    return lines


def blocked_line(blocked: RowCount) -> str:
    """``1 ordered key is blocked ...``: keys no relay publishes until an operator acts."""
    if not blocked.exact:
        keys = f"more than {EXACT_COUNT_LIMIT} ordered keys are"
    else:
        keys = "1 ordered key is" if blocked.value == 1 else f"{blocked.value} ordered keys are"
    return (
        f"{keys} blocked: a head is abandoned and nothing behind it is published "
        "until it is requeued or skipped (outbox_status lists them)"
    )


def reason_lines(stats: BatchStats) -> list[str]:
    """One line per reason rows were not published, the ``TOP_REASONS`` with most rows
    first, and one for the rows of all the others."""
    reasons, rest = stats.reasons.most_common(TOP_REASONS)
    lines = [
        f"{'abandoned' if reason.abandoned else 'failed'} {count} to {reason.destination!r}: "
        f"{one_line(reason.error)}"
        for reason, count in reasons
    ]
    if rest:
        lines.append(f"and {rest} more {'row' if rest == 1 else 'rows'} for other reasons")
    return lines


def exit_error(stats: BatchStats) -> str:
    """Why a run exits 1 (a row failed or was abandoned), or "" when it does not."""
    if not stats.unpublished:
        return ""
    held = (
        f" (and {stats.held} held back behind them: later events of their ordered keys)"
        if stats.held
        else ""
    )
    return (
        f"{stats.unpublished} of {stats.claimed} claims in this run were not published: "
        f"failed {stats.failed}, abandoned {stats.abandoned}{held}"
    )


def rows(count: RowCount, one: str, many: str) -> str:
    """``1 row waits``, ``3 rows wait``, ``more than 10000 rows wait``: a count of rows and
    a verb. Past ``EXACT_COUNT_LIMIT`` the planner's estimate is not shown: after many
    changes since the last ANALYZE it can be off several times over."""
    if not count.exact:
        return f"more than {EXACT_COUNT_LIMIT} rows {many}"
    return f"1 row {one}" if count.value == 1 else f"{count.value} rows {many}"


class DrainProgress:
    """The counting behind the one-line progress display of ``run_outbox_relay --drain``:
    rows done of ``total`` (the rows due when the drain began), the rate, what remains."""

    def __init__(self, total: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = 0
        self._clock = clock
        self._started = clock()

    def add(self, stats: BatchStats) -> str:
        """Count a batch; returns the new display line (to print after a carriage return)."""
        self.done += stats.claimed
        rate = self.done / max(self._clock() - self._started, 1e-9)
        remaining = max(self.total - self.done, 0)
        filled = BAR_WIDTH
        if self.total:
            filled = min(BAR_WIDTH, BAR_WIDTH * self.done // self.total)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return f"\r[{bar}] {self.done}/{self.total} {rate:,.0f} events/s, {remaining} remaining"


def consumer_result(consumer: InboxConsumer, idle_timeout: float | None) -> CommandResult:
    """Run ``consumer`` for ``run_outbox_consumer``: its summary line; on giving up on
    the broker, what it did before, then why (exit 1)."""
    try:
        stats = consumer.run(idle_timeout=idle_timeout)
    except BrokerUnreachable as exc:
        return CommandResult([consumer.stats.summary()], str(exc))
    except OutboxError as exc:
        return CommandResult([], str(exc))
    return CommandResult([stats.summary()])


def replay_result(
    using: str,
    *,
    consumer: str | None = None,
    queue: str | None = None,
    event_ids: Sequence[uuid.UUID] = (),
    dry_run: bool = False,
    confirm_timeout: float | None = None,
) -> CommandResult:
    """``outbox_replay_parked``: replay (or with ``dry_run`` list) the parked messages
    that match, one line each and a count. Every event id given must match a parked
    message, or nothing is replayed (exit 1). ``confirm_timeout``: see :func:`replay_parked`."""
    parked = InboxFailure.objects.using(using).parked()
    parked = parked.filter(**{k: v for k, v in (("consumer", consumer), ("queue", queue)) if v})
    if event_ids:
        parked = parked.filter(event_id__in=event_ids)
        found = set(parked.values_list("event_id", flat=True))
        if missing := [str(i) for i in event_ids if i not in found]:
            return CommandResult(
                [], f"no parked message matches {', '.join(missing)}; nothing replayed"
            )
    if dry_run:
        return CommandResult(_replay_lines("would replay", list(parked.order_by("id"))))
    try:
        replayed = replay_parked(parked, confirm_timeout=confirm_timeout)
        return CommandResult(_replay_lines("replayed", replayed))
    except OutboxError as exc:
        return CommandResult([], str(exc))
    except (kombu.exceptions.OperationalError, OSError) as exc:
        return CommandResult([], f"cannot reach the broker: {exc}")


def _replay_lines(verb: str, failures: list[InboxFailure]) -> list[str]:
    lines = [
        f"{verb} {failure.event_id} ({failure.event_type or 'no event type'}) "
        f"of {failure.consumer} to {failure.queue}: {_first_line(failure.last_error)}"
        for failure in failures
    ]
    count = len(failures)
    return [*lines, f"{verb} {count} parked message{'s' if count != 1 else ''}"]


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else "no error recorded"


def blocked_lines(blocked: BlockedKeys) -> list[str]:
    """``outbox_status``'s "Blocked keys" section: each listed key with its head's id,
    event id, sequence, error, how long it has been blocked and how many events wait,
    then the two commands that release a key; nothing when no key is blocked."""
    if not blocked.count.value:
        return []
    lines = [
        "Blocked keys (their head is abandoned; nothing behind it is published): "
        + _count(blocked.count)
    ]
    for key in blocked.keys:
        since = "?" if key.blocked_for is None else duration(key.blocked_for)
        lines.append(
            f"  {key.destination} {key.ordering_key!r}: head {key.head_id} (event {key.event_id}, "
            f"sequence {key.sequence}), blocked {since}, {key.waiting} waiting: "
            f"{one_line(key.error or 'no error recorded')}"
        )
    if len(blocked.keys) < blocked.count.value:
        lines.append(f"  and more: the {len(blocked.keys)} blocked longest are listed")
    ids = " ".join(str(key.head_id) for key in blocked.keys)
    lines += [
        f"  fix the cause, then publish the heads again: manage.py outbox_requeue --id {ids}",
        f"  or give up on them (consumers get skip markers): manage.py outbox_skip --id {ids}",
    ]
    return lines


def _count(count: RowCount) -> str:
    return str(count.value) if count.exact else f"more than {EXACT_COUNT_LIMIT}"


def worker_lines(workers: list[Worker]) -> list[str]:
    """``outbox_status``'s "Relays and consumers" section: a count per state, then the
    ``TOP_WORKERS`` latest to beat, one line each; nothing when none ever beat."""
    if not workers:
        return []
    states: dict[str, int] = {}
    for worker in workers:
        states[worker.state] = states.get(worker.state, 0) + 1
    tally = ", ".join(f"{count} {state}" for state, count in sorted(states.items()))
    lines = [f"relays and consumers (latest beat first): {tally}"]
    for worker in workers[:TOP_WORKERS]:
        row = worker.row
        name = f" {row.name}" if row.name else ""
        counts = ", ".join(
            [f"{key} {value}" for key, value in row.counts.items() if value and key != OUTAGES]
            + [
                f"{what} down {duration(dt.timedelta(seconds=s))}"
                for what, s in outages_of(row).items()
            ]
        )
        lines.append(
            f"  {row.kind:<8} {worker.state:<7} {row.worker}{name}: "
            f"beat {duration(worker.beat_age)} ago{f', {counts}' if counts else ''}"
        )
    if len(workers) > TOP_WORKERS:
        lines.append(f"  and {len(workers) - TOP_WORKERS} more")
    return lines


def status_lines(status: StatusReport) -> list[str]:
    """``outbox_status``'s text: the rows per state, the oldest due row's age, failed rows
    by attempts, the busiest ordering keys, the blocked keys, the most frequent recent
    errors and the parked inbox messages per consumer (then come :func:`worker_lines`)."""
    lines = ["state        rows", *(f"{state:<12} {n}" for state, n in status.counts.items())]
    lines.append(f"scheduled    {status.scheduled} (pending, not due yet: not in pending)")
    age = status.oldest_due_age
    lines.append(
        "oldest due row: "
        + ("none (nothing is due)" if age is None else f"{age.total_seconds():.1f}s old")
    )
    if status.failing_attempts:
        lines.append("failed rows by attempts made:")
        lines += [f"  {tries:>3} attempts: {n}" for tries, n in status.failing_attempts.items()]
    if status.top_keys:
        lines.append("ordering keys with the most rows waiting:")
        lines += [f"  {count:>7}  {key}" for key, count in status.top_keys]
    lines += blocked_lines(status.blocked)
    if status.recent_errors:
        lines.append(f"most frequent errors of the latest {RECENT_ROWS} failed and abandoned rows:")
        for error in status.recent_errors:
            text = one_line(error.error or "no error recorded")  # abandoned by an operator
            lines.append(f"  {error.rows:>7}  {error.status:<9}  {text}")
    if status.parked:
        lines.append("parked inbox messages by consumer (the newest one's error):")
        lines += [
            f"  {parked.rows:>7}  {parked.consumer}: {one_line(parked.newest_error)}"
            for parked in status.parked
        ]
    return lines


def status_json(status: StatusReport, workers: list[Worker], using: str) -> dict[str, Any]:
    """``outbox_status --json``: the report as plain JSON values (durations in seconds,
    times in ISO 8601, ids as text), and every relay and consumer with its state."""
    report = _plain(dataclasses.asdict(status))
    report["failing_attempts"] = {str(k): v for k, v in status.failing_attempts.items()}
    report["top_keys"] = [{"ordering_key": k, "rows": n} for k, n in status.top_keys]
    report["workers"] = [worker.as_dict() for worker in workers]
    return {"database": using, **report}


def _plain(value: Any) -> Any:
    """``value`` with timedeltas as seconds, datetimes as ISO text and UUIDs as text."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dt.timedelta):
        return round(value.total_seconds(), 3)
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value
