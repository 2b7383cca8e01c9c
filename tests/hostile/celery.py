"""Triggers for the "Celery routes" section of docs/hostile-input.md."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.test import override_settings

from django_outbox import StagingError, stage
from django_outbox.models import OutboxMessage
from django_outbox.ops.checks import check_celery_confirms
from django_outbox.relay import Relay
from tests.support import AMQP_URL, confirming_celery_queue

from . import case, error_line

OUTBOX = {"BROKER_URL": AMQP_URL, "ROUTES": {"payments": {"celery_task": "billing.charge"}}}


def _relayed(payload: Any, headers: dict[str, Any] | None = None) -> str:
    """Stage one event to "payments" while it is a broker route (the default route), then
    relay it once "payments" is a Celery route; the row's last_error."""
    with transaction.atomic():
        row = stage("payment.made", payload, destination="payments", headers=headers)
    with override_settings(OUTBOX=OUTBOX), Relay() as relay:
        relay.run_once()
    row.refresh_from_db()
    assert row.status != OutboxMessage.Status.PUBLISHED, row.status
    return row.last_error


@case("celery-field-header")
def celery_field_header(request: object) -> str:
    try:
        with override_settings(OUTBOX=OUTBOX), transaction.atomic():
            stage("payment.made", {"n": 1}, destination="payments", headers={"task": "x.y"})
    except StagingError as exc:
        return error_line(exc)
    raise AssertionError("stage() accepted the header")


@case("celery-field-header-at-publish")
def celery_field_header_at_publish(request: object) -> str:
    return _relayed({"n": 1}, {"id": "8a3e4c1e-0d7b-4e59-9c3f-6f1a2b3c4d5e"})


@case("celery-kwargs-not-object")
def celery_kwargs_not_object(request: object) -> str:
    return _relayed([1, 2])


@case("celery-kombu-typed-payload")
def celery_kombu_typed_payload(request: object) -> str:
    return _relayed({"when": {"__type__": "datetime", "__value__": "2020-01-01T00:00:00"}})


@case("celery-nack")
def celery_nack(request: object) -> str:
    with confirming_celery_queue(**{"x-max-length": 0, "x-overflow": "reject-publish"}):
        return _relayed({"n": 1})


@case("celery-no-confirms")
def celery_no_confirms(request: object) -> str:
    from celery import Celery

    Celery("outbox-hostile", broker=AMQP_URL, set_as_current=True)
    with override_settings(OUTBOX=OUTBOX):
        (line,) = [f"{m.id}: {m.msg}" for m in check_celery_confirms()]
    return line
