"""The only place that knows which database is underneath.

Callers ask capability questions (``supports_skip_locked``) or call
operations that are a no-op where the database lacks them (the NOTIFY trigger).
Vendor SQL lives in the submodules, named after Django's ``connection.vendor``.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from typing import TYPE_CHECKING, Any

from django.db import connections, models, transaction
from django.db.models.functions import Now

from ..envelope import CLAIMED_FIELDS, ClaimedMessage
from . import postgresql

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor

    from ..models import OutboxMessage


def supports_skip_locked(connection: BaseDatabaseWrapper) -> bool:
    """Whether several relays can share this database (``SELECT ... FOR UPDATE SKIP LOCKED``)."""
    return bool(connection.features.has_select_for_update_skip_locked)


def supports_notify(connection: BaseDatabaseWrapper) -> bool:
    """Whether staging wakes relays on commit (PostgreSQL ``NOTIFY``)."""
    return connection.vendor == "postgresql"


def _outbox_table(apps: Any) -> str:
    return str(apps.get_model("django_outbox", "OutboxMessage")._meta.db_table)


def install_notify_trigger(apps: Any, schema_editor: BaseDatabaseSchemaEditor) -> None:
    """Migration step: make every INSERT into the outbox NOTIFY in its own transaction."""
    if supports_notify(schema_editor.connection):
        for statement in postgresql.notify_trigger_sql(_outbox_table(apps)):
            schema_editor.execute(statement)


def remove_notify_trigger(apps: Any, schema_editor: BaseDatabaseSchemaEditor) -> None:
    if supports_notify(schema_editor.connection):
        for statement in postgresql.drop_notify_trigger_sql(_outbox_table(apps)):
            schema_editor.execute(statement)


def now_plus(seconds: float) -> models.Expression:
    """The database clock plus ``seconds``, for ``update()`` and filters."""
    return models.ExpressionWrapper(
        Now() + models.Value(dt.timedelta(seconds=seconds), output_field=models.DurationField()),
        output_field=models.DateTimeField(),
    )


def claim(
    using: str, *, limit: int, lease_seconds: float, worker: str, token: uuid.UUID
) -> list[ClaimedMessage]:
    """Claim up to ``limit`` due rows, oldest first, for ``lease_seconds``.

    Rows locked by another relay's claim in progress are skipped, not waited
    for. Claimed rows are PROCESSING with ``lease_token=token`` and
    ``locked_until`` = database now + lease. Returned in id order.
    """
    connection = connections[using]
    if connection.vendor == "postgresql":
        return postgresql.claim(connection, limit, lease_seconds, worker, token)
    return _claim_portable(using, limit, lease_seconds, worker, token)


def insert(using: str, rows: list[OutboxMessage]) -> list[OutboxMessage]:
    """Write new outbox rows in one statement; returns them saved (primary key and
    database defaults filled in)."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        postgresql.insert(connection, rows)
        return rows
    return type(rows[0]).objects.using(using).bulk_create(rows)


def _claim_portable(
    using: str, limit: int, lease_seconds: float, worker: str, token: uuid.UUID
) -> list[ClaimedMessage]:
    """Any database Django supports: three statements in one transaction. Without
    SKIP LOCKED (SQLite) it is safe for one relay per database only."""
    from ..models import OutboxMessage, OutboxStatus

    rows = OutboxMessage.objects.using(using)
    with transaction.atomic(using=using):
        due = rows.due().order_by("available_at", "id")
        if supports_skip_locked(connections[using]):
            due = due.select_for_update(skip_locked=True)
        ids = list(due.values_list("id", flat=True)[:limit])
        if not ids:
            return []
        lease_end = now_plus(lease_seconds)
        rows.filter(id__in=ids).update(
            status=OutboxStatus.PROCESSING,
            available_at=lease_end,
            locked_until=lease_end,
            locked_by=worker,
            lease_token=token,
        )
        claimed = rows.filter(id__in=ids).order_by("id").values_list(*CLAIMED_FIELDS)
        # The JSONField decoded the payload; the wire wants it as text again.
        return [
            ClaimedMessage.from_columns(
                row, payload=json.dumps(row[4], ensure_ascii=False), headers=row[5]
            )
            for row in claimed
        ]


def listen(using: str) -> postgresql.Listener | None:
    """A listener that wakes when rows are staged on ``using``; None where the
    database cannot notify (the relay polls instead)."""
    connection = connections[using]
    if not supports_notify(connection):
        return None
    connection.ensure_connection()
    with connection.wrap_database_errors:  # psycopg errors become Django's DatabaseError
        return postgresql.Listener(connection)
