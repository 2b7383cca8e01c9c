"""The admin's Django task results (docs/tasks.md): listed newest first, found by id or task
path, shown read-only with their values and tracebacks escaped. The table exists on every
Django; only enqueueing needs Django 6, so these rows are written directly."""

from __future__ import annotations

import datetime as dt
import uuid

import pytest
from django.urls import reverse
from django.utils import timezone

from django_outbox.models import TaskResultRecord, TaskStatus

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:django_outbox_taskresultrecord_changelist")


def result(path: str, status: str, age_minutes: int, **fields) -> TaskResultRecord:  # type: ignore[no-untyped-def]
    record = TaskResultRecord.objects.create(
        id=uuid.uuid4(),
        task_path=path,
        backend="default",
        queue_name="emails",
        status=status,
        **fields,
    )
    enqueued = timezone.now() - dt.timedelta(minutes=age_minutes)
    TaskResultRecord.objects.filter(id=record.id).update(enqueued_at=enqueued)
    return record


@pytest.fixture
def results() -> dict[str, TaskResultRecord]:
    return {
        "old": result("mail.tasks.send_welcome", TaskStatus.SUCCESSFUL, 30, return_value="ok"),
        "failed": result(
            "billing.tasks.charge",
            TaskStatus.FAILED,
            20,
            errors=[{"exception_class_path": "builtins.ValueError", "traceback": "<b>no</b>"}],
        ),
        "new": result("mail.tasks.send_receipt", TaskStatus.READY, 1, args=[1, "<i>x</i>"]),
    }


def ids_listed(html: str, results: dict[str, TaskResultRecord]) -> list[str]:
    found = [(html.index(str(r.id)), name) for name, r in results.items() if str(r.id) in html]
    return [name for _, name in sorted(found)]


def test_the_results_are_listed_newest_first_and_filtered_by_status(admin_client, results):
    assert ids_listed(admin_client.get(CHANGELIST).content.decode(), results) == [
        "new",
        "failed",
        "old",
    ]
    html = admin_client.get(CHANGELIST, {"status__exact": "FAILED"}).content.decode()
    assert ids_listed(html, results) == ["failed"]


def test_a_result_is_found_by_its_id_or_the_start_of_its_task_path(admin_client, results):
    html = admin_client.get(CHANGELIST, {"q": str(results["old"].id)}).content.decode()
    assert ids_listed(html, results) == ["old"]
    html = admin_client.get(CHANGELIST, {"q": "mail.tasks"}).content.decode()
    assert ids_listed(html, results) == ["new", "old"]


def test_a_result_is_shown_read_only_with_its_values_escaped(admin_client, results):
    change = reverse("admin:django_outbox_taskresultrecord_change", args=[results["failed"].id])
    html = admin_client.get(change).content.decode()
    assert '<pre class="outbox-error">builtins.ValueError\n&lt;b&gt;no&lt;/b&gt;</pre>' in html
    assert 'name="_save"' not in html
    admin_client.post(change, {"status": "SUCCESSFUL"})
    assert TaskResultRecord.objects.get(id=results["failed"].id).status == TaskStatus.FAILED
    change = reverse("admin:django_outbox_taskresultrecord_change", args=[results["new"].id])
    html = admin_client.get(change).content.decode()
    assert "&lt;i&gt;x&lt;/i&gt;" in html and "<i>x</i>" not in html
    assert admin_client.get(reverse("admin:django_outbox_taskresultrecord_add")).status_code == 403
