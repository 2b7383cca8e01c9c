"""The admin's actions on "select all" over 20,000 rows: refused in one line that names
the management command for bulk changes, not a confirmation page of megabytes listing
every row (skip head's), nor an error naming each refused row, nor an UPDATE of every
row from a web request."""

from __future__ import annotations

import pytest
from django.db import connection

from django_outbox.admin import ACTION_ROW_LIMIT
from django_outbox.models import OutboxMessage
from tests.integration.test_admin import CHANGELIST, messages_of

pytestmark = pytest.mark.django_db

KEYS = 10_250  # two rows each: more than 20,000 rows
#: What any answer may weigh: a page of the list, its summary and its filters.
PAGE_BYTES = 200_000


@pytest.fixture
def blocked() -> int:
    """``KEYS`` ordered keys, each blocked: an abandoned head and an abandoned row behind
    it (not a head: a "skip head" of every row refuses half of them)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO "{OutboxMessage._meta.db_table}" (event_id, event_type,
                destination, payload, headers, ordering_key, status, attempts, available_at,
                locked_by, last_error, created_at, abandoned_at, sequence)
            SELECT gen_random_uuid(), 'order.placed', 'ledger', '{{}}'::jsonb, '{{}}'::jsonb,
                'order-' || k, 'abandoned', 10, now(), '', 'struct.error: bad', now(), now(), s
            FROM generate_series(1, %s) AS k, generate_series(1, 2) AS s""",
            [KEYS],
        )
        cursor.execute(f'ANALYZE "{OutboxMessage._meta.db_table}"')  # counts our own rows
    return 2 * KEYS


@pytest.mark.parametrize(
    ("action", "command"),
    [
        ("requeue", ", or run manage.py outbox_requeue --status failed|abandoned"),
        ("abandon", ""),
        ("requeue_head", ", or run manage.py outbox_requeue --id"),
        ("skip_head", ", or run manage.py outbox_skip --id"),
    ],
)
@pytest.mark.parametrize("post", ["", "yes"], ids=["asked", "confirmed"])
def test_an_action_on_more_rows_than_the_limit_is_refused_in_one_line(
    admin_client, blocked, action, command, post
):
    response = admin_client.post(
        CHANGELIST + "?status__exact=abandoned",
        {"action": action, "select_across": 1, "index": 0, "_selected_action": [0], "post": post},
        follow=True,
    )
    assert response.status_code == 200
    assert len(response.content) < PAGE_BYTES
    assert messages_of(response) == [
        (
            "error",
            f"More than {ACTION_ROW_LIMIT} messages selected: an action changes at most "
            f"{ACTION_ROW_LIMIT}. Filter the list to fewer{command}.",
        )
    ]
    assert OutboxMessage.objects.filter(status="abandoned", skipped_at=None).count() == blocked


def test_an_action_on_the_limit_exactly_runs(admin_client, blocked):
    """The limit is the most rows an action takes, not one fewer: the heads of as many
    keys are skipped, their confirmation listing each."""
    heads = OutboxMessage.objects.filter(sequence=1).order_by("id")[:ACTION_ROW_LIMIT]
    chosen = [row.pk for row in heads]
    asked = admin_client.post(
        CHANGELIST, {"action": "skip_head", "index": 0, "_selected_action": chosen}
    )
    assert asked.status_code == 200 and len(asked.context["rows"]) == ACTION_ROW_LIMIT
    done = admin_client.post(
        CHANGELIST,
        {"action": "skip_head", "index": 0, "_selected_action": chosen, "post": "yes"},
    )
    assert messages_of(done)[-1][0] == "success"
    assert OutboxMessage.objects.exclude(skipped_at=None).count() == ACTION_ROW_LIMIT
