"""A filesystem:// broker whose folder is missing: said in words at publish time (the text
of system check E012), then retried like a broker that is down."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test.utils import override_settings
from django.utils import timezone

from django_outbox import stage
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_missing_folder_fails_the_publish_with_its_option_then_it_is_retried(tmp_path):
    folder = tmp_path / "broker"
    options = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(tmp_path / "control"),
    }
    with transaction.atomic():
        row = stage("order.placed", {"order_id": 1}, destination="orders")
    outbox = {"BROKER_URL": "filesystem://", "BROKER_TRANSPORT_OPTIONS": options}
    with override_settings(OUTBOX=outbox):
        with Relay() as relay:
            stats = relay.run_once()
        row.refresh_from_db()
        assert (stats.published, stats.failed) == (0, 1)
        assert (row.status, row.attempts) == (OutboxMessage.Status.FAILED, 1)
        assert row.last_error.startswith(
            f"The filesystem:// broker's folder {str(folder)!r} "
            "(OUTBOX[\"BROKER_TRANSPORT_OPTIONS\"]['data_folder_out']) does not exist. "
            f"Create it (mkdir -p {folder}) where the relay and the consumers run"
        )
        assert "(FileNotFoundError: " in row.last_error

        folder.mkdir()
        OutboxMessage.objects.update(available_at=timezone.now())
        with Relay() as relay:
            assert relay.run_once().published == 1
    assert [path.suffix for path in folder.iterdir()] == [".msg"]
