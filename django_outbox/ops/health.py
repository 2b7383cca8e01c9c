"""Is the outbox healthy? One answer for ``outbox_health``, the health view and
django-health-check.

Unhealthy means an operator should look: the oldest due row has waited longer than
``HEALTH_MAX_DUE_AGE`` (nothing relays it, or not fast enough; the problem quotes the
row's last error, such as a broker out of memory), a live relay has found a broker down
(or a queue not confirming) for longer than that, no relay of the database has a
live heartbeat (see :mod:`django_outbox.workers.heartbeat`), or (PostgreSQL) another
session has held a snapshot open longer than ``HEALTH_MAX_SNAPSHOT_AGE``: vacuum keeps
every outbox row the relays finished since, and each claim reads past them (the
problem names the session, so it can be ended). A database that
cannot be read is neither: :func:`check_health` raises its ``DatabaseError``, and each
caller says so in its own way.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from .. import db
from ..conf import outbox_settings
from ..models import OutboxMessage, WorkerHeartbeat
from ..state.status import oldest_due
from ..workers.heartbeat import live_relay_rows, outages_of


@dataclasses.dataclass(frozen=True)
class Health:
    """The outcome of :func:`check_health`."""

    database: str
    #: What is wrong, one line each; empty when healthy.
    problems: list[str]
    oldest_due_age: dt.timedelta | None
    live_relays: int
    max_due_age: float
    relay_required: bool

    @property
    def healthy(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        """One line: ``healthy: ...`` or ``unhealthy: ...``."""
        if self.problems:
            return "unhealthy: " + "; ".join(self.problems)
        age = self.oldest_due_age
        waited = (
            "nothing is due" if age is None else f"oldest due row {age.total_seconds():.1f}s old"
        )
        relays = f"{self.live_relays} live relay{'' if self.live_relays == 1 else 's'}"
        return f"healthy: {waited}, {relays} (database {self.database!r})"

    def as_dict(self) -> dict[str, Any]:
        age = self.oldest_due_age
        return {
            "healthy": self.healthy,
            "database": self.database,
            "problems": self.problems,
            "oldest_due_age_seconds": None if age is None else round(age.total_seconds(), 3),
            "max_due_age_seconds": self.max_due_age,
            "live_relays": self.live_relays,
            "relay_required": self.relay_required,
        }


def check_health(
    using: str = "default",
    *,
    max_due_age: float | None = None,
    require_relay: bool = True,
    max_snapshot_age: float | None = None,
) -> Health:
    """Check the outbox of database ``using``: the oldest due row's age against
    ``max_due_age`` seconds (default ``OUTBOX["HEALTH_MAX_DUE_AGE"]``), with
    ``require_relay`` that a relay of the database is live, and the oldest snapshot
    another session holds against ``max_snapshot_age`` (default
    ``OUTBOX["HEALTH_MAX_SNAPSHOT_AGE"]``; 0: not checked). Raises the
    ``DatabaseError`` of a database it cannot read."""
    limit = outbox_settings.HEALTH_MAX_DUE_AGE if max_due_age is None else max_due_age
    oldest = oldest_due(OutboxMessage.objects.using(using))
    age, error = oldest if oldest is not None else (None, "")
    relays = live_relay_rows(using)
    problems = []
    if age is not None and age.total_seconds() > limit:
        problems.append(
            f"the oldest due row has waited {age.total_seconds():.0f}s, more than {limit:g}s"
            + _quoted(error)
        )
    problems += _outages(relays, limit)
    if require_relay and not relays:
        problems.append(f"no relay of database {using!r} has a live heartbeat")
    problems += _held_snapshot(using, max_snapshot_age)
    return Health(using, problems, age, len(relays), limit, require_relay)


def _outages(relays: list[WorkerHeartbeat], limit: float) -> list[str]:
    """The problems of what live ``relays`` found down for longer than ``limit`` seconds
    (a broker, a queue that stopped confirming), the longest first, one line each: their
    rows wait unattempted, and each is put back due at the next check, so the oldest
    due row's age does not show it."""
    longest: dict[str, tuple[float, str]] = {}
    for row in relays:
        for what, seconds in outages_of(row).items():
            longest[what] = max(longest.get(what, (0.0, "")), (seconds, row.worker))
    return [
        f"{what} has been down for {seconds:.0f}s, more than {limit:g}s (relay {worker}): "
        "its rows wait, no attempt spent"
        for what, (seconds, worker) in sorted(longest.items(), key=lambda item: -item[1][0])
        if seconds > limit
    ]


def _held_snapshot(using: str, limit: float | None) -> list[str]:
    """The problem of a snapshot held open longer than ``limit`` seconds, if any."""
    limit = outbox_settings.HEALTH_MAX_SNAPSHOT_AGE if limit is None else limit
    snapshot = db.oldest_snapshot(using) if limit else None
    if snapshot is None or snapshot.held <= limit:
        return []
    return [
        f"{snapshot.describe()} has held a snapshot open for {snapshot.held:.0f}s, more "
        f"than {limit:g}s: vacuum keeps every outbox row finished since, and each claim "
        f"reads past them; end its transaction (SELECT pg_terminate_backend({snapshot.pid}))"
    ]


#: The most of a row's last error a health problem quotes.
MAX_QUOTED_ERROR = 300


def _quoted(error: str) -> str:
    """`` (its last error: ...)`` of the oldest due row, or "" when it has none (never
    tried): why it waits, such as a broker that is down or out of memory."""
    if not error:
        return ""
    line = " ".join(error.split())
    if len(line) > MAX_QUOTED_ERROR:
        line = line[: MAX_QUOTED_ERROR - 3] + "..."
    return f" (its last error: {line})"
