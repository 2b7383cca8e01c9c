"""The relay's claim-ahead pipeline: the database work of neighbouring batches on
threads of their own while the relay's thread publishes."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, close_old_connections, connections

from ..conf import outbox_settings
from ..conf.redact import SecretFilter

logger = logging.getLogger("django_outbox.pipeline")
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

ClaimT = TypeVar("ClaimT")
BatchT = TypeVar("BatchT")
DoneT = TypeVar("DoneT")
T = TypeVar("T")


class Pipeline(Generic[ClaimT, BatchT, DoneT]):
    """Claims the next batch (when the last one was full) on one database thread and
    finalizes the batch just published on another, each with its own connection to
    ``using``, while the caller publishes: the claim and the finalize, each about as
    long as a batch's publish on a fast broker, overlap it and each other. At most one
    batch waits to be finalized while the next one is published.

    A claim made ahead waits for the finalizes that ``gate`` it (batches with ordered
    rows: a key's next rows are claimable only once the batch holding its previous
    ones is finalized); others run beside it.

    It knows the relay only by three callables: ``claim()`` (a claim, or None when
    nothing is due), ``finalize(batch)`` (the database writes of a published batch)
    and ``report(finalized)`` (log, signal and count it). Each batch is reported when
    the caller next collects after its finalize, so a later batch whose finalize fails
    loses no earlier batch's report. A batch the caller will not publish beside (the
    relay's last before it waits for a NOTIFY) may be finalized on the caller's thread
    instead (``finalize(batch, here=True)``).

    Without ``threaded`` (a database that takes one writer at a time, no SKIP
    LOCKED: SQLite) nothing is claimed ahead and each batch is finalized inline
    when collected, before the next claim.
    """

    def __init__(
        self,
        using: str,
        *,
        claim: Callable[[], ClaimT | None],
        finalize: Callable[[BatchT], DoneT],
        report: Callable[[DoneT], object],
        threaded: bool,
    ) -> None:
        self.using = using
        self._claim = claim
        self._finalize = finalize
        self._report = report
        self._pending: collections.deque[Callable[[], DoneT]] = collections.deque()
        self._gates: list[Future[DoneT]] = []  # finalizes the next claim ahead waits for
        self._claimer: ThreadPoolExecutor | None = None
        self._finalizer: ThreadPoolExecutor | None = None
        if threaded:
            self._claimer = ThreadPoolExecutor(1, thread_name_prefix="outbox-claim")
            self._finalizer = ThreadPoolExecutor(1, thread_name_prefix="outbox-finalize")

    @property
    def _threads(self) -> list[ThreadPoolExecutor]:
        return [executor for executor in (self._claimer, self._finalizer) if executor]

    @property
    def threaded(self) -> bool:
        """Whether the claims ahead and the finalizes run on threads of their own (else
        nothing is claimed ahead and each batch is finalized when collected)."""
        return self._finalizer is not None

    @property
    def pending(self) -> bool:
        """Whether a batch handed to :meth:`finalize` is not collected yet."""
        return bool(self._pending)

    def claim_ahead(self) -> Callable[[], ClaimT | None] | None:
        """Start claiming the next batch, once the finalizes that gate it are done;
        returns how to wait for it (None: not here)."""
        if self._claimer is None:
            return None
        gates, self._gates = self._gates, []
        return self._claimer.submit(self._in_thread, self._claim_after, gates).result

    def finalize(self, batch: BatchT, *, gate: bool = False, here: bool = False) -> None:
        """Start finalizing ``batch`` (inline: when collected). With ``gate`` the next
        claim ahead waits for it. With ``here`` it is finalized now, on the caller's
        thread, after the batches before it (those are reported): a relay about to wait
        for the next NOTIFY has nothing to overlap the finalize with, and handing it to
        the database thread cost that thread's wake-up (see docs/scaling.md#at-a-trickle).
        An earlier batch's finalize error is raised as :meth:`collect` raises it, once
        this batch is finalized."""
        if self._finalizer is None:
            self._pending.append(functools.partial(self._finalize, batch))
            return
        if here:
            try:
                self.collect(everything=True)  # what collect raises, after this batch
            finally:
                self._started(self._finalized_here(batch), gate=gate)
            return
        self._started(self._finalizer.submit(self._in_thread, self._finalize, batch), gate=gate)

    def _started(self, future: Future[DoneT], *, gate: bool) -> None:
        """Queue ``future`` for the collector; with ``gate``, the next claim ahead waits
        for it (and is not made if it failed)."""
        self._pending.append(future.result)
        self._gates = [done for done in self._gates if not done.done()]
        if gate:
            self._gates.append(future)

    def _finalized_here(self, batch: BatchT) -> Future[DoneT]:
        """Finalize ``batch`` on this thread, as a database thread would: its error is
        kept for the collector, and a database error closes the connection."""
        done: Future[DoneT] = Future()
        try:
            done.set_result(self._in_thread(self._finalize, batch))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def collect(self, *, everything: bool) -> None:
        """Wait for the batches started before the newest one (``everything``: for all
        of them) to be finalized, and report each. A database error is raised; the
        batch it hit is given up (its leases will expire), those before it are
        reported already."""
        keep = 0 if everything or self._finalizer is None else 1
        while len(self._pending) > keep:
            self._report(self._pending.popleft()())

    def settle(self) -> None:
        """Wait for every batch; those whose finalize failed are given up (their rows
        are claimed again when their lease expires), the others reported."""
        while self._pending:
            try:
                self.collect(everything=True)
            except DatabaseError:
                logger.debug("finalizing a batch failed", exc_info=True)
        self._gates = []  # those that failed hold back no later claim

    def close_old_connections(self) -> None:
        """Let the database threads honour ``CONN_MAX_AGE`` (between idle spells)."""
        self._on_each_thread(close_old_connections)

    def close_connection(self) -> None:
        """Close the database threads' connections (after an outage: the next use
        opens a fresh one instead of failing on a connection the server dropped)."""
        self._on_each_thread(self._close_connection)

    def close(self) -> None:
        """Settle every batch, then close the threads' connections and end them (ended
        whatever was raised)."""
        try:
            self.settle()
        finally:
            try:
                self._on_each_thread(connections.close_all)
            finally:
                for executor in self._threads:
                    executor.shutdown()

    def _on_each_thread(self, work: Callable[[], object]) -> None:
        """Run ``work`` on each database thread; the first error, once all are done."""
        done = [executor.submit(work) for executor in self._threads]
        concurrent.futures.wait(done)
        for future in done:
            future.result()

    def _close_connection(self) -> None:
        connections[self.using].close()

    def _claim_after(self, gates: Sequence[Future[DoneT]]) -> ClaimT | None:
        """Claim once ``gates`` are finalized; None (no claim) when one of them failed:
        the collector raises its error next, and the relay would drop this claim, its
        rows leased for nothing."""
        concurrent.futures.wait(gates)
        if any(gate.exception() is not None for gate in gates):
            return None
        return self._claim()

    def _in_thread(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return work(*args)
        except DatabaseError:
            self._close_connection()  # this thread's; reopened on next use
            raise
