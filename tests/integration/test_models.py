"""Models, constraints, migrations and the public API surface."""

from __future__ import annotations

import datetime as dt
import io
import os
import subprocess
import sys
import uuid

import pytest
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from django_outbox.models import InboxMessage, OutboxMessage
from tests.factories import InboxMessageFactory, OutboxMessageFactory

Status = OutboxMessage.Status


def test_status_values_are_the_documented_lowercase_strings():
    assert Status.values == ["pending", "processing", "published", "failed", "abandoned"]


@pytest.mark.django_db
def test_migrations_match_the_models():
    out = io.StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out)
    assert "No changes detected" in out.getvalue()


@pytest.mark.django_db
def test_attempts_cannot_go_negative():
    with pytest.raises(IntegrityError, match="outbox_attempts_gte_0"), transaction.atomic():
        OutboxMessageFactory(attempts=-1)


@pytest.mark.django_db
def test_status_must_be_a_known_state():
    with pytest.raises(IntegrityError, match="outbox_status_valid"), transaction.atomic():
        OutboxMessageFactory(status="lost")


@pytest.mark.django_db
def test_inbox_marks_are_unique_per_consumer_and_event():
    event_id = uuid.uuid4()
    InboxMessageFactory(consumer="billing", event_id=event_id)
    InboxMessageFactory(consumer="shipping", event_id=event_id)
    with pytest.raises(IntegrityError, match="inbox_consumer_event_uniq"), transaction.atomic():
        InboxMessageFactory(consumer="billing", event_id=event_id)
    assert InboxMessage.objects.filter(event_id=event_id).count() == 2


@pytest.mark.django_db
def test_due_rows_are_available_pending_and_failed_rows_and_expired_leases():
    now = timezone.now()
    hour = dt.timedelta(hours=1)
    due = [
        OutboxMessageFactory(status=Status.PENDING, available_at=now - hour),
        OutboxMessageFactory(status=Status.FAILED, available_at=now - hour),
        # A claim leaves available_at as it was: the lease is locked_until.
        OutboxMessageFactory(
            status=Status.PROCESSING, available_at=now - hour, locked_until=now - hour
        ),
        # A lease without an end (no claim writes one) does not hold the row forever.
        OutboxMessageFactory(status=Status.PROCESSING, available_at=now - hour),
    ]
    OutboxMessageFactory(status=Status.PENDING, available_at=now + hour)
    OutboxMessageFactory(status=Status.FAILED, available_at=now + hour)
    OutboxMessageFactory(status=Status.PROCESSING, available_at=now - hour, locked_until=now + hour)
    # A lease taken before this release moved available_at too; it is held as well.
    OutboxMessageFactory(status=Status.PROCESSING, available_at=now + hour, locked_until=now + hour)
    OutboxMessageFactory(published=True)
    OutboxMessageFactory(status=Status.ABANDONED)
    assert list(OutboxMessage.objects.due()) == due
    assert OutboxMessage.objects.published().count() == 1


@pytest.mark.django_db
def test_notify_trigger_is_installed_on_postgresql():
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal",
            [OutboxMessage._meta.db_table],
        )
        assert cursor.fetchall() == [("django_outbox_notify",)]


def test_public_api_imports_before_django_setup():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = (
        "import django_outbox, sys;"
        "from django.conf import settings;"
        "assert not settings.configured;"
        "print(sorted(django_outbox.__all__))"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "publish_on_success" in result.stdout
    assert "stage_many" in result.stdout
