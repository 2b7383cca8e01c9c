"""PostgreSQL only: the claim, the staging INSERT, LISTEN and row estimates (their SQL
is in ``queries.sql``; the NOTIFY trigger is installed by the migrations)."""

from __future__ import annotations

import functools
import json
import uuid
from typing import TYPE_CHECKING, Any

from django.db.models.expressions import DatabaseDefault

from ..envelope import ClaimedMessage
from . import queries

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models import QuerySet

    from ..models import OutboxMessage

#: The LISTEN/NOTIFY channel a relay waits on; the payload is the table name.
NOTIFY_CHANNEL = "django_outbox"


@functools.cache
def _claim_sql() -> str:
    """The claim statement (named query ``claim``) for the outbox table."""
    from ..models import CLAIMABLE, OutboxMessage, OutboxStatus

    return queries.sql(
        "claim",
        identifiers={"table": OutboxMessage._meta.db_table},
        literals={
            "claimable": [status.value for status in CLAIMABLE],
            "processing": OutboxStatus.PROCESSING.value,
        },
    )


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
        build = ClaimedMessage.reader(
            [column.name for column in cursor.description], headers=_headers
        )
        return sorted(map(build, cursor.fetchall()), key=lambda message: message.id)


def _headers(text: str) -> dict[str, Any]:
    """The headers column, JSON text as Django's psycopg setup returns ``jsonb``."""
    return json.loads(text) if text != "{}" else {}


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

    values = queries.sql("insert_row", literals={"pending": OutboxStatus.PENDING.value})
    sql = queries.sql(
        "insert",
        identifiers={"table": OutboxMessage._meta.db_table},
        fragments={"rows": ", ".join([values] * len(rows))},
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
        self._conn.execute(queries.sql("listen", identifiers={"channel": NOTIFY_CHANNEL}))

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
