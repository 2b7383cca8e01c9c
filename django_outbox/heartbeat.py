"""Heartbeats: each running relay and consumer keeps one row saying it is alive.

A process writes its :class:`~django_outbox.models.WorkerHeartbeat` row in the
database it serves every ``HEARTBEAT_INTERVAL`` seconds (from its own loop, so a
loop that hangs stops beating), and once more when it stops cleanly. Times are the
database's clock, as ``created_at`` is. Readers (``outbox_status``,
``outbox_health``, the health view, the admin) judge each row by the age of its
last beat counted in the row's own interval: :func:`state_of`.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from django.db import DatabaseError
from django.db.models.functions import Now
from django.utils import timezone

from . import db
from .conf import outbox_settings
from .models import WorkerHeartbeat, WorkerKind

logger = logging.getLogger(__name__)

#: A row whose last beat is at most this many of its intervals old is live ...
LIVE_INTERVALS = 3
#: ... at most this many, stale; older, dead (the process is gone or hangs).
STALE_INTERVALS = 30


class WorkerState(enum.StrEnum):
    """How a heartbeat row looks to a reader."""

    LIVE = "live"
    """It beat within ``LIVE_INTERVALS`` of its intervals."""
    STALE = "stale"
    """It missed beats, but beat within ``STALE_INTERVALS``: busy, or about to be dead."""
    DEAD = "dead"
    """No beat for longer: the process died, hangs, or lost its database."""
    STOPPED = "stopped"
    """It stopped cleanly (and wrote so)."""


def state_of(row: WorkerHeartbeat, now: dt.datetime | None = None) -> WorkerState:
    """The state of ``row`` at ``now`` (default: this process's clock)."""
    if row.stopped_at is not None:
        return WorkerState.STOPPED
    age = ((now or timezone.now()) - row.beat_at).total_seconds()
    if age <= LIVE_INTERVALS * row.interval:
        return WorkerState.LIVE
    if age <= STALE_INTERVALS * row.interval:
        return WorkerState.STALE
    return WorkerState.DEAD


@dataclasses.dataclass(frozen=True)
class Worker:
    """A heartbeat row and its state, as the readers show it."""

    row: WorkerHeartbeat
    state: WorkerState
    beat_age: dt.timedelta

    def as_dict(self) -> dict[str, Any]:
        row = self.row
        return {
            "kind": row.kind,
            "worker": row.worker,
            "database": row.database,
            "name": row.name,
            "state": str(self.state),
            "started_at": row.started_at.isoformat(),
            "beat_at": row.beat_at.isoformat(),
            "beat_age_seconds": round(self.beat_age.total_seconds(), 3),
            "interval_seconds": row.interval,
            "last_batch_at": None if row.last_batch_at is None else row.last_batch_at.isoformat(),
            "stopped_at": None if row.stopped_at is None else row.stopped_at.isoformat(),
            "counts": row.counts,
        }


def workers(using: str = "default", *, kind: str | None = None) -> list[Worker]:
    """Every heartbeat row of ``using`` (of one ``kind``, if given), newest beat first."""
    rows = WorkerHeartbeat.objects.using(using).order_by("-beat_at", "worker")
    if kind is not None:
        rows = rows.filter(kind=kind)
    now = timezone.now()
    return [
        Worker(row, state_of(row, now), max(now - row.beat_at, dt.timedelta(0))) for row in rows
    ]


def live_relays(using: str = "default") -> int:
    """How many relays of ``using`` beat recently enough to count as live."""
    return sum(w.state is WorkerState.LIVE for w in workers(using, kind=WorkerKind.RELAY))


class Heartbeat:
    """The heartbeat of one process: call :meth:`beat` from its loop (it writes only
    when an interval has passed) and :meth:`stopped` on a clean stop.

    A database error is logged at DEBUG and swallowed: the loop meets the outage in
    its own work and reports it there; the next beat tries again.
    """

    def __init__(
        self,
        kind: WorkerKind,
        worker: str,
        using: str = "default",
        *,
        name: str = "",
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kind, self.worker, self.using, self.name = kind, worker, using, name
        self.interval = interval or outbox_settings.HEARTBEAT_INTERVAL
        self._clock = clock
        self._next = 0.0  # the first call beats
        self._started = False  # the row's started_at is written by the first beat

    @property
    def due(self) -> bool:
        return self._clock() >= self._next

    @property
    def wait(self) -> float:
        """Seconds until the next beat is due (0 if it is)."""
        return max(0.0, self._next - self._clock())

    def beat(self, counts: Mapping[str, int], *, last_batch_at: dt.datetime | None = None) -> bool:
        """Write the row if a beat is due; returns whether it was written."""
        if not self.due:
            return False
        return self._write(counts, last_batch_at, stopped=False)

    def stopped(
        self, counts: Mapping[str, int], *, last_batch_at: dt.datetime | None = None
    ) -> None:
        """Write the row once more, marked stopped."""
        self._write(counts, last_batch_at, stopped=True)

    def _write(
        self, counts: Mapping[str, int], last_batch_at: dt.datetime | None, *, stopped: bool
    ) -> bool:
        self._next = self._clock() + self.interval
        values: dict[str, Any] = {
            "database": self.using,
            "beat_at": Now(),
            "interval": self.interval,
            "counts": dict(counts),
            "stopped_at": Now() if stopped else None,
        }
        if last_batch_at is not None:
            values["last_batch_at"] = last_batch_at
        if not self._started:
            values["started_at"] = Now()
        try:
            self._upsert(values)
        except DatabaseError as exc:
            logger.debug(
                "heartbeat not written: %s", exc, extra={"action": "outbox.heartbeat_failed"}
            )
            return False
        self._started = True
        return True

    def _upsert(self, values: dict[str, Any]) -> None:
        """Update the row, or insert it if it is not there (a first beat, or a row that
        retention deleted); a process that reuses a dead one's ``host:pid`` takes its row."""
        key = {"kind": self.kind, "worker": self.worker, "name": self.name}
        rows = WorkerHeartbeat.objects.using(self.using).filter(**key)
        if rows.update(**values):
            return
        fields = {**key, "started_at": Now(), **values}
        if not db.insert_if_absent(self.using, WorkerHeartbeat, **fields):
            rows.update(**values)  # another process inserted it meanwhile
