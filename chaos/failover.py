"""A primary's failover to its streaming standby (issue 44): the fault ``pg_failover`` of
the profiles ``pg-failover`` (synchronous replication) and ``pg-failover-async``.

:class:`Replication` starts the standby before the run (``scripts/services standby
start``: a streaming replica made with ``pg_basebackup``, named in the primary's
``synchronous_standby_names``); for ``async`` it takes the standby out of that list, so a
COMMIT returns once the primary's own disk has it. Every process of the run, the runner
too, connects with both servers in one URL (``host=primary,standby`` and
``target_session_attrs=read-write``): each finds whichever is the primary, and after the
fault the audit reads the promoted standby.

The fault first lets the standby fall behind, as a busy network or a slow standby does:
the primary's WAL sender is frozen (SIGSTOP) for a second or two, so the WAL written
meanwhile is the primary's alone (with synchronous replication every COMMIT waits for
the standby; with asynchronous replication they return). Then ``scripts/services standby
failover`` SIGKILLs the primary with its backends, the WAL sender among them, and
promotes the standby. The producers write the event ids of each COMMIT that returned to a
file of their own, fsynced (:mod:`chaos.producer`); :func:`load_committed` reads them into
``Committed`` at the end and :func:`checks` compares them with what the promoted standby
has: what the application was told against what survived.

:meth:`Replication.restore` undoes it however the run ended: the promoted standby is
deleted and the primary started again (crash recovery, then alone: ``standby stop`` took
the standby out of its ``synchronous_standby_names``), so the services are as they were
for what runs next, and the runner drops its database there.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit, urlunsplit

from benchmarks.services import Services

if TYPE_CHECKING:
    from .audit import Check
    from .faults import Done, Fault, Injector

KIND = "pg_failover"
MODES = ("sync", "async")
#: The standby's name in the primary's pg_stat_replication (scripts/services).
STANDBY = "outbox_standby"
LAG = (1.0, 2.0)  # seconds the WAL sender is frozen before the primary dies
LOST = "committed events lost (COMMIT returned, gone after the failover)"
UNHANDLED = "committed events never handled (COMMIT returned)"
#: The checks a failover with asynchronous replication is expected to break, each by the
#: commits it loses (docs/deploying.md): measured there, not passed or failed.
ASYNC_MEASURED = (
    LOST,
    UNHANDLED,
    # An order that survived, handled on the lost primary alone (its message acknowledged).
    "lost (committed, never handled)",
    # An event published from the lost primary: its transaction is gone, its message not.
    "handled without a committed order",
    # Django 6: a task run on the lost primary alone (its message acknowledged), its result
    # READY on the promoted one; a task whose enqueue was lost, run on the promoted one.
    "tasks committed and not SUCCESSFUL (ready, running, failed)",
    "tasks run with no committed enqueue",
)


class Replication:
    """The standby of the services' PostgreSQL, for one run: synchronous or not."""

    def __init__(self, services: Services, mode: str, database: str) -> None:
        self.services = services
        self.mode = mode
        self.database = database

    @property
    def url(self) -> str:
        """The run's database on both servers, read-write wanted, each session's COMMIT
        waiting for the standby where it is synchronous (``synchronous_commit`` on)."""
        found = re.search(
            r"OUTBOX_FAILOVER_DATABASE_URL='([^']+)'", self.services.run("standby", "env")
        )
        if found is None:
            raise RuntimeError("scripts/services standby env printed no URL")
        url = urlsplit(found.group(1))._replace(path=f"/{self.database}")
        return f"{urlunsplit(url)}&options={quote('-c synchronous_commit=on')}"

    def start(self) -> None:
        """Start the standby; for ``async``, out of ``synchronous_standby_names``; return
        once the primary streams to it in that mode."""
        self.services.run("standby", "start")
        if self.mode == "async":
            _on_primary(self.services, "ALTER SYSTEM SET synchronous_standby_names = ''")
            _on_primary(self.services, "SELECT pg_reload_conf()")
        wanted = "sync" if self.mode == "sync" else "async"
        deadline = time.monotonic() + 60
        while (state := _replication(self.services)[1]) != wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby streams {state!r}, not {wanted!r}")
            time.sleep(0.2)

    def restore(self) -> None:
        """Delete the standby (promoted or not) and start the primary again, alone."""
        self.services.run("standby", "stop")
        self.services.run("start", "postgres")


def _on_primary(services: Services, sql: str) -> list[tuple[object, ...]]:
    """``sql`` on the primary itself (the services' own URL, not the run's two hosts)."""
    import psycopg

    url = urlunsplit(urlsplit(services.env["DATABASE_URL"])._replace(path="/postgres"))
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as connection:
        cursor = connection.execute(sql)  # type: ignore[arg-type]
        return cursor.fetchall() if cursor.description else []


def _replication(services: Services) -> tuple[int | None, str | None, int]:
    """The primary's WAL sender to the standby: its pid, its ``sync_state``, and the
    bytes of WAL the primary has written that the standby has not confirmed flushed."""
    found = _on_primary(
        services,
        "SELECT pid, sync_state, pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn)::bigint "
        f"FROM pg_stat_replication WHERE application_name = '{STANDBY}'",
    )
    if not found:
        return None, None, 0
    pid, state, behind = found[0]
    return int(pid), str(state), int(behind or 0)  # type: ignore[call-overload]


def pg_failover(injector: Injector) -> Done:
    """Freeze the WAL sender a second or two, then SIGKILL the primary and promote the
    standby (``scripts/services standby failover``)."""
    from . import database as db
    from .faults import Done

    services = injector.services
    sender, state, _ = _replication(services)
    if sender is None:
        raise RuntimeError("pg_failover: the primary has no WAL sender to the standby")
    lag = injector.rng.uniform(*LAG)
    os.kill(sender, signal.SIGSTOP)
    time.sleep(lag)
    behind = _replication(services)[2]
    began = time.monotonic()
    services.run("standby", "failover")  # SIGKILL ends the stopped WAL sender too
    ended = time.monotonic()
    mark = db.last_order()  # read on the promoted node: what it has of the orders
    first = _first_order_after(mark)

    def facts() -> str:
        after = db.value(f"SELECT count(*) FROM {db.ORDER} WHERE id > %s", [mark])
        return (
            f"WAL sender (pid {sender}, {state}) frozen for {lag:.1f}s, the standby then "
            f"{behind:,} bytes of WAL behind; primary SIGKILLed and standby promoted in "
            f"{ended - began:.1f}s; first order committed on the promoted node "
            + (f"{first:.1f}s later, {after:,} by now" if first is not None else "never")
        )

    tolerated = mark if injector.replication == "async" else 0
    return Done("postgres", ended, facts, stranded=int(first is None), tolerated=tolerated)


def _first_order_after(mark: int) -> float | None:
    """Seconds until an order with an id above ``mark`` is committed (None: not in a
    minute): the producers go on on the promoted node."""
    from . import database as db

    began = time.monotonic()
    while time.monotonic() - began < 60:
        if db.last_order() > mark:
            return time.monotonic() - began
        time.sleep(0.1)
    return None


def load_committed(files: Sequence[Path]) -> int:
    """Read the producers' files (``committed-<index>.txt``: an event id a line) into
    ``Committed``; returns how many."""
    from .models import Committed

    rows = [
        Committed(event_id=line, producer=int(path.stem.rsplit("-", 1)[1]))
        for path in files
        if path.exists()
        for line in path.read_text(encoding="ascii").split()
    ]
    Committed.objects.bulk_create(rows, batch_size=5000)
    return len(rows)


def checks(mode: str, faults: Sequence[Fault], results: list[Check]) -> list[Check]:
    """``results`` and what the producers were told committed against what the promoted
    standby has: each event's order, and the consumer's handling of it. Synchronous
    replication must lose none; with asynchronous replication the losses, and the checks
    in ASYNC_MEASURED they break, are measured (docs/deploying.md)."""
    from . import database as db
    from .audit import Check, without

    told = int(db.value(f"SELECT count(*) FROM {db.COMMITTED}"))
    results = [
        *results,
        Check(LOST, without(db.COMMITTED, db.ORDER), 0),
        Check(UNHANDLED, without(db.COMMITTED, db.HANDLED), 0),
        Check(
            "failovers with no order committed on the promoted node",
            sum(fault.done.stranded for fault in faults if fault.kind == KIND),
            0,
        ),
    ]
    if mode == "sync":
        return results
    why = "asynchronous replication, docs/deploying.md"
    return [
        dataclasses.replace(
            check,
            note=why if check.name.startswith("tasks") else f"of {told:,} told committed; {why}",
            measured=True,
        )
        if check.name in ASYNC_MEASURED
        else check
        for check in results
    ]
