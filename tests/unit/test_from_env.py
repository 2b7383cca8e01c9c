"""django_outbox.conf.from_env: the OUTBOX dict from environment variables."""

from __future__ import annotations

import datetime as dt
import os

import environ
import pytest
from django.test import override_settings

from django_outbox import OutboxConfigurationError
from django_outbox.conf import SETTINGS, from_env, outbox_settings


def test_only_the_variables_that_are_set_appear():
    assert from_env({}) == {}
    assert from_env({"OUTBOX_BATCH_SIZE": "", "OUTBOX_DEMO_DIR": "/tmp", "BATCH_SIZE": "5"}) == {}


@pytest.mark.parametrize(
    ("name", "text", "value"),
    [
        (
            "BROKER_URL",
            "amqp://guest:guest@localhost:5672//",
            "amqp://guest:guest@localhost:5672//",
        ),
        ("BROKER_TRANSPORT_OPTIONS", '{"confirm_publish": true}', {"confirm_publish": True}),
        ("ROUTES", '{"orders": {"queue": "orders"}}', {"orders": {"queue": "orders"}}),
        ("BROKERS", '{"events": {"URL": "memory://"}}', {"events": {"URL": "memory://"}}),
        ("DEFAULT_EXCHANGE", "events", "events"),
        ("DEFAULT_ROUTE", "false", False),
        ("DEFAULT_ROUTE", "On", True),
        ("DEFAULT_ROUTE", "0", False),
        ("BATCH_SIZE", "250", 250),
        ("MAX_BATCH_BYTES", "1_000_000", 1_000_000),
        ("MAX_PAYLOAD_BYTES", "65536", 65536),
        ("LEASE_SECONDS", "30", 30.0),
        ("MAX_ATTEMPTS", "3", 3),
        ("RETRY_BASE_DELAY", "0.5", 0.5),
        ("RETRY_MAX_DELAY", "600", 600.0),
        ("RETRY_JITTER", "0", 0.0),
        ("PUBLISHED_RETENTION", "86400", 86400.0),
        ("PUBLISHED_RETENTION", "0", 0.0),
        ("ABANDONED_RETENTION", "1e6", 1e6),
        ("INBOX_RETENTION", "3600", 3600.0),
        ("CLEANUP_INTERVAL", "60", 60.0),
        ("POLL_INTERVAL", "0.25", 0.25),
        ("PARTITIONING", '{"rows": 100000}', {"rows": 100000}),
    ],
)
def test_each_setting_is_cast_to_its_type(name, text, value):
    found = from_env({f"OUTBOX_{name}": text})
    assert found == {name: value}
    assert type(found[name]) is type(value)


def test_every_setting_is_read():
    """A setting added to conf.SETTINGS is read too."""
    env = {f"OUTBOX_{name}": "1" for name in SETTINGS}
    env.update(OUTBOX_BROKER_URL="memory://", OUTBOX_DEFAULT_EXCHANGE="x")
    env.update(OUTBOX_ROUTES="{}", OUTBOX_BROKER_TRANSPORT_OPTIONS="{}", OUTBOX_DEFAULT_ROUTE="1")
    env.update(OUTBOX_BROKERS="{}", OUTBOX_SIGNING_KEYS=f'["{"k" * 32}"]')
    env.update(OUTBOX_DEFAULT_ENVELOPE="cloudevents", OUTBOX_PARTITIONING='{"rows": 10}')
    assert set(from_env(env)) == set(SETTINGS)


def test_the_dict_is_what_outbox_settings_reads():
    env = {"OUTBOX_PUBLISHED_RETENTION": "60", "OUTBOX_ROUTES": '{"orders": {"queue": "o"}}'}
    with override_settings(OUTBOX={"BROKER_URL": "memory://", **from_env(env)}):
        assert outbox_settings.PUBLISHED_RETENTION == dt.timedelta(seconds=60)
        assert outbox_settings.route_for("orders").queue == "o"
        assert outbox_settings.problems() == []


def test_a_prefix_and_an_environ_env(monkeypatch):
    monkeypatch.setenv("SHOP_OUTBOX_BATCH_SIZE", "7")
    monkeypatch.setenv("OUTBOX_BATCH_SIZE", "9")
    assert from_env(prefix="SHOP_OUTBOX_") == {"BATCH_SIZE": 7}
    assert from_env(environ.Env())["BATCH_SIZE"] == 9
    assert from_env()["BATCH_SIZE"] == int(os.environ["OUTBOX_BATCH_SIZE"])


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        (
            "BATCH_SIZE",
            "lots",
            "OUTBOX_BATCH_SIZE (OUTBOX[\"BATCH_SIZE\"]) must be a positive integer; got 'lots'",
        ),
        ("BATCH_SIZE", "2.5", "must be a positive integer; got '2.5'"),
        (
            "MAX_ATTEMPTS",
            "0",
            "OUTBOX_MAX_ATTEMPTS (OUTBOX[\"MAX_ATTEMPTS\"]) must be a positive integer; got '0'",
        ),
        ("LEASE_SECONDS", "soon", "must be a positive number of seconds; got 'soon'"),
        ("POLL_INTERVAL", "-1", "must be a positive number of seconds; got '-1'"),
        ("RETRY_JITTER", "1.5", "must be a number between 0 and 1; got '1.5'"),
        ("DEFAULT_ROUTE", "maybe", "must be true or false (also 1/0, yes/no, on/off); got 'maybe'"),
        ("DEFAULT_EXCHANGE", "my exchange", "must be an exchange name of letters, digits"),
        (
            "ROUTES",
            "{orders}",
            'OUTBOX_ROUTES (OUTBOX["ROUTES"]) must be a JSON object of '
            "routes: Expecting property name enclosed in double quotes",
        ),
        ("ROUTES", '["orders"]', "must be a JSON object of routes: must be a dict"),
        ("ROUTES", '{"orders": {"queue": 5}}', "must be a JSON object of routes: route 'orders'"),
        ("BROKER_TRANSPORT_OPTIONS", "[]", "must be a JSON object: must be a dict"),
        ("PARTITIONING", '{"rows": 0}', 'must be a JSON object: {"rows": ids per partition'),
        # A number a timedelta cannot hold is refused like any other, not an OverflowError.
        ("PUBLISHED_RETENTION", "inf", "must be 0 or a positive number of seconds; got 'inf'"),
        ("INBOX_RETENTION", "1e30", "must be a positive number of seconds; got '1e30'"),
        ("LEASE_SECONDS", "1e400", "must be a positive number of seconds; got '1e400'"),
        # django-environ reads a leading $ as another variable's name.
        (
            "BROKER_URL",
            "$RABBIT_URL",
            'OUTBOX_BROKER_URL (OUTBOX["BROKER_URL"]) is "$RABBIT_URL", which django-environ '
            "reads as the variable RABBIT_URL, and RABBIT_URL is not set",
        ),
    ],
)
def test_a_bad_value_names_the_variable_and_the_type(name, text, error):
    with pytest.raises(OutboxConfigurationError) as raised:
        from_env({f"OUTBOX_{name}": text})
    assert error in str(raised.value)
    assert "\n" not in str(raised.value)


def test_spaces_around_a_value_are_not_part_of_it():
    # An .env file's "OUTBOX_BROKER_URL= amqp://..." or a trailing space.
    found = from_env({"OUTBOX_BROKER_URL": " amqp://shop:pw@rabbit// ", "OUTBOX_ROUTES": " {} "})
    assert found == {"BROKER_URL": "amqp://shop:pw@rabbit//", "ROUTES": {}}


def test_a_variable_may_name_another_one():
    env = {"OUTBOX_BROKER_URL": "$RABBIT_URL", "RABBIT_URL": "amqp://shop:pw@rabbit//"}
    assert from_env(env) == {"BROKER_URL": "amqp://shop:pw@rabbit//"}


def test_an_infinite_duration_is_refused_in_settings_too():
    with override_settings(OUTBOX={"LEASE_SECONDS": float("inf")}):
        with pytest.raises(OutboxConfigurationError, match="LEASE_SECONDS"):
            outbox_settings.LEASE_SECONDS  # noqa: B018


def test_no_error_shows_a_password():
    with pytest.raises(OutboxConfigurationError) as raised:
        from_env({"OUTBOX_BROKER_URL": "amqp://shop:pa/ss@rabbit:5672//"})
    assert str(raised.value) == (
        'OUTBOX_BROKER_URL (OUTBOX["BROKER_URL"]) must be a kombu URL such as '
        "amqp://user:password@host//; got amqp://shop:***@rabbit:5672//: its user name or "
        'password holds an unquoted "@", "/", "?" or "#"'
    )
    with pytest.raises(OutboxConfigurationError) as raised:
        from_env({"OUTBOX_BROKER_TRANSPORT_OPTIONS": '{"password": "hunter2",}'})
    assert "hunter2" not in str(raised.value)
    # json's own words and place, which differ by Python version (3.13: "Illegal
    # trailing comma ...: line 1 column 23", 3.11: "Expecting property name ...: column 24")
    assert "must be a JSON object: " in str(raised.value)
    assert "line 1 column 2" in str(raised.value)
