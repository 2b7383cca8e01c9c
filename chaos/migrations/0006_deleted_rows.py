"""The outbox rows deleted during a run, for the audit. In the ``ci-deleting`` profile
the first relay keeps no PUBLISHED row (``PUBLISHED_RETENTION`` 0, no retention pass:
see ``chaos.__main__``), so every delete of an outbox row is that relay's, at the
row's confirm. A trigger copies every deleted row to ``chaos_deleted_row`` and records
as a ``stale_delete`` violation the delete of a row that was not PROCESSING, or whose
lease names another process (the lease token must stop it, as it stops a
``stale_write``; like that trigger, it tells processes apart, not leases). The view
``chaos_outbox_row`` is the outbox as the audit reads it: the table's rows, then the
deleted ones, a deleted PROCESSING row as PUBLISHED (the relay deletes only what the
broker confirmed)."""

from django.db import migrations

OUTBOX = "django_outbox_outboxmessage"
COLUMNS = "id, event_id, destination, ordering_key, sequence, status, locked_by, attempts"

CREATE = [
    """
    CREATE TABLE chaos_deleted_row (
        id bigint PRIMARY KEY, event_id uuid NOT NULL, destination text NOT NULL,
        ordering_key text NOT NULL, sequence bigint, status text NOT NULL,
        locked_by text NOT NULL, attempts integer NOT NULL, deleted_by text NOT NULL
    )
    """,
    "CREATE INDEX chaos_deleted_row_event_id ON chaos_deleted_row (event_id)",
    f"""
    CREATE FUNCTION chaos_keep_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
    DECLARE
        writer text := current_setting('application_name');
    BEGIN
        INSERT INTO chaos_deleted_row ({COLUMNS}, deleted_by)
        VALUES (OLD.id, OLD.event_id, OLD.destination, OLD.ordering_key, OLD.sequence,
                OLD.status, OLD.locked_by, OLD.attempts, writer);
        IF OLD.status <> 'processing'
           OR split_part(OLD.locked_by, ':', -1) <> split_part(writer, ' ', 2) THEN
            INSERT INTO chaos_violation
                (kind, event_id, old_status, new_status, locked_by, writer, at)
            VALUES ('stale_delete', OLD.event_id, OLD.status, 'deleted', OLD.locked_by,
                    writer, clock_timestamp());
        END IF;
        RETURN OLD;
    END
    $$
    """,
    f"""
    CREATE TRIGGER chaos_keep_deleted AFTER DELETE ON "{OUTBOX}"
    FOR EACH ROW EXECUTE FUNCTION chaos_keep_deleted()
    """,
    f"""
    CREATE VIEW chaos_outbox_row AS
    SELECT {COLUMNS} FROM "{OUTBOX}"
    UNION ALL
    SELECT id, event_id, destination, ordering_key, sequence,
           CASE WHEN status = 'processing' THEN 'published' ELSE status END,
           locked_by, attempts
    FROM chaos_deleted_row
    """,
]
DROP = [
    "DROP VIEW IF EXISTS chaos_outbox_row",
    f'DROP TRIGGER IF EXISTS chaos_keep_deleted ON "{OUTBOX}"',
    "DROP FUNCTION IF EXISTS chaos_keep_deleted()",
    "DROP TABLE IF EXISTS chaos_deleted_row",
]


class Migration(migrations.Migration):
    dependencies = [("chaos", "0005_task_effects"), ("django_outbox", "0004_ordering")]

    operations = [migrations.RunSQL(CREATE, DROP)]
