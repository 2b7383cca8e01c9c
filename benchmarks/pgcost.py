"""What a stretch of work costs the PostgreSQL server: WAL bytes, row versions written
to one table (and how many of its updates were HOT), and the server's CPU time.

Read by the runner around a relay drain (:func:`benchmarks.scenarios.relay_drain`).
WAL is the server's: every database's writes, autovacuum's and checkpoints' included,
which on the benchmark's own server are the drain's. The table counters come from
``pg_stat_user_tables``, which a backend flushes on its own schedule (at the latest
when it exits), so :meth:`Reading.take` first flushes the runner's own and waits for
the other backends of the database to be gone and the counters to settle. The CPU time
is read from ``/proc`` and is there only when the server runs on this machine under a
user whose processes this one may read.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.db import connection

if TYPE_CHECKING:
    from django.db.backends.utils import CursorWrapper

#: How long :meth:`Reading.take` waits for the other backends and the counters to settle.
SETTLE_SECONDS = 10.0

_COUNTERS = """
SELECT n_tup_ins, n_tup_upd, n_tup_del, n_tup_hot_upd FROM pg_stat_user_tables
WHERE relid = %s::regclass
"""


@dataclasses.dataclass(frozen=True)
class Reading:
    """The server's counters at one moment."""

    wal_lsn: str
    inserted: int
    updated: int
    deleted: int
    hot_updated: int
    cpu_seconds: float | None

    @classmethod
    def take(cls, table: str) -> Reading:
        """The counters now, once the other backends of the database have gone and
        flushed what they counted on ``table``."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
            deadline = time.monotonic() + SETTLE_SECONDS
            counters = settled(cursor, _COUNTERS, [table], deadline)
            cursor.execute("SELECT pg_current_wal_lsn()::text, pg_backend_pid()")
            lsn, pid = cursor.fetchone()
        return cls(lsn, *counters, cpu_seconds=_server_cpu_seconds(pid))

    def cost(self, later: Reading, events: int) -> dict[str, float | None]:
        """Per event, what the server wrote and spent from this reading to ``later``:
        WAL bytes, row versions (inserted, updated and deleted), the share of the
        updates that were HOT, and the server's CPU microseconds (None unknown)."""
        updated = later.updated - self.updated
        versions = later.inserted - self.inserted + updated + later.deleted - self.deleted
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_wal_lsn_diff(%s, %s)", [later.wal_lsn, self.wal_lsn])
            (wal_bytes,) = cursor.fetchone()
        cpu = None
        if later.cpu_seconds is not None and self.cpu_seconds is not None:
            cpu = (later.cpu_seconds - self.cpu_seconds) * 1e6 / events
        return {
            "wal_bytes_per_event": float(wal_bytes) / events,
            "row_versions_per_event": versions / events,
            "hot_update_share": (later.hot_updated - self.hot_updated) / max(updated, 1),
            "pg_cpu_us_per_event": cpu,
        }


#: The figures of :meth:`Reading.cost`, and the WAL of staging the drained backlog.
FIGURES = (
    "wal_bytes_per_event",
    "row_versions_per_event",
    "hot_update_share",
    "pg_cpu_us_per_event",
    "staging_wal_bytes_per_event",
)


def medians(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of each of :data:`FIGURES` over ``runs`` (relay drains); None where a
    run could not tell (the server's CPU time)."""
    found = {name: [run[name] for run in runs] for name in FIGURES}
    return {
        name: None if None in values else statistics.median(values)
        for name, values in found.items()
    }


def settled(
    cursor: CursorWrapper, query: str, params: list[Any], deadline: float
) -> tuple[int, ...]:
    """The row of statistics ``query`` reads, once no other backend of this database is
    connected and two reads a moment apart agree (or at ``deadline``, the last read)."""
    last: tuple[int, ...] | None = None
    while True:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        (others,) = cursor.fetchone()
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(query, params)
        counters = tuple(cursor.fetchone())
        if (not others and counters == last) or time.monotonic() > deadline:
            return counters
        last = counters
        time.sleep(0.2)


def server_cpu_seconds() -> float | None:
    """The CPU seconds of the PostgreSQL server of this thread's connection
    (:func:`_server_cpu_seconds`), read without a statement."""
    connection.ensure_connection()
    return _server_cpu_seconds(connection.connection.info.backend_pid)


def _server_cpu_seconds(backend_pid: int) -> float | None:
    """User and system CPU seconds of the PostgreSQL server serving ``backend_pid``:
    its postmaster with the children it reaped, and its children alive now. None
    when ``/proc`` does not show them (another machine, another user)."""
    try:
        postmaster = int(_stat(backend_pid)[1])
        fields = _stat(postmaster)
        ticks = sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
        children = Path(f"/proc/{postmaster}/task/{postmaster}/children").read_text().split()
        for child in children:
            try:
                ticks += sum(int(value) for value in _stat(int(child))[11:13])
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited since: its time moves to cutime, read next time
    except (OSError, ValueError, IndexError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: state, ppid, ..."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()
