"""What staging logs is scrubbed of the configuration's passwords, like the relay's logs."""

from __future__ import annotations

import logging

import pytest
from django.db import transaction
from django.test import override_settings

from django_outbox import event_committed, stage

URL = "amqp://u:s3cret-pw@nohost.invalid//"


def failing_receiver(**kwargs):
    raise RuntimeError(f"could not notify {URL}")  # a receiver's error quoting a URL


@pytest.mark.django_db(transaction=True)
def test_a_failing_event_committed_receiver_is_logged_without_a_password(caplog):
    event_committed.connect(failing_receiver)
    try:
        with override_settings(OUTBOX={"BROKER_URL": URL}), caplog.at_level(logging.ERROR):
            with transaction.atomic():
                stage("order.placed", {"id": 1}, destination="orders")
    finally:
        event_committed.disconnect(failing_receiver)
    # Django's own django.dispatch logger logs it too: not this package's to scrub.
    (record,) = [r for r in caplog.records if r.name == "django_outbox.staging"]
    assert record.action == "outbox.signal_failed"
    assert "could not notify amqp://u:***@nohost.invalid//" in record.exc_text
    assert "s3cret-pw" not in record.getMessage() + record.exc_text
