"""OUTBOX["BROKERS"]: parsing, the short form, and the checks that name the alias.
No services: nothing here connects."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
from django.test import override_settings

from django_outbox.conf import outbox_settings
from django_outbox.conf.routes import parse_routes
from django_outbox.exceptions import OutboxConfigurationError

RABBIT = "amqp://guest:s3cret@rabbit:5672//"
REDIS = "redis://:s3cret@redis:6379/0"


def problems(celery_url=None, **outbox):
    with override_settings(OUTBOX=outbox, CELERY_BROKER_URL=celery_url):
        return [(p.id, p.msg) for p in outbox_settings.problems()]


def brokers(celery_url=None, **outbox):
    with override_settings(OUTBOX=outbox, CELERY_BROKER_URL=celery_url):
        return {
            alias: (b.url, dict(b.options), b.setting)
            for alias, b in outbox_settings.brokers.items()
        }


def test_brokers_by_alias():
    table = {
        "default": {"URL": RABBIT},
        "events": {"URL": REDIS, "OPTIONS": {"visibility_timeout": 60}},
    }
    assert brokers(BROKERS=table) == {
        "default": (RABBIT, {}, 'OUTBOX["BROKERS"]["default"]'),
        "events": (REDIS, {"visibility_timeout": 60}, 'OUTBOX["BROKERS"]["events"]'),
    }
    assert problems(BROKERS=table) == []


def test_broker_url_is_the_short_form_of_the_default_broker():
    options = {"data_folder_in": "/x"}
    assert brokers(BROKER_URL=RABBIT, BROKER_TRANSPORT_OPTIONS=options) == {
        "default": (RABBIT, options, 'OUTBOX["BROKER_URL"]')
    }
    assert brokers(celery_url=REDIS) == {"default": (REDIS, {}, "CELERY_BROKER_URL")}
    both = brokers(BROKER_URL=RABBIT, BROKERS={"events": {"URL": REDIS}})
    assert set(both) == {"default", "events"}


def test_the_default_broker_set_twice_is_e014_at_check_and_run_time():
    settings = {"BROKER_URL": RABBIT, "BROKERS": {"default": {"URL": REDIS}}}
    assert problems(**settings) == [
        (
            "django_outbox.E014",
            'OUTBOX["BROKERS"]["default"] and OUTBOX["BROKER_URL"] both set the default broker.',
        )
    ]
    with pytest.raises(OutboxConfigurationError, match=r"^django_outbox\.E014: "):
        brokers(**settings)
    options_too = {"BROKER_TRANSPORT_OPTIONS": {"a": 1}, "BROKERS": {"default": {"URL": REDIS}}}
    assert [p[0] for p in problems(**options_too)] == ["django_outbox.E014"]


@pytest.mark.parametrize(
    ("table", "reason"),
    [
        (
            [RABBIT],
            'OUTBOX["BROKERS"] must be a dict of alias -> {"URL": ..., "OPTIONS": {...}}; '
            "got list.",
        ),
        (
            {"events": RABBIT},
            'OUTBOX["BROKERS"]["events"] must be a dict with "URL" and optional '
            '"OPTIONS"; got str.',
        ),
        ({"events": {}}, 'OUTBOX["BROKERS"]["events"] has no "URL".'),
        ({"events": {"URL": ""}}, 'OUTBOX["BROKERS"]["events"]["URL"] must be a non-empty string.'),
        (
            {"events": {"URL": REDIS, "OPTIONS": [1]}},
            'OUTBOX["BROKERS"]["events"]["OPTIONS"] must be a dict with string keys; got list.',
        ),
        (
            {"events": {"URL": REDIS, "OPTION": {}}},
            'OUTBOX["BROKERS"]["events"] has unknown '
            "keys ['OPTION']; a broker takes URL and OPTIONS.",
        ),
        (
            {"": {"URL": REDIS}},
            'OUTBOX["BROKERS"] has an alias that is not a non-empty string: str.',
        ),
    ],
)
def test_a_malformed_brokers_setting_is_e013_naming_the_alias_and_no_value(table, reason):
    assert problems(BROKER_URL=RABBIT, BROKERS=table) == [("django_outbox.E013", reason)]


def test_each_brokers_url_is_checked_naming_the_alias_without_the_password():
    table = {"default": {"URL": RABBIT}, "events": {"URL": "amqp://guest:p@ss@rabbit//"}}
    ((check_id, msg),) = problems(BROKERS=table)
    assert check_id == "django_outbox.E010"
    assert msg.startswith(
        'The broker URL amqp://guest:***@rabbit// of OUTBOX["BROKERS"]["events"] is malformed: '
    )
    unknown = {"default": {"URL": RABBIT}, "events": {"URL": "amqqp://u:s3cret@h//"}}
    assert problems(BROKERS=unknown) == [
        (
            "django_outbox.E007",
            'The broker URL of OUTBOX["BROKERS"]["events"] names an unknown kombu transport '
            "'amqqp'.",
        )
    ]


def test_a_missing_driver_names_the_alias_and_the_extra():
    with mock.patch.dict(sys.modules, {"redis": None}):
        ((check_id, msg),) = problems(
            BROKERS={"default": {"URL": RABBIT}, "events": {"URL": REDIS}}
        )
    assert check_id == "django_outbox.E011"
    assert msg == (
        'The broker URL redis://:***@redis:6379/0 of OUTBOX["BROKERS"]["events"] needs the '
        "Python package 'redis', which is not installed: pip install "
        '"django-transactional-outbox[redis]"'
    )


def test_a_route_naming_an_unknown_alias_is_e015():
    routes = {"clicks": {"queue": "clicks", "broker": "events"}}
    assert problems(BROKER_URL=RABBIT, ROUTES=routes) == [
        (
            "django_outbox.E015",
            "Route 'clicks' names broker 'events': No broker 'events' in OUTBOX[\"BROKERS\"]; "
            "the only broker configured is 'default'.",
        )
    ]


def test_without_a_default_broker_the_default_route_is_e015_unless_it_is_off():
    table = {"events": {"URL": REDIS}}
    routes = {"clicks": {"queue": "clicks", "broker": "events"}}
    assert [p[0] for p in problems(BROKERS=table, ROUTES=routes)] == ["django_outbox.E015"]
    assert problems(BROKERS=table, ROUTES=routes, DEFAULT_ROUTE=False) == []


def test_a_route_takes_the_default_broker_unless_it_names_one():
    routes = parse_routes({"a": {}, "b": {"broker": "events"}}, "outbox")
    assert (routes["a"].broker, routes["b"].broker) == ("default", "events")
    with pytest.raises(ValueError, match="route 'c' mixes celery_task with"):
        parse_routes({"c": {"celery_task": "t", "broker": "events"}}, "outbox")
    with pytest.raises(ValueError, match="route 'd' has an empty broker alias"):
        parse_routes({"d": {"broker": ""}}, "outbox")


def test_celery_routes_without_celery_are_e016_naming_the_extra():
    routes = {"emails": {"celery_task": "shop.tasks.send_receipt"}}
    with mock.patch.dict(sys.modules, {"celery": None}):
        assert problems(BROKER_URL=RABBIT, ROUTES=routes) == [
            (
                "django_outbox.E016",
                "Routes ['emails'] send Celery tasks (celery_task), which requires the celery "
                'package: pip install "django-transactional-outbox[celery]"',
            )
        ]
    assert problems(BROKER_URL=RABBIT, ROUTES=routes) == []


def test_require_broker_names_the_setting():
    with override_settings(OUTBOX={"BROKER_URL": RABBIT}, CELERY_BROKER_URL=None):
        assert outbox_settings.require_broker().url == RABBIT
        with pytest.raises(OutboxConfigurationError, match=r"^django_outbox\.E015: No broker 'x'"):
            outbox_settings.require_broker("x")
    with override_settings(OUTBOX={}, CELERY_BROKER_URL=None):
        with pytest.raises(OutboxConfigurationError, match=r"^django_outbox\.E006: No broker URL"):
            outbox_settings.require_broker()


def test_the_passwords_of_every_broker_are_secrets():
    table = {
        "default": {"URL": RABBIT},
        "events": {"URL": REDIS, "OPTIONS": {"sentinel_kwargs": {"password": "opt-pw"}}},
    }
    with override_settings(OUTBOX={"BROKERS": table}):
        text = outbox_settings.redact("s3cret and opt-pw leaked")
    assert "s3cret" not in text and "opt-pw" not in text
