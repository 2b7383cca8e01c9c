"""PostgreSQL-only SQL: the NOTIFY trigger (and, with the relay, LISTEN and the claim)."""

from __future__ import annotations

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
