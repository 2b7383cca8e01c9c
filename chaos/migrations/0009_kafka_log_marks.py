"""The ``stale_write`` trigger, narrowed once more: a relay starting with a Kafka
transactional id marks PUBLISHED the rows its record lists, whoever leases them
(``store.mark_in_log``: their events are in the topic, committed by the relay before it
with that id, which the new one has fenced; docs/kafka.md#exactly-once). That write
clears ``locked_by``, which no finalize does, and in the suite only rows of the
transactional route, ``chaos.kafka.payments``, are in such a record. Every other write
by a relay that does not hold the row's lease is still recorded (the kafka profile's
relay_kill aimed at that route found this one: 24 rows in a run of 2026-11-29)."""

import importlib

from django.db import migrations

narrowed = importlib.import_module("chaos.migrations.0004_followers_are_not_finalized")

FROM_THE_LOG = """
    NEW.status = 'published'
    AND NEW.locked_by = ''
    AND NEW.destination = 'chaos.kafka.payments'
"""


BEFORE = f"{narrowed.STALE} AND NOT ({narrowed.ONLY_DUE_TIME})"


class Migration(migrations.Migration):
    dependencies = [("chaos", "0008_committed")]

    operations = [
        migrations.RunSQL(
            [narrowed.DROP, narrowed.trigger(f"{BEFORE} AND NOT ({FROM_THE_LOG})")],
            [narrowed.DROP, narrowed.trigger(BEFORE)],
        )
    ]
