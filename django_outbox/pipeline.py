"""The relay's claim-ahead pipeline: the database work of neighbouring batches on
a thread of its own while the relay's thread publishes."""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, close_old_connections, connections

from .conf import outbox_settings
from .redact import SecretFilter

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

ClaimT = TypeVar("ClaimT")
BatchT = TypeVar("BatchT")
DoneT = TypeVar("DoneT")
T = TypeVar("T")


class Pipeline(Generic[ClaimT, BatchT, DoneT]):
    """Claims the next batch (when the last one was full) and finalizes the batch
    just published on a database thread with its own connection to ``using``, while
    the caller publishes. At most one batch waits to be finalized while the next
    one is published.

    It knows the relay only by three callables: ``claim()`` (a claim, or None when
    nothing is due), ``finalize(batch)`` (the database writes of a published batch)
    and ``report(finalized)`` (log, signal and count it). Each batch is reported as
    soon as it is finalized, so a later batch whose finalize fails loses no
    earlier batch's report.

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
        self._executor: ThreadPoolExecutor | None = None
        if threaded:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="outbox-db")

    @property
    def pending(self) -> bool:
        """Whether a batch handed to :meth:`finalize` is not collected yet."""
        return bool(self._pending)

    def claim_ahead(self) -> Callable[[], ClaimT | None] | None:
        """Start claiming the next batch; returns how to wait for it (None: not here)."""
        if self._executor is None:
            return None
        return self._executor.submit(self._in_thread, self._claim).result

    def finalize(self, batch: BatchT) -> None:
        """Start finalizing ``batch`` (inline: when collected)."""
        if self._executor is None:
            self._pending.append(functools.partial(self._finalize, batch))
        else:
            self._pending.append(
                self._executor.submit(self._in_thread, self._finalize, batch).result
            )

    def collect(self, *, everything: bool) -> None:
        """Wait for the batches started before the newest one (``everything``: for all
        of them) to be finalized, and report each. A database error is raised; the
        batch it hit is given up (its leases will expire), those before it are
        reported already."""
        keep = 0 if everything or self._executor is None else 1
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

    def close_old_connections(self) -> None:
        """Let the database thread honour ``CONN_MAX_AGE`` (between idle spells)."""
        if self._executor is not None:
            self._executor.submit(close_old_connections).result()

    def close_connection(self) -> None:
        """Close the database thread's connection (after an outage: the next use
        opens a fresh one instead of failing on a connection the server dropped)."""
        if self._executor is not None:
            self._executor.submit(self._close_connection).result()

    def close(self) -> None:
        """Settle every batch, then close the thread's connections and end it."""
        self.settle()
        if self._executor is not None:
            self._executor.submit(connections.close_all).result()
            self._executor.shutdown()

    def _close_connection(self) -> None:
        connections[self.using].close()

    def _in_thread(self, work: Callable[..., T], *args: Any) -> T:
        try:
            return work(*args)
        except DatabaseError:
            self._close_connection()  # this thread's; reopened on next use
            raise
