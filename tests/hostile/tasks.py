"""Triggers for the "Django tasks" section of docs/hostile-input.md. All but the route
case need ``django.tasks`` (Django 6.0+) and skip without it."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test import override_settings

from tests.hostile.settings import check_lines, only

from . import case, error_line

BACKEND = "django_outbox.tasks.OutboxTaskBackend"


def _djtasks():  # type: ignore[no-untyped-def]
    pytest.importorskip("django.tasks", reason="django.tasks is Django 6.0+")
    from tests.testapp import djtasks

    return djtasks


@case("task-outside-transaction")
def task_outside_transaction(request: object) -> str:
    from django_outbox import NotInTransaction

    djtasks = _djtasks()
    options = {"REQUIRE_TRANSACTION": True}
    with override_settings(TASKS={"default": {"BACKEND": BACKEND, "OPTIONS": options}}):
        try:
            djtasks.add.enqueue(1, 2)
        except NotInTransaction as exc:
            return error_line(exc)
    raise AssertionError("enqueue() ran in autocommit mode under REQUIRE_TRANSACTION")


@case("task-arguments-not-json")
def task_arguments_not_json(request: object) -> str:
    try:
        with transaction.atomic():
            _djtasks().add.enqueue(1, {2, 3})
    except TypeError as exc:
        return error_line(exc)
    raise AssertionError("enqueue() took a set")


@case("task-bad-queue-name")
def task_bad_queue_name(request: object) -> str:
    _djtasks()
    tasks = {"default": {"BACKEND": BACKEND, "QUEUES": ["default", "two words"]}}
    with override_settings(TASKS=tasks):
        return only([line for line in check_lines(BROKER_URL="memory://") if "E019" in line])


@case("task-route-name")
def task_route_name(request: object) -> str:
    routes = {"django.tasks:emails": {"queue": "emails"}}
    return only(check_lines(BROKER_URL="memory://", ROUTES=routes))
