"""The only place that knows which database is underneath.

Callers ask capability questions (``supports_skip_locked``) or call
operations that are a no-op where the database lacks them (the NOTIFY trigger).
Vendor SQL lives in the submodules, named after Django's ``connection.vendor``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import postgresql

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.backends.base.schema import BaseDatabaseSchemaEditor


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
