"""What run_outbox_relay prints and when it exits 1, built without argparse or a
database: the summary lines, the reasons, the exit rule, the progress bar's counting."""

from __future__ import annotations

import datetime as dt
import uuid

from django_outbox.db import RowCount
from django_outbox.ops.reporting import (
    DrainProgress,
    batch_summary,
    blocked_line,
    blocked_lines,
    exit_error,
    reason_lines,
    rows,
    run_result,
)
from django_outbox.relay import BatchStats, RunStats
from django_outbox.relay.failures import Reason
from django_outbox.state.status import BlockedKey, BlockedKeys


def stats(**counts: int) -> BatchStats:
    return BatchStats(**counts)


def test_the_summary_line():
    line = batch_summary(stats(claimed=5, published=2, failed=1, abandoned=1, lost=1))
    assert line == "claimed 5, published 2, failed 1, abandoned 1, lease lost 1"


def test_the_summary_line_counts_rows_held_back_behind_a_failed_row_of_their_key():
    line = batch_summary(stats(claimed=3, published=1, abandoned=1, held=1))
    assert line == "claimed 3, published 1, failed 0, abandoned 1, lease lost 0, held back 1"
    assert exit_error(stats(claimed=3, published=1, abandoned=1, held=1)) == (
        "1 of 3 claims in this run were not published: failed 0, abandoned 1 "
        "(and 1 held back behind them: later events of their ordered keys)"
    )


def test_the_line_that_says_ordered_keys_are_blocked():
    assert blocked_line(RowCount(1, True)) == (
        "1 ordered key is blocked: a head is abandoned and nothing behind it is published "
        "until it is requeued or skipped (outbox_status lists them)"
    )
    assert blocked_line(RowCount(3, True)).startswith("3 ordered keys are blocked: ")
    assert blocked_line(RowCount(10_500, False)).startswith("more than 10000 ordered keys are")


def test_a_run_that_is_not_a_drain_prints_its_rate_and_exits_0_whatever_failed():
    totals = RunStats(claimed=300, published=240, failed=60)
    result = run_result(totals, 2.0, "default", drain=False)
    assert result.lines == [
        "claimed 300, published 240, failed 60, abandoned 0, lease lost 0 in 2.0s (120 events/s)"
    ]
    assert result.error == ""


def test_exit_1_when_a_row_failed_or_was_abandoned():
    assert exit_error(stats(claimed=4, published=4)) == ""
    assert exit_error(stats(claimed=4, published=4, lost=2)) == ""  # lost: another relay's now
    assert exit_error(stats(claimed=5, published=2, failed=2, abandoned=1)) == (
        "3 of 5 claims in this run were not published: failed 2, abandoned 1"
    )


def test_the_reasons_most_rows_first_on_one_line_each():
    batch = stats(claimed=10, failed=8, abandoned=2)
    batch.reasons.add(Reason("orders", "ConnectionRefused:\nrefused", False), 2)
    batch.reasons.add(Reason("orders", "NOT_FOUND - no exchange", True), 2)
    for n in range(6):
        batch.reasons.add(Reason("audit", f"timeout {n}", False), 1)
    assert reason_lines(batch) == [
        "failed 2 to 'orders': ConnectionRefused: refused",
        "abandoned 2 to 'orders': NOT_FOUND - no exchange",
        "failed 1 to 'audit': timeout 0",
        "failed 1 to 'audit': timeout 1",
        "failed 1 to 'audit': timeout 2",
        "and 3 more rows for other reasons",
    ]


def test_counts_of_rows_read_as_words():
    assert rows(RowCount(1, True), "waits", "wait") == "1 row waits"
    assert rows(RowCount(3, True), "waits", "wait") == "3 rows wait"
    assert rows(RowCount(99999, False), "is", "are") == "more than 10000 rows are"


def test_the_progress_bar_counts_the_rows_of_each_batch():
    now = [0.0]
    progress = DrainProgress(200, clock=lambda: now[0])
    now[0] = 2.0
    assert progress.add(stats(claimed=50)) == (
        "\r[#######-----------------------] 50/200 25 events/s, 150 remaining"
    )
    now[0] = 4.0
    line = progress.add(stats(claimed=200))  # more than were due when it began
    assert line == "\r[##############################] 250/200 62 events/s, 0 remaining"
    assert progress.done == 250


def test_with_nothing_due_at_the_start_the_bar_is_full():
    progress = DrainProgress(0, clock=lambda: 1.0)
    assert progress.add(stats(claimed=10)).startswith("\r[" + "#" * 30 + "] 10/0 ")


def _blocked(head_id: int, error: str = "boom", since: dt.timedelta | None = None) -> BlockedKey:
    return BlockedKey(
        destination="orders",
        ordering_key=f"order-{head_id}",
        head_id=head_id,
        event_id=uuid.UUID(int=head_id),
        sequence=4,
        error=error,
        blocked_for=since,
        waiting=2,
    )


def test_no_blocked_section_without_blocked_keys():
    assert blocked_lines(BlockedKeys(RowCount(0, exact=True), [])) == []


def test_the_blocked_section_names_every_listed_head_in_its_commands():
    keys = [_blocked(7, "poison\nwith a traceback", dt.timedelta(seconds=30)), _blocked(9, "")]
    lines = blocked_lines(BlockedKeys(RowCount(2, exact=True), keys))
    assert lines == [
        "Blocked keys (their head is abandoned; nothing behind it is published): 2",
        f"  orders 'order-7': head 7 (event {uuid.UUID(int=7)}, sequence 4), blocked 30s, "
        "2 waiting: poison with a traceback",
        f"  orders 'order-9': head 9 (event {uuid.UUID(int=9)}, sequence 4), blocked ?, "
        "2 waiting: no error recorded",
        "  fix the cause, then publish the heads again: manage.py outbox_requeue --id 7 9",
        "  or give up on them (consumers get skip markers): manage.py outbox_skip --id 7 9",
    ]


def test_the_blocked_section_says_when_more_keys_are_blocked_than_listed():
    lines = blocked_lines(BlockedKeys(RowCount(10_500, exact=False), [_blocked(1)]))
    assert lines[0].endswith(": more than 10000")
    assert "  and more: the 1 blocked longest are listed" in lines
