"""System checks: each bad OUTBOX value gives one exact, namespaced error with a hint."""

from __future__ import annotations

import datetime as dt

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections
from django.test.utils import override_settings

from django_outbox.conf import SETTINGS, outbox_settings
from django_outbox.conf.routes import Route
from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.ops.checks import (
    check_broker_configured,
    check_brokers,
    check_databases,
    check_settings,
)

BROKER = {"BROKER_URL": "amqp://guest:guest@127.0.0.1:55672//"}


def run_with(outbox, **more):
    with override_settings(OUTBOX=outbox, **more):
        return check_settings()


def test_the_test_settings_are_valid():
    assert check_settings() == []


def test_every_setting_has_a_valid_default():
    with override_settings(OUTBOX=BROKER):
        for name in SETTINGS:
            getattr(outbox_settings, name)


def test_outbox_must_be_a_dict():
    assert run_with(["amqp://"]) == [
        checks.Error(
            "settings.OUTBOX must be a dict; got list.",
            hint='Write OUTBOX = {"BROKER_URL": "amqp://..."} in your settings.',
            id="django_outbox.E001",
        )
    ]


def test_unknown_key_is_an_error_not_silence():
    (error,) = run_with({**BROKER, "COLOUR": "blue"})
    assert error == checks.Error(
        'OUTBOX["COLOUR"] is not a setting of django_outbox.',
        hint=f"Known settings: {', '.join(SETTINGS)}.",
        id="django_outbox.E002",
    )


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("ROUTE", "ROUTES"), ("MAX_ATTEMPT", "MAX_ATTEMPTS"), ("BATCHSIZE", "BATCH_SIZE")],
)
def test_a_misspelt_setting_says_which_one_was_meant(typo, meant):
    (error,) = run_with({**BROKER, typo: 1})
    assert error == checks.Error(
        f'OUTBOX["{typo}"] is not a setting of django_outbox (did you mean {meant!r}?).',
        hint=f"Known settings: {', '.join(SETTINGS)}.",
        id="django_outbox.E002",
    )


def test_every_problem_of_a_route_is_reported_at_once_with_what_was_meant():
    routes = {
        "orders": {"queu": "orders", "exchange_type": "topik"},
        "emails": {"queue": "emails", "queue_type": "quorom"},
    }
    (error,) = run_with({**BROKER, "ROUTES": routes})
    assert error.id == "django_outbox.E004"
    assert error.msg == (
        'OUTBOX["ROUTES"] is invalid: '
        "route 'orders' has unknown keys ['queu' (did you mean 'queue'?)]; "
        "route 'orders' exchange_type must be one of direct, topic, fanout, headers or a "
        "plugin type starting with x-; got 'topik' (did you mean 'topic'?); "
        "route 'emails' queue type must be one of classic, quorum; got 'quorom' "
        "(did you mean 'quorum'?)."
    )


def test_bad_value_names_the_setting_the_expectation_and_the_default():
    assert run_with({**BROKER, "BATCH_SIZE": "lots"}) == [
        checks.Error(
            "OUTBOX[\"BATCH_SIZE\"] must be a positive integer; got 'lots'.",
            hint="Default: 500. rows the relay claims per batch.",
            id="django_outbox.E003",
        )
    ]


@pytest.mark.parametrize(
    ("name", "value", "expectation"),
    [
        ("BATCH_SIZE", 0, "must be a positive integer"),
        ("BATCH_SIZE", True, "must be a positive integer"),
        ("MAX_ATTEMPTS", 2.5, "must be a positive integer"),
        ("LEASE_SECONDS", -1, "must be a positive number of seconds or a timedelta"),
        ("LEASE_SECONDS", "60", "must be a positive number of seconds or a timedelta"),
        (
            "RETRY_BASE_DELAY",
            dt.timedelta(0),
            "must be a positive number of seconds or a timedelta",
        ),
        ("RETRY_JITTER", 1.5, "must be a number between 0 and 1"),
        ("PUBLISHED_RETENTION", None, "must be 0, a positive number of seconds or a timedelta"),
        ("PUBLISHED_RETENTION", 1e-7, "must be 0, a positive number of seconds or a timedelta"),
        ("ABANDONED_RETENTION", 1e-7, "must be a positive number of seconds or a timedelta"),
        ("POLL_INTERVAL", 0, "must be a positive number of seconds or a timedelta"),
        ("DEFAULT_ROUTE", "yes", "must be True or False"),
        ("DEFAULT_EXCHANGE", "has space", "must be an exchange name of letters, digits and ._:/-"),
        ("BROKER_TRANSPORT_OPTIONS", ["x"], "must be a dict with string keys"),
        ("BROKER_URL", 42, "must be a non-empty string or None"),
    ],
)
def test_each_knob_is_type_checked(name, value, expectation):
    errors = run_with({**BROKER, name: value})
    assert [(e.id, e.msg) for e in errors] == [
        ("django_outbox.E003", f'OUTBOX["{name}"] {expectation}; got {value!r}.')
    ]
    with override_settings(OUTBOX={**BROKER, name: value}):
        with pytest.raises(OutboxConfigurationError, match=expectation):
            getattr(outbox_settings, name)


@pytest.mark.parametrize(
    ("routes", "reason"),
    [
        (["orders"], "must be a dict of destination -> route dict; got list"),
        ({"bad name": {}}, "route name 'bad name' is not a valid destination"),
        ({"orders": "q"}, "route 'orders' must be a dict; got str"),
        ({"orders": {"colour": "x"}}, "route 'orders' has unknown keys ['colour']."),
        (
            {"orders": {"celery_task": "t", "queue": "q"}},
            "route 'orders' mixes celery_task with ['queue']",
        ),
        ({"orders": {"exchange_type": "weird"}}, "route 'orders' exchange_type must be one of"),
        (
            {"orders": {"routing_key": 5}},
            "route 'orders' key 'routing_key' must be a string; got int",
        ),
        ({"orders": {"celery_task": ""}}, "route 'orders' has an empty celery_task"),
    ],
)
def test_malformed_routes(routes, reason):
    (error,) = run_with({**BROKER, "ROUTES": routes})
    assert error.id == "django_outbox.E004"
    assert error.msg.startswith(f'OUTBOX["ROUTES"] is invalid: {reason}')
    assert (
        error.hint
        == "See the ROUTES entry of the settings reference in docs/reference/settings.md."
    )


def test_routes_are_parsed_with_defaults():
    routes = {
        "orders": {"exchange": "shop", "routing_key": "order.#", "queue": "orders"},
        "mail": {"celery_task": "mail.tasks.send"},
        "audit": {},
    }
    with override_settings(OUTBOX={**BROKER, "ROUTES": routes, "DEFAULT_EXCHANGE": "events"}):
        assert outbox_settings.route_for("orders") == Route(
            "orders", "shop", "topic", "order.#", "orders"
        )
        assert outbox_settings.route_for("mail") == Route("mail", celery_task="mail.tasks.send")
        assert outbox_settings.route_for("audit") == Route(
            "audit", "events", "topic", "audit", None
        )
        assert outbox_settings.route_for("other") == Route(
            "other", "events", "topic", "other", "other"
        )


def test_max_delay_below_base_delay():
    assert run_with({**BROKER, "RETRY_BASE_DELAY": 10, "RETRY_MAX_DELAY": 5}) == [
        checks.Error(
            'OUTBOX["RETRY_MAX_DELAY"] (5s) is below RETRY_BASE_DELAY (10s).',
            hint="Raise RETRY_MAX_DELAY or lower RETRY_BASE_DELAY.",
            id="django_outbox.E005",
        )
    ]


def test_no_broker_at_all_is_a_deployment_check():
    # manage.py test, makemigrations, a web worker: they stage, they never publish.
    assert run_with({}) == []
    with override_settings(OUTBOX={}):
        assert check_broker_configured() == [
            checks.Error(
                "No broker URL: the outbox relay has nowhere to publish.",
                hint='Set OUTBOX["BROKER_URL"] (a kombu URL such as '
                "amqp://guest:guest@localhost//) or CELERY_BROKER_URL.",
                id="django_outbox.E006",
            )
        ]


def test_celery_broker_url_is_the_fallback():
    assert run_with({}, CELERY_BROKER_URL="redis://127.0.0.1:56379/0") == []
    with override_settings(OUTBOX={}, CELERY_BROKER_URL="redis://127.0.0.1:56379/0"):
        assert outbox_settings.broker_url == "redis://127.0.0.1:56379/0"


def test_unknown_transport_is_named_without_credentials():
    (error,) = run_with({"BROKER_URL": "amqqp://user:s3cret@host//"})
    assert error == checks.Error(
        "The broker URL names an unknown kombu transport 'amqqp'.",
        hint="Use a kombu URL such as amqp://, redis://, memory:// or filesystem://.",
        id="django_outbox.E007",
    )
    assert "s3cret" not in error.msg + error.hint


def test_skip_locked_warning_names_the_database(tmp_path, monkeypatch):
    # PostgreSQL can share the outbox between relays: no warning.
    assert check_databases(databases=["default", "other"]) == []
    # Nor can an in-memory SQLite database ("lite" in tests.settings, what Django's test
    # runner makes of SQLite): no other process can open it, so no second relay.
    assert check_databases(databases=["lite"]) == []
    # An SQLite file can be opened by two relays and cannot be shared between them
    # (feature flags need no connection: none is opened).
    monkeypatch.setitem(connections["lite"].settings_dict, "NAME", str(tmp_path / "db.sqlite3"))
    assert check_databases(databases=["lite"]) == [
        checks.Warning(
            "Database 'lite' (sqlite) cannot SELECT ... FOR UPDATE SKIP LOCKED, so relays cannot "
            "share its outbox.",
            hint="Run exactly one run_outbox_relay for this database, or use PostgreSQL.",
            id="django_outbox.W001",
        )
    ]


# -- the folders of a filesystem:// broker ------------------------------------------------

OPTIONS = 'OUTBOX["BROKER_TRANSPORT_OPTIONS"]'


def filesystem_check(options, url="filesystem://", **more):
    with override_settings(OUTBOX={"BROKER_URL": url, "BROKER_TRANSPORT_OPTIONS": options}, **more):
        return check_brokers()


def test_filesystem_folders_that_exist_and_are_one_pass(tmp_path):
    assert filesystem_check({"data_folder_in": tmp_path, "data_folder_out": str(tmp_path)}) == []


def test_a_filesystem_folder_that_does_not_exist_is_named_with_its_option(tmp_path):
    missing = tmp_path / "broker"
    assert filesystem_check({"data_folder_in": str(missing), "data_folder_out": str(missing)}) == [
        checks.Error(
            f"The filesystem:// broker's folder {str(missing)!r} ({OPTIONS}[{option!r}]) "
            "does not exist.",
            hint=f"Create it (mkdir -p {missing}) where the relay and the consumers run, or "
            f"set {OPTIONS}[{option!r}] to a folder that exists.",
            id="django_outbox.E012",
        )
        for option in ("data_folder_in", "data_folder_out")
    ]


def test_a_filesystem_folder_option_left_out_names_kombus_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert filesystem_check({"data_folder_in": str(tmp_path)}) == [
        checks.Error(
            f"{OPTIONS} has no 'data_folder_out' for the filesystem:// broker: kombu would use "
            f"the folder {str(tmp_path / 'data_out')!r} (its default 'data_out', relative to "
            "the working directory).",
            hint=f'Set "data_folder_in" and "data_folder_out" in {OPTIONS} to one folder that '
            'exists, such as str(BASE_DIR / "broker").',
            id="django_outbox.E012",
        )
    ]


def test_a_filesystem_folder_option_that_is_no_path_is_an_error(tmp_path):
    assert filesystem_check({"data_folder_in": str(tmp_path), "data_folder_out": 42}) == [
        checks.Error(
            f"{OPTIONS}['data_folder_out'] must be a folder path; got 42.",
            hint=f'Set "data_folder_in" and "data_folder_out" in {OPTIONS} to one folder that '
            "exists.",
            id="django_outbox.E012",
        )
    ]


def test_two_different_filesystem_folders_are_a_warning_naming_both(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    options = {"data_folder_in": str(tmp_path / "in"), "data_folder_out": str(tmp_path / "out")}
    assert filesystem_check(options) == [
        checks.Warning(
            f'{OPTIONS} has "data_folder_in" {str(tmp_path / "in")!r} and "data_folder_out" '
            f"{str(tmp_path / 'out')!r}: the relay writes into the second and consumers read "
            "from the first, so no event is ever consumed.",
            hint="Set both to the same folder: the relay and the consumers read the same "
            "options, so the relay writes where they read only when the two are one.",
            id="django_outbox.W005",
        )
    ]


def test_the_filesystem_check_reads_the_celery_broker_url_and_ignores_other_brokers(tmp_path):
    missing = {"data_folder_in": str(tmp_path / "x"), "data_folder_out": str(tmp_path / "x")}
    with override_settings(
        OUTBOX={"BROKER_TRANSPORT_OPTIONS": missing}, CELERY_BROKER_URL="filesystem://"
    ):
        assert [m.id for m in check_brokers()] == ["django_outbox.E012"] * 2
    assert filesystem_check(missing, url="memory://") == []
    assert filesystem_check({}, url="redis://localhost:6379/0") == []


def test_manage_py_check_refuses_a_missing_filesystem_folder(tmp_path):
    missing = {"data_folder_in": str(tmp_path / "x"), "data_folder_out": str(tmp_path / "x")}
    with override_settings(
        OUTBOX={"BROKER_URL": "filesystem://", "BROKER_TRANSPORT_OPTIONS": missing}
    ):
        with pytest.raises(SystemCheckError, match=r"django_outbox\.E012"):
            call_command("check", databases=[])  # Django 6.1 checks every alias's JSON support


@pytest.mark.parametrize("value", [0, 0.0, dt.timedelta(0)])
def test_no_published_retention_is_a_valid_setting(value):
    assert run_with({**BROKER, "PUBLISHED_RETENTION": value}) == []
    with override_settings(OUTBOX={**BROKER, "PUBLISHED_RETENTION": value}):
        assert outbox_settings.PUBLISHED_RETENTION == dt.timedelta(0)
