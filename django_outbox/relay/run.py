"""The relay's loop: :class:`Run` is one run of :meth:`Relay.run
<django_outbox.relay.Relay.run>`, and everything it carries from one batch to the next:
its components (the wake-up, the pipeline, the retention and heartbeat threads), its
outage record (:class:`~django_outbox.relay.outages.Outages`, and a tracker for the
database), the claim made ahead, and its totals. The relay itself keeps none of it.

Its records come from the logger ``django_outbox.relay``, the name the runbook documents.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import math
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from django.db import DatabaseError, close_old_connections, connections
from django.utils import timezone

from .. import db
from ..conf import outbox_settings
from ..models import WorkerKind
from ..workers import samples
from ..workers.heartbeat import OUTAGES, Heartbeat, HeartbeatThread
from ..workers.outage import database_outage
from . import retention
from .batch import Batch, Batches, Claim
from .outages import Outages
from .pipeline import Pipeline
from .report import COUNTED, BatchStats, Finalized, RunStats
from .wakeup import WakeUp

logger = logging.getLogger("django_outbox.relay")  # the name the runbook documents

#: The interpreter's thread switch interval while :meth:`Relay.run` runs (seconds;
#: CPython's default is 5 ms). The relay's thread publishes in pure Python for
#: milliseconds on end, and a database thread whose statement came back waited up to the
#: interval for the GIL before it could read the rows and send the next claim. In eight
#: alternated Redis drains of 20,000 events each, 1 ms against 5: `redis_vs_pipeline`
#: 0.287 against 0.274 (six pairs in favour).
SWITCH_INTERVAL = 0.001

#: Seconds a relay whose batch caught up (finalized at once, on the relay's thread) waits
#: for a NOTIFY before it rests: a commit meanwhile is claimed at once, without the rest's
#: connection checks, and the batch is reported before the rest.
CAUGHT_UP_WAIT = 0.05


class Run:
    """One run of a relay over ``batches`` (on the database ``using``), until ``stop``
    is set or, with ``drain``, until nothing is due or a broker cannot be reached;
    ``on_batch`` is called with each batch's stats. Use it as a context manager: its
    threads start on entry and stop, the broker connections closed, on exit."""

    def __init__(
        self,
        batches: Batches,
        stop: threading.Event,
        *,
        drain: bool,
        on_batch: Callable[[BatchStats], None] | None,
    ) -> None:
        self.batches = batches
        self.using = batches.using
        self.stop = stop
        self.drain = drain
        self.on_batch = on_batch
        self.wakeup = WakeUp(
            stop,
            functools.partial(db.listen, self.using),
            outbox_settings.POLL_INTERVAL,
            using=self.using,
        )
        self.database = database_outage(self.using)
        self.outages = Outages(batches.publisher.describe)
        self.pipeline: Pipeline[Claim, Batch, Finalized] = Pipeline(
            self.using,
            claim=batches.claim,
            finalize=batches.finalize,
            report=lambda done: self._tally(batches.report(done)),
            threaded=db.supports_skip_locked(connections[self.using]),
        )
        self.retention_thread: retention.RetentionThread | None = None
        #: A running relay's heartbeat (a drain has none), and its last batch with rows.
        self.heartbeat: HeartbeatThread | None = None
        self.last_batch_at: dt.datetime | None = None
        self.totals = RunStats()
        #: A claim made while the previous batch was being published; it is always
        #: published, even after a stop request, so that no row waits for its lease.
        self.ahead: Callable[[], Claim | None] | None = None
        self.done = False  # a drain that ran dry or gave up on the broker
        #: The last batch caught up with what was due (``_caught_up``: its claim saw every
        #: due row and left none out, it freed none, and the listener hears NOTIFYs): the
        #: relay rests until a NOTIFY (or the poll interval) instead of claiming again at
        #: once (two claims that would mostly come back empty).
        self.caught_up = False
        #: A batch that may free rows (ordered rows, a failure) was handed to the finalize
        #: since the pipeline was last empty: a claim made meanwhile may have missed them.
        self.freeing = False
        #: When the first row not due at the last claim comes due (monotonic clock; inf:
        #: none), as that claim said; None after a claim that found nothing: the rest asks.
        self.due_at: float | None = None

    def __enter__(self) -> Run:
        if not self.drain:  # a drain leaves the table as it is, but for the rows it relays
            interval = outbox_settings.CLEANUP_INTERVAL
            self.retention_thread = retention.RetentionThread(
                self.using, interval=interval, first_in=random.uniform(0, interval)
            )
            self.retention_thread.start()
            self.heartbeat = HeartbeatThread(
                Heartbeat(WorkerKind.RELAY, self.batches.worker, self.using),
                self._snapshot,
                after_beat=functools.partial(_sample, self.using),
            )
            self.heartbeat.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Settle the pipeline, stop retention, close the listener and the brokers, and
        this thread's database connection unless a transaction holds it: a relay run in
        a thread of its own leaves none open when the thread ends (the garbage collector
        would find it later, wherever the process is then)."""
        try:
            self.pipeline.close()
        finally:
            if self.retention_thread is not None:
                self.retention_thread.stop()
            if self.heartbeat is not None:
                self.heartbeat.stop()
            self.wakeup.close()
            self.batches.publisher.close()
            if not connections[self.using].in_atomic_block:
                connections[self.using].close()

    def loop(self) -> RunStats:
        """Publish batches until stopped (the claim made ahead published) or drained;
        returns the totals."""
        if not self.drain:  # relays started together (a deploy) do not claim and poll in step
            self.stop.wait(random.uniform(0, outbox_settings.START_JITTER))
        while not self.done and (not self.stop.is_set() or self.ahead is not None):
            if not self._brokers_ready():
                self._wait_for_broker()  # a drain gives up instead
            elif not self._turn():  # nothing was due
                self._rest()  # a drain is done instead
        return self.totals

    def _brokers_ready(self) -> bool:
        """Whether to go on publishing: yes with a claim made ahead (it is published
        whatever the brokers' state: its rows are not attempted on a broker known to be
        down), or while a broker is up. Brokers that are down and due are checked again
        (a drain gives up on one that is still down)."""
        if self.ahead is not None:
            return True
        publisher = self.batches.publisher
        for key in self.outages.due(time.monotonic()):
            error = self.outages.check(key, publisher.transports[key], log=not self.drain)
            if error is not None and self.drain:
                self.totals.gave_up = publisher.unreachable(key, error)
        if self.totals.gave_up:
            return False  # a drain gives up on a broker that is down
        return self.outages.any_up(publisher.keys())  # wait only when every broker is down

    def _wait_for_broker(self) -> None:
        """Back off until the next broker that is down is due to be checked again; a
        drain gives up instead."""
        if self.drain:
            self.done = True
        else:
            soonest = self.outages.next_check()
            if soonest is not None:
                self.stop.wait(max(0.0, soonest - time.monotonic()))

    def _rest(self) -> None:
        """Nothing is due: honour ``CONN_MAX_AGE`` on every database thread, then wait for a
        wake-up, the poll interval or stop; a drain is done instead."""
        if self.drain:
            self.done = True
            return
        close_old_connections()
        self.pipeline.close_old_connections()
        self.wakeup.wait(self._until_due())

    def _until_due(self) -> float:
        """How long a wait for a NOTIFY lasts at most: until the first row that was not
        due comes due (a scheduled event, a retry: no NOTIFY announces it), within the
        poll interval. After a claim that found nothing, asked now (``db.next_due_in``); a
        database error leaves the poll interval (the next claim rides out the outage)."""
        due_at = self.due_at
        if due_at is None:
            try:
                seconds = db.next_due_in(self.using)
            except DatabaseError:
                return self.wakeup.poll_interval
            due_at = math.inf if seconds is None else time.monotonic() + seconds
        return min(max(due_at - time.monotonic(), 0.0), self.wakeup.poll_interval)

    def _turn(self) -> bool:
        """Publish a batch, or ride out a database error; False when the relay is to
        rest: nothing was due, or the batch caught up with what was (``caught_up``)."""
        try:
            batch = self._next_batch()
        except DatabaseError as exc:
            self._database_failed(exc)
            return True
        return batch is not None and not self.caught_up

    def _next_batch(self) -> Batch | None:
        """One batch: take the claim made ahead (or claim now), claim the next one ahead
        when this one was full, publish, and hand the batch to the pipeline, which
        reports the batches it finished. Returns the batch, or None when nothing was due."""
        if self.ahead is not None:
            claim, self.ahead = self.ahead(), None
            settled = False  # made beside the batch before it
        else:
            if not self.drain:
                self.wakeup.listen()
            settled = self._settled()
            claim = self.batches.claim()
        if claim is None and (self.pipeline.pending or self.drain):
            # The heads of ordered keys may be in the batch still being finalized:
            # finish it and claim once more (whole, draining) before taking the table
            # for empty.
            self.pipeline.collect(everything=True)
            settled = self._settled()  # True, and the batches collected forgotten
            claim = self.batches.claim(whole=self.drain)
        batch, self.caught_up, self.due_at = None, False, _due_at(claim)
        if claim is not None:
            batch = self._publish(claim, settled)
        if self.caught_up and (
            self.wakeup.wait(min(CAUGHT_UP_WAIT, self._until_due())) or not self.wakeup.heard
        ):
            # A NOTIFY came (or the listener broke): claim at once, as after a batch that
            # did not catch up.
            self.caught_up = False
        if batch is None or self.caught_up or not self.pipeline.threaded:
            # Before the rest, and, without database threads, before the next claim (which
            # would miss the rows this batch frees: an ordered key's next ones).
            self.pipeline.collect(everything=True)
        self.database.recovered()
        return batch

    def _publish(self, claim: Claim, settled: bool) -> Batch:
        """Claim the next batch ahead when ``claim`` was full, publish ``claim`` and hand
        it to the pipeline (to be finalized here when it caught up with what was due)."""
        more_due = len(claim.messages) == self.batches.batch_size
        if more_due and not (self.stop.is_set() or self.outages.down()):
            self.ahead = self.pipeline.claim_ahead()
        # The batch before the last one is reported now, while the next claim runs.
        self.pipeline.collect(everything=False)
        batch = self.batches.publish(claim, self.outages)
        frees = batch.frees_rows
        self.freeing |= frees
        self.caught_up = settled and not (more_due or frees) and self._caught_up(claim)
        self.pipeline.finalize(batch, gate=batch.ordered, here=self.caught_up)
        return batch

    def _caught_up(self, claim: Claim) -> bool:
        """Whether a batch that frees no rows, whose claim was neither full nor made
        beside a finalize that may free rows, left nothing due that a NOTIFY would not
        announce: its claim left no row out, and NOTIFYs reach the relay (its listener
        has heard one). A drain and a relay that only polls claim until a claim comes
        back empty."""
        if claim.messages.left_behind or self.drain:
            return False
        return self.wakeup.heard

    def _settled(self) -> bool:
        """Whether a claim made now sees every row the batches handed to the finalize
        free: none of them can free any, or the pipeline finished them all."""
        if not self.pipeline.pending:
            self.freeing = False
        return not self.freeing

    def _database_failed(self, exc: DatabaseError) -> None:
        """Log the outage, give up the claim made ahead (its rows wait for their lease),
        settle the pipeline, close every connection of this relay (every thread's and the
        listener's: the outage broke those not in use too), and back off."""
        self.database.failed(exc)
        self.ahead = None
        self.pipeline.settle()
        connections[self.using].close()
        self.pipeline.close_connection()
        self.wakeup.close()
        self.stop.wait(self.database.backoff())

    def _snapshot(self) -> tuple[dict[str, Any], dt.datetime | None]:
        """The totals, what is down (for ``outbox_health``) and the last batch with rows,
        for the heartbeat."""
        counts: dict[str, Any] = {field: getattr(self.totals, field) for field in COUNTED}
        down = self.outages.lasting()
        if down:
            counts[OUTAGES] = down
        return counts, self.last_batch_at

    def _tally(self, stats: BatchStats) -> None:
        self.totals.add(stats)
        if stats.claimed:
            self.last_batch_at = timezone.now()
        if self.on_batch is not None:
            self.on_batch(stats)


def _due_at(claim: Claim | None) -> float | None:
    """When the first row not due at ``claim`` comes due (``Run.due_at``)."""
    if claim is None:
        return None
    seconds = claim.messages.next_due_in
    return math.inf if seconds is None else claim.started + seconds


@contextlib.contextmanager
def quick_switches() -> Iterator[None]:
    """Run with a switch interval of at most :data:`SWITCH_INTERVAL`; the one before is
    set back at the end."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _sample(using: str) -> None:
    """Take this minute's sample of the outbox (the admin's chart) unless another relay
    took it. On the heartbeat's thread: nothing raised here may end it, and nothing here
    touches the relay's batches."""
    try:
        samples.record_sample(using)
    except DatabaseError as exc:  # an outage: the relay's loop reports it
        logger.debug("sample not taken: %s", exc, extra={"action": "outbox.sample_failed"})
    except Exception:
        logger.exception("sample not taken", extra={"action": "outbox.sample_failed"})
