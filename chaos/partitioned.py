"""The ``partitioned`` profile: the ci faults on an outbox partitioned by ranges of id.

The runner turns the fresh outbox table into a partitioned one (``manage.py
outbox_partition``) before any traffic, with ranges of ``ROWS`` ids, and the relays run
their retention every ``CLEANUP_INTERVAL`` seconds with a ``PUBLISHED_RETENTION`` of a
few seconds: they make ranges ahead and drop the closed ones while the producers stage
and the faults go on (docs/scaling.md). The chaos triggers are dropped before the
conversion (which refuses a table with triggers of its own) and made again on the
partitioned table, whose partitions inherit them, and the audit's view
``chaos_outbox_row`` reads the partitioned table again.

A dropped range takes its rows with it, and the audit needs them (the NATS-free
destinations, each key's sequence, the attempts): an event trigger on ``DROP TABLE``
copies the rows of an outbox range about to be dropped, as they are then, into
``chaos_dropped_row`` (with the drop's time and the dropping process), and the view
shows them with their status. A row dropped before it was PUBLISHED, or before its
retention passed, is a check of its own; its event is also lost, which the ``lost``
check sees. The audit's partition lines (:func:`checks`) need at least one range made
ahead and one holding rows dropped during the run, so the profile cannot pass without
both; no row in the default partition (the relays kept ranges ahead of the ids drawn);
and no producer transaction failed on anything but the database faults' outages.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .logs import lines

if TYPE_CHECKING:
    from .audit import Check

# The runner imports this module before it sets Django up: what needs Django (the
# models, chaos.database, chaos.audit) is imported where used.

#: Ids per range: a few seconds of the profile's traffic, so that tens of ranges fill up.
ROWS = 400
#: Empty ranges the relays keep ahead: ten seconds and more of traffic, for a pass that
#: does not get its locks in time or a relay restarting.
AHEAD = 3
#: Seconds between a relay's retention passes, and how long a PUBLISHED row is kept.
CLEANUP_INTERVAL = 1
PUBLISHED_RETENTION = 5
#: The profile's additions to every process's OUTBOX.
SETTINGS = {
    "PARTITIONING": {"rows": ROWS, "ahead": AHEAD},
    "CLEANUP_INTERVAL": CLEANUP_INTERVAL,
    "PUBLISHED_RETENTION": PUBLISHED_RETENTION,
}
DROPPED = "chaos_dropped_row"
_COLUMNS = "id, event_id, destination, ordering_key, sequence, status, locked_by, attempts"
#: What a producer prints when its transaction failed (chaos.producer), and the failures
#: a PostgreSQL restart or crash causes (connections cut or refused, the server shutting
#: down or in recovery): any other is a staging failure.
_FAILED = "database error, waiting: "
_OUTAGE = re.compile(
    r"terminat|shutting down|starting up|recovery mode|server closed the connection|"
    r"connection (?:refused|failed|is closed|to server)|consuming input failed|"
    r"no connection to the server|could not receive data|SSL SYSCALL|connection already closed",
    re.IGNORECASE,
)


def prepare() -> None:
    """Partition the runner's fresh outbox, its chaos triggers dropped first and made
    again on the partitioned table (outbox_partition refuses a table with triggers of
    its own), keep the rows of every dropped range, and point the audit's view at both."""
    from django.core.management import call_command
    from django.db import connection

    from django_outbox.db import partitions

    from . import database as db

    table = db.OUTBOX
    kept = db.rows(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger WHERE tgrelid = %s::regclass "
        "AND NOT tgisinternal AND tgname LIKE 'chaos%%'",
        [table],
    )
    with connection.cursor() as cursor:
        for name, _ in kept:
            cursor.execute(f'DROP TRIGGER {name} ON "{table}"')
    call_command("outbox_partition", verbosity=0)
    first = partitions.partition_name(0)
    with connection.cursor() as cursor:
        for _, definition in kept:  # the same name: now the partitioned table's
            cursor.execute(definition)
        cursor.execute(_dropped_table())
        cursor.execute(_keep_dropped(table))
        cursor.execute(
            "CREATE EVENT TRIGGER chaos_keep_dropped ON ddl_command_start "
            "WHEN TAG IN ('DROP TABLE') EXECUTE FUNCTION chaos_keep_dropped()"
        )
        view = db.value("SELECT pg_get_viewdef(%s::regclass)", [db.OUTBOX_ROWS]).rstrip("; \n")
        cursor.execute(
            f"CREATE OR REPLACE VIEW {db.OUTBOX_ROWS} AS "
            f'{view.replace(first, table)} UNION ALL SELECT {_COLUMNS} FROM "{DROPPED}"'
        )


def _dropped_table() -> str:
    return (
        f'CREATE TABLE "{DROPPED}" (id bigint PRIMARY KEY, event_id uuid NOT NULL, '
        "destination text NOT NULL, ordering_key text NOT NULL, sequence bigint, "
        "status text NOT NULL, locked_by text NOT NULL, attempts integer NOT NULL, "
        "published_at timestamptz, partition text NOT NULL, dropped_by text NOT NULL, "
        "dropped_at timestamptz NOT NULL)"
    )


def _keep_dropped(table: str) -> str:
    """The event trigger's function: before a ``DROP TABLE`` of one of ``table``'s ranges
    (named ``<table>_p<lower>``), copy its rows."""
    return f"""
    CREATE FUNCTION chaos_keep_dropped() RETURNS event_trigger LANGUAGE plpgsql AS $$
    DECLARE
        name text := substring(current_query() from 'DROP TABLE\\s+"?({table}_p[0-9]+)');
    BEGIN
        IF name IS NOT NULL THEN
            EXECUTE format(
                'INSERT INTO "{DROPPED}" SELECT {_COLUMNS}, published_at, %L, %L, '
                'clock_timestamp() FROM %I',
                name, current_setting('application_name'), name);
        END IF;
    END
    $$
    """


def checks(relay_logs: Sequence[Path], producer_logs: Sequence[Path]) -> list[Check]:
    """The partitioned outbox's lines of the audit."""
    from . import database as db
    from .audit import Check

    made = sum(len(lines(log, "outbox.partition_made")) for log in relay_logs)
    dropped = sum(len(lines(log, "outbox.partition_dropped")) for log in relay_logs)
    with_rows, rows = db.rows(f'SELECT count(DISTINCT partition), count(*) FROM "{DROPPED}"')[0]
    retention = dt.timedelta(seconds=PUBLISHED_RETENTION)
    default = f"{db.OUTBOX}_default"
    return [
        Check(
            "ranges made ahead by the relays (outbox.partition_made)",
            made,
            1,
            "during the run; outbox_partition's first ones not counted",
            at_least=True,
        ),
        Check(
            "ranges holding rows dropped by the relays",
            int(with_rows),
            1,
            f"{rows:,} rows in them; {dropped} outbox.partition_dropped lines, empty ranges too",
            at_least=True,
        ),
        Check(
            "rows dropped with their range before PUBLISHED",
            int(db.value(f"SELECT count(*) FROM \"{DROPPED}\" WHERE status <> 'published'")),
            0,
        ),
        Check(
            f"rows dropped with their range before their retention ({PUBLISHED_RETENTION} s)",
            int(
                db.value(
                    f'SELECT count(*) FROM "{DROPPED}" WHERE published_at > dropped_at - %s',
                    [retention],
                )
            ),
            0,
        ),
        Check(
            "rows staged into the default partition (kept or deleted row by row)",
            int(db.value(f'SELECT count(*) FROM "{default}"'))
            + int(db.value(f"SELECT count(*) FROM {db.DELETED}")),
            0,
            "the relays keep ranges ahead",
        ),
        Check("producer transactions failed but for an outage", staging_failures(producer_logs), 0),
    ]


def staging_failures(logs: Sequence[Path]) -> int:
    """Transactions the producers saw fail with an error no database outage explains."""
    failed = (
        line
        for log in logs
        if log.exists()
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith(_FAILED)
    )
    return sum(1 for line in failed if not _OUTAGE.search(line))
