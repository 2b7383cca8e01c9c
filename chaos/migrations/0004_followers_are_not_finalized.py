"""The ``stale_write`` trigger, narrowed: a relay moving the due time of an ordered key's
waiting rows (parking or releasing the followers of a failed head, rows nobody holds)
is not a finalize. Such a write leaves a PENDING or FAILED row in its state, with its
attempts and lease token unchanged; the trigger no longer records it. Every other
write by a relay that does not hold the row's lease still is (the chaos runs of
issue 15 found the false positive once broker outages failed ordered heads)."""

from django.db import migrations

OUTBOX = "django_outbox_outboxmessage"
DROP = f'DROP TRIGGER IF EXISTS chaos_stale_write ON "{OUTBOX}"'
STALE = """
    NEW.status <> 'processing'
    AND split_part(OLD.locked_by, ':', -1)
        <> split_part(current_setting('application_name'), ' ', 2)
"""
ONLY_DUE_TIME = """
    OLD.status IN ('pending', 'failed')
    AND NEW.status = OLD.status
    AND NEW.attempts = OLD.attempts
    AND NEW.lease_token IS NOT DISTINCT FROM OLD.lease_token
"""


def trigger(condition: str) -> str:
    return (
        f'CREATE TRIGGER chaos_stale_write AFTER UPDATE ON "{OUTBOX}" '
        f"FOR EACH ROW WHEN ({condition}) "
        "EXECUTE FUNCTION chaos_record_violation('stale_write')"
    )


class Migration(migrations.Migration):
    dependencies = [("chaos", "0003_ordered_copy")]

    operations = [
        migrations.RunSQL(
            [DROP, trigger(f"{STALE} AND NOT ({ONLY_DUE_TIME})")],
            [DROP, trigger(STALE)],
        )
    ]
