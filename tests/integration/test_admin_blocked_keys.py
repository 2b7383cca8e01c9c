"""The admin's blocked keys on real PostgreSQL: listed above the outbox rows with the
head's error and age, released by "Requeue head" and "Skip head" (the actions, and the
buttons of each listed key), refused with a message naming the rows."""

from __future__ import annotations

import pytest
from django.urls import reverse

from django_outbox.models import OutboxMessage
from tests.integration.test_admin import CHANGELIST, logged_in, messages_of, run_action
from tests.integration.test_blocked_keys import key_rows

pytestmark = pytest.mark.django_db

Status = OutboxMessage.Status


@pytest.fixture
def poisoned() -> list[OutboxMessage]:
    """Key order-1: 1 published, 2 abandoned (the head), 3 waiting; key order-2 flows."""
    key_rows("order-2", Status.PENDING)
    return key_rows("order-1", Status.PUBLISHED, Status.ABANDONED, Status.PENDING)


def blocked_panel(response) -> str:
    html = response.content.decode()
    start = html.find('id="outbox-blocked"')
    return "" if start < 0 else html[start : html.index("</table>", start)]


def test_the_changelist_lists_blocked_keys_with_error_age_and_buttons(client, poisoned):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    panel = blocked_panel(client.get(CHANGELIST))
    head = poisoned[1]
    assert "1 blocked key</strong>" in panel
    assert "<td>order-1</td>" in panel
    assert "order-2" not in panel
    assert f'href="{reverse("admin:django_outbox_outboxmessage_change", args=[head.pk])}"' in panel
    assert "<td>3\xa0hours</td>" in panel
    assert "<td>1</td>" in panel  # one event waits
    assert "struct.error: &#x27;q&#x27; format requires" in panel  # escaped
    assert 'value="requeue_head"' in panel
    assert 'value="skip_head"' in panel


def test_a_head_abandoned_in_the_admin_says_it_has_no_error_as_outbox_status_does(
    admin_client, poisoned
):
    """A pending head abandoned by the admin's *Abandon* has no last_error."""
    OutboxMessage.objects.filter(pk=poisoned[1].pk).update(last_error="")
    panel = blocked_panel(admin_client.get(CHANGELIST))
    assert "<td>no error recorded</td>" in panel


def test_view_only_staff_sees_blocked_keys_without_buttons(client, poisoned):
    logged_in(client, "view_outboxmessage")
    panel = blocked_panel(client.get(CHANGELIST))
    assert "<td>order-1</td>" in panel
    assert "skip_head" not in panel


def test_no_panel_when_no_key_is_blocked(admin_client):
    key_rows("order-1", Status.FAILED, Status.PENDING)
    assert blocked_panel(admin_client.get(CHANGELIST)) == ""


def test_rows_show_their_sequence_and_the_detail_page_when_skipped(admin_client, poisoned):
    html = admin_client.get(CHANGELIST).content.decode()
    assert '<td class="field-sequence">2</td>' in html
    page = admin_client.get(
        reverse("admin:django_outbox_outboxmessage_change", args=[poisoned[1].pk])
    )
    assert "Skipped at" in page.content.decode()
    assert "Sequence" in page.content.decode()


def test_skip_head_asks_for_confirmation_first_and_changes_nothing(client, poisoned):
    """What the button of a listed key posts (the action and the head's id alone) opens a
    page that lists the head and warns that a skip cannot be undone."""
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    response = client.post(
        CHANGELIST,
        {"action": "skip_head", "_selected_action": [poisoned[1].pk], "index": 0},
    )
    assert response.status_code == 200
    html = response.content.decode()
    assert "Skipping cannot be undone." in html
    assert f"<tr><td>{poisoned[1].pk}</td><td>order.changed</td><td>orders</td>" in html
    assert f'name="_selected_action" value="{poisoned[1].pk}"' in html
    assert 'name="post" value="yes"' in html
    assert OutboxMessage.objects.get(pk=poisoned[1].pk).status == Status.ABANDONED


def test_skip_head_once_confirmed_skips_the_head(client, poisoned):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    response = client.post(
        CHANGELIST,
        {"action": "skip_head", "_selected_action": [poisoned[1].pk], "post": "yes"},
    )
    assert response.status_code == 302
    assert messages_of(response) == [
        ("success", "1 head skipped: a skip marker is published in its place; its key moves on.")
    ]
    head = OutboxMessage.objects.get(pk=poisoned[1].pk)
    assert (head.status, head.skipped_at is not None) == (Status.PENDING, True)
    assert blocked_panel(client.get(CHANGELIST)) == ""


def test_requeue_head_action_requeues_the_head(client, poisoned):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    response = run_action(client, "requeue_head", [poisoned[1]])
    assert messages_of(response) == [
        ("success", "1 head requeued: pending again, attempts reset; its key follows.")
    ]
    head = OutboxMessage.objects.get(pk=poisoned[1].pk)
    assert (head.status, head.skipped_at, head.last_error) == (Status.PENDING, None, "")


def test_head_actions_refuse_naming_the_rows_and_change_nothing(client, poisoned):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    response = client.post(
        CHANGELIST,
        {"action": "skip_head", "_selected_action": [r.pk for r in poisoned], "post": "yes"},
    )
    assert messages_of(response) == [
        (
            "error",
            "refused: only the failed or abandoned head of an ordered key can be skipped; not "
            f"{poisoned[0].pk} (published, not failed or abandoned), "
            f"{poisoned[2].pk} (pending, not failed or abandoned); nothing skipped",
        )
    ]
    assert OutboxMessage.objects.get(pk=poisoned[1].pk).status == Status.ABANDONED
    assert not OutboxMessage.objects.filter(skipped_at__isnull=False).exists()


def test_head_actions_need_the_requeue_permission(client, poisoned):
    logged_in(client, "view_outboxmessage", "change_outboxmessage")
    confirmed = {"action": "skip_head", "_selected_action": [poisoned[1].pk], "post": "yes"}
    assert "Skipping cannot be undone." not in client.post(CHANGELIST, confirmed).content.decode()
    run_action(client, "requeue_head", [poisoned[1]])
    assert OutboxMessage.objects.get(pk=poisoned[1].pk).status == Status.ABANDONED
