"""Triggers for the "Settings" section of docs/hostile-input.md."""

from __future__ import annotations

import pytest
from django.core import checks
from django.test import override_settings

from . import case


def check_lines(deploy: bool = False, **outbox: object) -> list[str]:
    """What ``manage.py check`` (``--deploy``) reports for ``OUTBOX = outbox``, one line
    per message."""
    with override_settings(OUTBOX=outbox, CELERY_BROKER_URL=None):
        # databases=[]: Django 6.1 asks each database otherwise
        found = checks.run_checks(databases=[], include_deployment_checks=deploy)
        return [f"{m.id}: {m.msg}" for m in found if m.id.startswith("django_outbox")]


def only(lines: list[str]) -> str:
    assert len(lines) == 1, lines
    return lines[0]


@case("setting-typo")
def setting_typo(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", BATCH_SIZ=10))


@case("setting-bad-value")
def setting_bad_value(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", BATCH_SIZE="lots"))


@case("no-broker")
def no_broker(request: object) -> str:
    return only(check_lines(deploy=True))


@case("route-typos")
def route_typos(request: object) -> str:
    routes = {"orders": {"queu": "orders", "exchange_type": "topik"}}
    return only(check_lines(BROKER_URL="memory://", ROUTES=routes))


@case("app-not-installed")
def app_not_installed(request: object) -> str:
    from django.conf import settings

    from django_outbox import stage

    from . import error_line

    installed = [app for app in settings.INSTALLED_APPS if app != "django_outbox"]
    with override_settings(INSTALLED_APPS=installed), pytest.raises(Exception) as raised:
        stage("order.placed", {}, destination="orders")  # was a bare LookupError
    return error_line(raised.value)
