"""Pipeline: the claim-ahead pipeline gets callables (claim, finalize, report), and
no batch's report is lost when a later batch's finalize fails. No services: the
callables are plain functions and the database error is raised by one of them."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from django.db import DatabaseError
from django.test import override_settings

from django_outbox.relay.pipeline import Pipeline


class Work:
    """claim/finalize/report callables that record what they were given."""

    def __init__(self, fail_on: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.fail_on = fail_on
        self.claims = 0
        self.threads: list[str] = []
        self.reported: list[str] = []

    def claim(self) -> str | None:
        self.claims += 1
        self.threads.append(threading.current_thread().name)
        return f"claim {self.claims}"

    def finalize(self, batch: str) -> str:
        self.threads.append(threading.current_thread().name)
        if batch in self.fail_on:
            raise DatabaseError(f"finalizing {batch} failed")
        return f"{batch} finalized"

    def report(self, done: str) -> None:
        self.reported.append(done)


def pipeline(work: Work, *, threaded: bool) -> Pipeline[str, str, str]:
    return Pipeline(
        "default",
        claim=work.claim,
        finalize=work.finalize,
        report=work.report,
        threaded=threaded,
    )


@pytest.mark.parametrize("threaded", [True, False])
def test_a_failed_finalize_loses_no_earlier_batch_report(threaded):
    """Two batches wait to be finalized; the second's finalize fails: the first is
    reported all the same (the old pipeline gathered the reports in a local list,
    and the error discarded the first batch's)."""
    work = Work(fail_on={"b2"})
    stages = pipeline(work, threaded=threaded)
    stages.finalize("b1")
    stages.finalize("b2")
    stages.finalize("b3")
    with pytest.raises(DatabaseError, match="finalizing b2 failed"):
        stages.collect(everything=True)
    assert work.reported == ["b1 finalized"]
    stages.settle()
    assert work.reported == ["b1 finalized", "b3 finalized"]
    stages.close()


def test_settle_reports_every_batch_whose_finalize_succeeded():
    work = Work(fail_on={"b1", "b3"})
    stages = pipeline(work, threaded=True)
    for batch in ("b1", "b2", "b3", "b4"):
        stages.finalize(batch)
    stages.settle()
    assert work.reported == ["b2 finalized", "b4 finalized"]
    stages.close()


def test_threaded_the_newest_batch_is_left_to_finalize_while_the_next_publishes():
    work = Work()
    stages = pipeline(work, threaded=True)
    stages.finalize("b1")
    stages.collect(everything=False)
    assert work.reported == []  # b1 may still be finalizing on the database thread
    stages.finalize("b2")
    stages.collect(everything=False)
    assert work.reported == ["b1 finalized"]
    stages.collect(everything=True)
    assert work.reported == ["b1 finalized", "b2 finalized"]
    stages.close()
    assert set(work.threads) == {"outbox-finalize_0"}


def test_threaded_a_claim_ahead_runs_on_the_claim_thread():
    work = Work()
    stages = pipeline(work, threaded=True)
    ahead = stages.claim_ahead()
    assert ahead is not None
    assert ahead() == "claim 1"
    assert work.threads == ["outbox-claim_0"]
    stages.close()


class HeldFinalize(Work):
    """A finalize that waits until the test lets it go: what runs meanwhile, runs beside
    it. Each wait is bounded, so that a test that fails does not hang."""

    def __init__(self) -> None:
        super().__init__()
        self.finalizing = threading.Event()
        self.release = threading.Event()

    def finalize(self, batch: str) -> str:
        self.finalizing.set()
        assert self.release.wait(10), "the test never released the finalize"
        return super().finalize(batch)


def test_threaded_a_claim_ahead_runs_while_a_batch_finalizes():
    """The claim and the finalize have a thread (and a connection) each: a claim ahead
    is not queued behind the finalize of the batch before it."""
    work = HeldFinalize()
    stages = pipeline(work, threaded=True)
    stages.finalize("b1")
    assert work.finalizing.wait(10)
    ahead = stages.claim_ahead()
    assert ahead is not None
    assert ahead() == "claim 1"  # while b1's finalize is held
    assert work.reported == []
    work.release.set()
    stages.close()
    assert work.reported == ["b1 finalized"]


def test_threaded_a_claim_ahead_waits_for_the_finalize_that_gates_it():
    """A batch with ordered rows gates the next claim: its keys' next rows are
    claimable only once it is finalized, so the claim starts after that, not beside it."""
    work = HeldFinalize()
    stages = pipeline(work, threaded=True)
    stages.finalize("b1", gate=True)
    assert work.finalizing.wait(10)
    ahead = stages.claim_ahead()
    assert ahead is not None
    time.sleep(0.2)  # room for a claim that would not wait (the next line would see it)
    assert work.claims == 0
    work.release.set()
    assert ahead() == "claim 1"
    assert work.threads == ["outbox-finalize_0", "outbox-claim_0"]
    stages.close()


def test_threaded_a_gate_a_claim_already_waited_for_holds_no_later_claim():
    work = HeldFinalize()
    work.release.set()
    stages = pipeline(work, threaded=True)
    stages.finalize("b1", gate=True)
    first = stages.claim_ahead()
    assert first is not None and first() == "claim 1"
    work.release.clear()
    work.finalizing.clear()
    stages.finalize("b2")  # no gate: the next claim runs beside it
    assert work.finalizing.wait(10)
    second = stages.claim_ahead()
    assert second is not None and second() == "claim 2"
    work.release.set()
    stages.close()
    assert work.reported == ["b1 finalized", "b2 finalized"]


def test_threaded_no_claim_is_made_after_a_failed_gate_whose_error_the_collector_raises():
    """The relay drops the claim made ahead when the collector raises: a claim made after
    the gate failed would lease its rows for nothing."""
    work = Work(fail_on={"b1"})
    stages = pipeline(work, threaded=True)
    stages.finalize("b1", gate=True)
    ahead = stages.claim_ahead()
    assert ahead is not None and ahead() is None
    assert work.claims == 0
    with pytest.raises(DatabaseError, match="finalizing b1 failed"):
        stages.collect(everything=True)
    later = stages.claim_ahead()  # the failed gate holds back no later claim
    assert later is not None and later() == "claim 1"
    stages.close()


def test_threaded_a_failed_gate_settled_after_an_outage_holds_back_no_claim():
    work = Work(fail_on={"b1"})
    stages = pipeline(work, threaded=True)
    stages.finalize("b1", gate=True)
    stages.settle()  # the relay's outage path: the failed batch is given up
    ahead = stages.claim_ahead()
    assert ahead is not None and ahead() == "claim 1"
    stages.close()


def test_close_ends_the_database_threads_though_a_report_raises():
    work = Work()
    stages = pipeline(work, threaded=True)
    stages._report = lambda done: 1 / 0  # type: ignore[method-assign]  # a broken report
    stages.finalize("b1")
    with pytest.raises(ZeroDivisionError):
        stages.close()
    names = {thread.name for thread in threading.enumerate()}
    assert not {"outbox-claim_0", "outbox-finalize_0"} & names


def test_threaded_a_batch_finalized_here_runs_on_the_callers_thread_after_the_others():
    """A relay whose batch caught up finalizes it itself: the batches before it are
    finalized (on the database thread) and reported first, and the finalize thread is
    not woken for it."""
    work = HeldFinalize()
    stages = pipeline(work, threaded=True)
    stages.finalize("b1")
    assert work.finalizing.wait(10)
    threading.Timer(0.2, work.release.set).start()  # b2 must wait for b1's finalize
    stages.finalize("b2", here=True)
    assert work.reported == ["b1 finalized"]
    assert work.threads == ["outbox-finalize_0", threading.current_thread().name]
    stages.collect(everything=True)
    assert work.reported == ["b1 finalized", "b2 finalized"]
    stages.close()


def test_threaded_a_finalize_here_that_fails_raises_when_collected():
    """As a database thread's: finalize() returns, the collector raises the error. The
    next batch finalized here collects it first: the error is raised once that batch is
    finalized all the same, and that batch is reported by the settle after the outage."""
    work = Work(fail_on={"b1"})
    stages = pipeline(work, threaded=True)
    stages.finalize("b1", here=True)
    with pytest.raises(DatabaseError, match="finalizing b1 failed"):
        stages.finalize("b2", here=True)
    assert work.threads == [threading.current_thread().name] * 2
    assert work.reported == []
    stages.settle()
    assert work.reported == ["b2 finalized"]
    stages.close()


def test_threaded_a_failed_finalize_here_closes_the_callers_connection_and_gates_as_a_thread():
    """As on a database thread: the connection the error broke is closed (the next claim
    opens a fresh one), and a failed gate holds back the claim ahead the collector's
    error would make the relay drop."""
    closed: list[str] = []
    work = Work(fail_on={"b1"})
    stages = pipeline(work, threaded=True)
    stages._close_connection = lambda: closed.append(threading.current_thread().name)  # type: ignore[method-assign]
    stages.finalize("b1", gate=True, here=True)
    assert closed == [threading.current_thread().name]
    ahead = stages.claim_ahead()
    assert ahead is not None and ahead() is None
    assert work.claims == 0
    stages.settle()
    stages.close()


def test_threaded_each_database_thread_closes_its_connection():
    closed: list[str] = []
    work = Work()
    stages = pipeline(work, threaded=True)
    stages._close_connection = lambda: closed.append(threading.current_thread().name)  # type: ignore[method-assign]
    stages.close_connection()
    assert sorted(closed) == ["outbox-claim_0", "outbox-finalize_0"]
    stages.close()


def test_inline_nothing_is_claimed_ahead_and_each_batch_is_finalized_when_collected():
    work = Work()
    stages = pipeline(work, threaded=False)
    assert stages.claim_ahead() is None
    stages.finalize("b1")
    assert work.threads == []  # not yet
    stages.collect(everything=False)
    assert work.reported == ["b1 finalized"]
    assert work.threads == [threading.current_thread().name]
    stages.close()


def test_close_settles_the_batches_left():
    work = Work()
    stages = pipeline(work, threaded=True)
    stages.finalize("b1")
    stages.finalize("b2")
    stages.close()
    assert work.reported == ["b1 finalized", "b2 finalized"]


def test_a_password_in_a_finalize_error_never_reaches_the_debug_log(caplog):
    # settle() logs a given-up batch's error with its traceback (at DEBUG).
    secret_batch = "claim amqp://u:s3cret-pw@h//"
    work = Work(fail_on={secret_batch})
    outbox = {"BROKER_URL": "amqp://u:s3cret-pw@h//"}
    debug = caplog.at_level(logging.DEBUG, logger="django_outbox.pipeline")
    with override_settings(OUTBOX=outbox), debug:
        line = pipeline(work, threaded=False)
        line.finalize(secret_batch)
        line.settle()
    assert "finalizing claim amqp://u:***@h// failed" in caplog.text
    assert "s3cret-pw" not in caplog.text
