"""Heartbeats: each running relay and consumer keeps one row saying it is alive.

A thread of the process (:class:`HeartbeatThread`) writes its
:class:`~django_outbox.models.WorkerHeartbeat` row in the database it serves every
``HEARTBEAT_INTERVAL`` seconds, and once more when it stops cleanly. Times are the
database's clock, as ``created_at`` is, and readers (``outbox_status``,
``outbox_health``, the health view, the admin) read that clock with the rows: each row
is judged by the age of its last beat counted in the row's own interval
(:func:`state_of`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from django.db import DatabaseError, close_old_connections, connections
from django.db.models import Max, QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from ..conf import outbox_settings
from ..conf.redact import SecretFilter
from ..db.expressions import now_minus
from ..models import WorkerHeartbeat, WorkerKind

logger = logging.getLogger("django_outbox.heartbeat")
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts

#: The key of a relay's counts that holds what it finds down (a broker, a queue that
#: stopped confirming), each with the seconds it has been down: its rows wait unattempted,
#: and their due age does not grow (each is put back due when its broker is next checked).
OUTAGES = "outages"
#: A row whose last beat is at most this many of its intervals old is live ...
LIVE_INTERVALS = 3
#: ... at most this many, stale; older, dead (the process is gone or hangs).
STALE_INTERVALS = 30


def process_name() -> str:
    """``host:pid``: how a relay or consumer names itself (in ``locked_by`` and in its
    heartbeat's ``worker``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


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
    """The state of ``row`` at ``now``; by default the database's clock when the row
    was read with :func:`with_database_clock`, this process's otherwise."""
    if row.stopped_at is not None:
        return WorkerState.STOPPED
    age = ((now or clock_of(row)) - row.beat_at).total_seconds()
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


def with_database_clock(rows: QuerySet[WorkerHeartbeat]) -> QuerySet[WorkerHeartbeat]:
    """``rows``, each read with the database's clock (``db_now``): beats are written by
    that clock, so a reader whose own clock is off still judges their age right."""
    return rows.annotate(db_now=Now())


def clock_of(row: WorkerHeartbeat) -> dt.datetime:
    """The database's clock when ``row`` was read, else this process's."""
    now = getattr(row, "db_now", None)
    return now if isinstance(now, dt.datetime) else timezone.now()


def workers(using: str = "default", *, kind: str | None = None) -> list[Worker]:
    """Every heartbeat row of ``using`` (of one ``kind``, if given), newest beat first."""
    rows = with_database_clock(WorkerHeartbeat.objects.using(using)).order_by("-beat_at", "id")
    if kind is not None:
        rows = rows.filter(kind=kind)
    return [
        Worker(row, state_of(row), max(clock_of(row) - row.beat_at, dt.timedelta(0)))
        for row in rows
    ]


def live_relays(using: str = "default") -> int:
    """How many relays of ``using`` count as live (:func:`live_relay_rows`)."""
    return len(live_relay_rows(using))


def live_relay_rows(using: str = "default") -> list[WorkerHeartbeat]:
    """The relays of ``using`` that beat recently enough to count as live (read among
    those that beat in the last ``LIVE_INTERVALS`` of the longest interval, by index),
    each read with the database's clock."""
    rows = WorkerHeartbeat.objects.using(using).filter(kind=WorkerKind.RELAY, stopped_at=None)
    recent = rows.filter(beat_at__gte=now_minus(LIVE_INTERVALS * _longest_interval(rows)))
    return [row for row in with_database_clock(recent) if state_of(row) is WorkerState.LIVE]


def outages_of(row: WorkerHeartbeat) -> dict[str, float]:
    """What the relay of ``row`` found down at its last beat (see :data:`OUTAGES`), and
    for how many seconds by now: its beat's figure plus the beat's age."""
    since_beat = max((clock_of(row) - row.beat_at).total_seconds(), 0.0)
    found = row.counts.get(OUTAGES) if isinstance(row.counts, dict) else None
    if not isinstance(found, dict):
        return {}
    return {
        str(what): float(seconds) + since_beat
        for what, seconds in found.items()
        if isinstance(seconds, int | float)
    }


def _longest_interval(rows: QuerySet[WorkerHeartbeat]) -> dt.timedelta:
    longest = rows.aggregate(longest=Max("interval"))["longest"] or 0.0
    return dt.timedelta(seconds=longest)


class Heartbeat:
    """The heartbeat of one process: :meth:`beat` writes its row if an interval has
    passed, :meth:`stopped` marks it stopped. A :class:`HeartbeatThread` calls them.

    A database error is logged at DEBUG and swallowed: the process's own work meets
    the outage and reports it; the next beat tries again.
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
        self.process = uuid.uuid4()  # the row's key
        self._clock = clock
        self._next = 0.0  # the first call beats

    @property
    def wait(self) -> float:
        """Seconds until the next beat is due (0 if it is)."""
        return max(0.0, self._next - self._clock())

    def beat(self, counts: Mapping[str, Any], *, last_batch_at: dt.datetime | None = None) -> bool:
        """Write the row if a beat is due; returns whether it was written."""
        if self.wait:
            return False
        return self._write(counts, last_batch_at, stopped=False)

    def stopped(
        self, counts: Mapping[str, Any], *, last_batch_at: dt.datetime | None = None
    ) -> None:
        """Write the row once more, marked stopped."""
        self._write(counts, last_batch_at, stopped=True)

    def _write(
        self, counts: Mapping[str, Any], last_batch_at: dt.datetime | None, *, stopped: bool
    ) -> bool:
        self._next = self._clock() + self.interval
        values: dict[str, Any] = {
            "beat_at": Now(),
            "counts": dict(counts),
            "last_batch_at": last_batch_at,
            "stopped_at": Now() if stopped else None,
        }
        try:
            rows = WorkerHeartbeat.objects.using(self.using).filter(process=self.process)
            if not rows.update(**values):  # the first beat (or retention deleted the row)
                WorkerHeartbeat.objects.using(self.using).create(
                    process=self.process,
                    kind=self.kind,
                    worker=self.worker,
                    database=self.using,
                    name=self.name,
                    started_at=Now(),
                    interval=self.interval,
                    **values,
                )
        except DatabaseError as exc:
            logger.debug(
                "heartbeat not written: %s", exc, extra={"action": "outbox.heartbeat_failed"}
            )
            return False
        return True


class HeartbeatThread(threading.Thread):
    """Beats for a relay or consumer on a thread of its own (and its own database
    connection), so that a batch waiting for a broker's confirms, a long handler or a
    backoff never delays a beat: a row goes stale only when the process is gone, stopped
    in a debugger, or cut off from its database. The loop's progress is the row's
    ``last_batch_at``, and the backlog's age (``outbox_health``) catches a loop that hangs.

    ``snapshot`` returns the process's totals and its last batch; ``after_beat`` runs
    after each beat written (the relay takes its sample of the outbox there).
    """

    def __init__(
        self,
        heartbeat: Heartbeat,
        snapshot: Callable[[], tuple[Mapping[str, Any], dt.datetime | None]],
        after_beat: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name=f"outbox-heartbeat-{heartbeat.kind}", daemon=True)
        self.heartbeat = heartbeat
        self._snapshot, self._after_beat = snapshot, after_beat
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while True:
                counts, last_batch_at = self._snapshot()
                if self.heartbeat.beat(counts, last_batch_at=last_batch_at) and self._after_beat:
                    self._after_beat()
                close_old_connections()  # one broken by an outage is opened anew next beat
                if self._stop_event.wait(self.heartbeat.wait):
                    break
            counts, last_batch_at = self._snapshot()
            self.heartbeat.stopped(counts, last_batch_at=last_batch_at)
        finally:
            connections[self.heartbeat.using].close()

    def stop(self, timeout: float = 30.0) -> None:
        """Write the last beat, marked stopped (with the totals as they are now), and
        end the thread."""
        self._stop_event.set()
        self.join(timeout)
