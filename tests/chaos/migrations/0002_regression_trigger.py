"""A trigger on the outbox table that records every PUBLISHED row set back to
another state in ``chaos_regression`` (see ``Regression``)."""

from django.db import migrations

OUTBOX = "django_outbox_outboxmessage"

CREATE = [
    """
    CREATE FUNCTION chaos_record_regression() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO chaos_regression (event_id, old_status, new_status, locked_by, at)
        VALUES (NEW.event_id, OLD.status, NEW.status, NEW.locked_by, clock_timestamp());
        RETURN NEW;
    END
    $$
    """,
    f"""
    CREATE TRIGGER chaos_record_regression AFTER UPDATE ON "{OUTBOX}"
    FOR EACH ROW WHEN (OLD.status = 'published' AND NEW.status <> 'published')
    EXECUTE FUNCTION chaos_record_regression()
    """,
]
DROP = [
    f'DROP TRIGGER IF EXISTS chaos_record_regression ON "{OUTBOX}"',
    "DROP FUNCTION IF EXISTS chaos_record_regression()",
]


class Migration(migrations.Migration):
    dependencies = [
        ("chaos", "0001_tables"),
        ("django_outbox", "0002_inbox_failure"),
    ]

    operations = [migrations.RunSQL(CREATE, DROP)]
