"""PostgreSQL-only SQL: the NOTIFY trigger, LISTEN, the claim and row estimates."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from django.db.models.expressions import DatabaseDefault

from ..envelope import ClaimedMessage

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from ..models import OutboxMessage

#: The LISTEN/NOTIFY channel a relay waits on; the payload is the table name.
NOTIFY_CHANNEL = "django_outbox"
_FUNCTION = "django_outbox_notify"


def notify_trigger_sql(table: str) -> list[str]:
    """A statement-level trigger, so that staging N events costs one NOTIFY and no
    extra round trip; PostgreSQL delivers it when (and only if) the staging
    transaction commits, and folds repeats within one transaction into one."""
    return [
        f"""
        CREATE OR REPLACE FUNCTION {_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{NOTIFY_CHANNEL}', TG_TABLE_NAME);
            RETURN NULL;
        END
        $$
        """,
        f'CREATE TRIGGER {_FUNCTION} AFTER INSERT ON "{table}" '
        f"FOR EACH STATEMENT EXECUTE FUNCTION {_FUNCTION}()",
    ]


def drop_notify_trigger_sql(table: str) -> list[str]:
    return [
        f'DROP TRIGGER IF EXISTS {_FUNCTION} ON "{table}"',
        f"DROP FUNCTION IF EXISTS {_FUNCTION}()",
    ]


def _claim_sql() -> str:
    """The claim statement: parameters limit, max_bytes, lease seconds (twice), worker,
    token."""
    from ..models import CLAIMABLE, OutboxMessage, OutboxStatus

    table = OutboxMessage._meta.db_table
    claimable = ", ".join(f"'{status.value}'" for status in CLAIMABLE)
    return f"""
        WITH picked AS (
            SELECT id, available_at, octet_length(payload::text) AS size FROM "{table}"
            WHERE status IN ({claimable}) AND available_at <= now()
            ORDER BY available_at, id
            LIMIT %s
            FOR UPDATE SKIP LOCKED
        ), running AS (
            SELECT id, row_number() OVER w AS n, sum(size) OVER w AS total FROM picked
            WINDOW w AS (ORDER BY available_at, id)
        ), bounded AS (
            SELECT id FROM running WHERE n = 1 OR total <= %s
        )
        UPDATE "{table}" AS o
        SET status = '{OutboxStatus.PROCESSING.value}',
            available_at = now() + make_interval(secs => %s),
            locked_until = now() + make_interval(secs => %s),
            locked_by = %s,
            lease_token = %s
        FROM bounded
        WHERE o.id = bounded.id
        RETURNING o.id, o.event_id, o.event_type, o.destination, o.payload::text,
                  o.headers::text, o.ordering_key, o.attempts, o.created_at
    """


def claim(
    connection: BaseDatabaseWrapper,
    limit: int,
    max_bytes: int,
    lease_seconds: float,
    worker: str,
    token: uuid.UUID,
) -> list[ClaimedMessage]:
    """One statement, so one implicit transaction and one round trip: pick due rows
    through ``outbox_due_idx`` with SKIP LOCKED, lease them, return them. The
    payload comes back as JSON text, ready to publish without a decode/encode.

    Of the picked rows only the oldest whose payload text adds up to ``max_bytes``
    are leased (the first one always): a locking CTE cannot hold the window
    function, so a second CTE sums the sizes. Picked rows left out are unlocked
    when the statement ends, and the next claim takes them."""
    with connection.cursor() as cursor:
        cursor.execute(
            _claim_sql(), [limit, max_bytes, lease_seconds, lease_seconds, worker, token]
        )
        rows = cursor.fetchall()
    rows.sort()
    # Columns as in CLAIMED_FIELDS, the payload as JSON text and the headers to decode.
    return [
        ClaimedMessage.from_columns(
            row, payload=row[4], headers=json.loads(row[5]) if row[5] != "{}" else {}
        )
        for row in rows
    ]


def estimated_rows(queryset: QuerySet[Any]) -> int:
    """The planner's row estimate for ``queryset`` (``EXPLAIN (FORMAT JSON)``,
    which plans the query but does not run it).

    Unfiltered, this is ``pg_class.reltuples`` scaled to the table's current
    size, so it is right even before the first ANALYZE; filtered, it comes
    from the column statistics ANALYZE (or autovacuum) keeps.
    """
    (plan,) = json.loads(queryset.explain(format="json"))
    return int(plan["Plan"]["Plan Rows"])


#: Rows one INSERT writes at most: PostgreSQL takes 65,535 parameters a statement
#: (psycopg's ``server_side_binding`` sends them apart), and a row sends 7.
INSERT_MAX_ROWS = 65_535 // 7


def insert(connection: BaseDatabaseWrapper, rows: list[OutboxMessage]) -> None:
    """Stage ``rows`` with one INSERT per ``INSERT_MAX_ROWS`` rows and set what the
    database filled in (id, ``available_at`` unless given, ``created_at``: both the
    statement's time, as the columns' ``Now()`` defaults would have it).

    Leaner than ``bulk_create``: only the columns a new row needs are sent, and the
    ones every new row starts with (PENDING, no attempts, no lease) are constants."""
    for start in range(0, len(rows), INSERT_MAX_ROWS):
        _insert(connection, rows[start : start + INSERT_MAX_ROWS])


def _insert(connection: BaseDatabaseWrapper, rows: list[OutboxMessage]) -> None:
    from ..models import OutboxMessage, OutboxStatus

    table = OutboxMessage._meta.db_table
    values = (
        f"(%s, %s, %s, %s::jsonb, %s::jsonb, %s, coalesce(%s, statement_timestamp()), "
        f"'{OutboxStatus.PENDING.value}', 0, '', '')"
    )
    sql = (
        f'INSERT INTO "{table}" (event_id, event_type, destination, payload, headers, '
        "ordering_key, available_at, status, attempts, locked_by, last_error) "
        f"VALUES {', '.join([values] * len(rows))} "
        "RETURNING event_id, id, available_at, created_at"
    )
    params: list[Any] = []
    for row in rows:
        available_at = row.available_at
        params += (
            row.event_id,
            row.event_type,
            row.destination,
            json.dumps(row.payload),
            json.dumps(row.headers),
            row.ordering_key,
            None if isinstance(available_at, DatabaseDefault) else available_at,
        )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        saved = {event_id: values for event_id, *values in cursor.fetchall()}
    for row in rows:
        row.pk, row.available_at, row.created_at = saved[row.event_id]
        row._state.adding, row._state.db = False, connection.alias


class Listener:
    """A dedicated autocommit connection that LISTENs for staged rows.

    Kept apart from Django's connection so that waiting never holds a
    transaction open and a restart of PostgreSQL surfaces as an error here.
    """

    def __init__(self, connection: BaseDatabaseWrapper) -> None:
        import psycopg

        params = connection.get_connection_params()
        for django_only in ("cursor_factory", "context", "server_side_binding"):
            params.pop(django_only, None)
        self._conn = psycopg.connect(**params, autocommit=True)
        self._conn.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a notification; True if one came.
        Notifications that piled up meanwhile are consumed too."""
        woke = False
        for _ in self._conn.notifies(timeout=timeout, stop_after=1):
            woke = True
        if woke:
            for _ in self._conn.notifies(timeout=0):
                pass
        return woke

    def close(self) -> None:
        self._conn.close()
