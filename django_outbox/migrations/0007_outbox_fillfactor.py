# Written by hand: Django has no model option for a table's storage parameters.

from django.db import migrations

# The table spelled out, as 0001 does: a migration never reads today's models.
SET_FILLFACTOR_SQL = 'ALTER TABLE "django_outbox_outboxmessage" SET (fillfactor = 50)'
RESET_FILLFACTOR_SQL = 'ALTER TABLE "django_outbox_outboxmessage" RESET (fillfactor)'


def set_fillfactor(apps, schema_editor):
    """PostgreSQL only (a no-op elsewhere): new rows fill an outbox page to half, so that
    the claim and the finalize can write each row's next version on its own page, where
    the WAL record leaves out the unchanged payload (docs/relay.md, "What a row costs
    PostgreSQL"). Takes a SHARE UPDATE EXCLUSIVE lock (reads and writes go on) and
    rewrites nothing: pages written before keep their rows."""
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(SET_FILLFACTOR_SQL)


def reset_fillfactor(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(RESET_FILLFACTOR_SQL)


class Migration(migrations.Migration):
    dependencies = [
        ("django_outbox", "0006_heartbeat_samples"),
    ]

    operations = [
        migrations.RunPython(set_fillfactor, reset_fillfactor, elidable=False),
    ]
