"""Triggers on the outbox table that record rule-breaking writes in ``chaos_violation``
(see ``Violation``). Each chaos process's ``application_name`` is ``"<role> <pid>"``
and a relay's ``locked_by`` is ``"<host>:<pid>"``, so the pids tell who wrote a row
and who held its lease."""

from django.db import migrations

OUTBOX = "django_outbox_outboxmessage"

CREATE = [
    """
    CREATE FUNCTION chaos_record_violation() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO chaos_violation
            (kind, event_id, old_status, new_status, locked_by, writer, at)
        VALUES (TG_ARGV[0], NEW.event_id, OLD.status, NEW.status, OLD.locked_by,
                current_setting('application_name'), clock_timestamp());
        RETURN NEW;
    END
    $$
    """,
    f"""
    CREATE TRIGGER chaos_set_back AFTER UPDATE ON "{OUTBOX}"
    FOR EACH ROW WHEN (OLD.status = 'published' AND NEW.status <> 'published')
    EXECUTE FUNCTION chaos_record_violation('set_back')
    """,
    # A finalize (any write that ends PROCESSING or rewrites an outcome) by a relay
    # other than the one named in the row's lease.
    f"""
    CREATE TRIGGER chaos_stale_write AFTER UPDATE ON "{OUTBOX}"
    FOR EACH ROW WHEN (
        NEW.status <> 'processing'
        AND split_part(OLD.locked_by, ':', -1)
            <> split_part(current_setting('application_name'), ' ', 2)
    )
    EXECUTE FUNCTION chaos_record_violation('stale_write')
    """,
]
DROP = [
    f'DROP TRIGGER IF EXISTS chaos_set_back ON "{OUTBOX}"',
    f'DROP TRIGGER IF EXISTS chaos_stale_write ON "{OUTBOX}"',
    "DROP FUNCTION IF EXISTS chaos_record_violation()",
]


class Migration(migrations.Migration):
    dependencies = [
        ("chaos", "0001_tables"),
        ("django_outbox", "0002_inbox_failure"),
    ]

    operations = [migrations.RunSQL(CREATE, DROP)]
