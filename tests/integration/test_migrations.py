"""Migration 0008 (the claim as a HOT update) on a table that already holds rows: the
rows from before its check constraints are made to agree with them, and every row
stays where the claim and the reports find it."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.db import connection

from django_outbox.models import OutboxMessage, OutboxStatus

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.plain_outbox(
        "migrates the outbox table back and forth: django_outbox's migrations make the plain"
        " table's unique constraints, which a partitioned table cannot have"
    ),
]

TABLE = OutboxMessage._meta.db_table
#: Rows as 0007 allowed them: a final state without its time, a time without its
#: state, a FAILED row without an error (status, published_at set, abandoned_at set,
#: last_error).
BEFORE = [
    ("published", False, False, ""),
    ("abandoned", False, False, "boom"),
    ("pending", True, True, ""),
    ("failed", False, False, ""),
    ("processing", False, False, ""),
]


def _insert_as_of_0007() -> None:
    with connection.cursor() as cursor:
        for n, (status, published, abandoned, error) in enumerate(BEFORE):
            cursor.execute(
                f"""INSERT INTO "{TABLE}" (event_id, event_type, destination, payload, headers,
                    ordering_key, status, attempts, available_at, locked_by, last_error,
                    created_at, published_at, abandoned_at, locked_until)
                VALUES (%s, 'e', 'd', '{{}}', '{{}}', '', %s, 0, now(), '', %s, now(),
                    CASE WHEN %s THEN now() END, CASE WHEN %s THEN now() END, now())""",
                [f"00000000-0000-0000-0000-{n:012d}", status, error, published, abandoned],
            )


def test_the_rows_of_before_agree_with_the_constraints_and_stay_findable():
    call_command("migrate", "django_outbox", "0007", verbosity=0)
    try:
        _insert_as_of_0007()
    finally:
        call_command("migrate", "django_outbox", verbosity=0)
    rows = {row.status: row for row in OutboxMessage.objects.all()}
    assert rows[OutboxStatus.PUBLISHED].published_at is not None
    assert rows[OutboxStatus.ABANDONED].abandoned_at is not None
    assert (rows[OutboxStatus.PENDING].published_at, rows[OutboxStatus.PENDING].abandoned_at) == (
        None,
        None,
    )
    assert rows[OutboxStatus.FAILED].last_error == "(no error text)"
    # Each is read where its state's index says it is: the claim (the pending row and the
    # PROCESSING one whose lease ran out), the failed rows, the final ones.
    due = set(OutboxMessage.objects.due().values_list("status", flat=True))
    assert due == {OutboxStatus.PENDING, OutboxStatus.FAILED, OutboxStatus.PROCESSING}
    assert OutboxMessage.objects.failed().count() == 1
    assert OutboxMessage.objects.published().count() == 1
    assert OutboxMessage.objects.abandoned().count() == 1
