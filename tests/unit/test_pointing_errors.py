"""Errors that point at the fix (issue 42): the near miss a typo was meant to be, the hint
that fits the mistake, the app missing from INSTALLED_APPS named as such."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.core import checks
from django.test.utils import override_settings

from django_outbox import OutboxConfigurationError, UnknownDestination, stage
from django_outbox.apps import check_installed
from django_outbox.ops.checks import check_settings

RABBIT = "amqp://guest:guest@127.0.0.1:5672//"


def errors(**outbox: object) -> list[tuple[str, str, str]]:
    with override_settings(OUTBOX=outbox, CELERY_BROKER_URL=None):
        return [(error.id, error.msg, error.hint) for error in check_settings()]


def test_a_url_without_its_colon_gets_the_form_of_a_url_not_percent_encoding():
    assert errors(BROKER_URL="amqp//guest:guest@rabbit//") == [
        (
            "django_outbox.E010",
            "The broker URL ***@rabbit// is malformed: it is not of the form "
            "transport://user:password@host:port/vhost.",
            "Write the URL as transport://user:password@host:port/vhost, such as "
            'amqp://guest:guest@localhost:5672// (the transport is followed by "://").',
        )
    ]


def test_an_unquoted_password_gets_percent_encoding():
    ((check_id, msg, hint),) = errors(BROKER_URL="amqp://guest:pa@ss@rabbit//")
    assert (check_id, msg) == (
        "django_outbox.E010",
        "The broker URL amqp://guest:***@rabbit// is malformed: its user name or password "
        'holds an unquoted "@", "/", "?" or "#".',
    )
    assert hint.startswith("Percent-encode the user name and password")


def test_a_broken_failover_list_gets_the_form_of_a_list():
    ((check_id, msg, hint),) = errors(BROKER_URL="amqp://a//; amqp://b//")
    assert check_id == "django_outbox.E010"
    assert msg.endswith('its failover list has an empty address or white space around a ";".')
    assert hint == (
        'List the addresses of one broker separated by ";" with no spaces, all of one '
        "transport: amqp://u:p@host1//;amqp://u:p@host2//."
    )


def test_an_unknown_broker_alias_names_the_brokers_there_are_and_the_near_miss():
    brokers = {"default": {"URL": RABBIT}, "events": {"URL": RABBIT}}
    routes = {"clicks": {"queue": "clicks", "broker": "evnets"}}
    assert errors(BROKERS=brokers, ROUTES=routes) == [
        (
            "django_outbox.E015",
            "Route 'clicks' names broker 'evnets': No broker 'evnets' in OUTBOX[\"BROKERS\"] "
            "(did you mean 'events'?); the brokers configured are 'default' and 'events'.",
            'Add OUTBOX["BROKERS"][\'evnets\'] = {"URL": ...}, or name one of the brokers.',
        )
    ]


def test_a_destination_typo_is_refused_at_stage_time_naming_the_route_meant():
    """With DEFAULT_ROUTE off (what docs/deploying.md recommends in production), the typo
    fails in the request, before any SQL, saying which route was meant."""
    outbox = {"BROKER_URL": RABBIT, "DEFAULT_ROUTE": False, "ROUTES": {"orders": {}}}
    with override_settings(OUTBOX=outbox), pytest.raises(UnknownDestination) as raised:
        stage("order.placed", {}, destination="order")
    assert str(raised.value) == (
        "destination 'order' is not in OUTBOX['ROUTES'] (did you mean 'orders'?) and "
        "OUTBOX['DEFAULT_ROUTE'] is False: add a route for it or turn the default route on"
    )


@pytest.fixture
def without_the_app():
    installed = [app for app in settings.INSTALLED_APPS if app != "django_outbox"]
    with override_settings(INSTALLED_APPS=installed):
        yield


MISSING = (
    '"django_outbox" is not in INSTALLED_APPS: without it there is no outbox table to stage '
    "events in, no relay and no system check of OUTBOX."
)
FIX = 'Add "django_outbox" to INSTALLED_APPS in your settings, then run manage.py migrate.'


def test_check_names_installed_apps_when_the_app_is_imported_but_not_installed(
    without_the_app,
):
    assert check_installed() == [
        checks.Error(
            MISSING,
            hint=FIX,
            id="django_outbox.E050",
        )
    ]
    # Registered when django_outbox is imported: ready() never runs without the app.
    assert check_installed in checks.registry.registry.get_checks()


def test_the_check_is_silent_when_the_app_is_installed():
    assert check_installed() == []


def test_stage_names_installed_apps_instead_of_a_lookup_error(without_the_app):
    with pytest.raises(OutboxConfigurationError) as raised:
        stage("order.placed", {}, destination="orders")
    assert str(raised.value) == f"django_outbox.E050: {MISSING} {FIX}"
