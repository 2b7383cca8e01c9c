"""The Django tasks backend without services: priorities, routes, checks, and every refusal
that comes before any SQL. The end-to-end tests (a real worker) are in
tests/integration/test_tasks.py."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from django.core import checks
from django.test.utils import override_settings

from django_outbox.conf import outbox_settings
from django_outbox.conf.routes import TASK_RUNNER, TASKS_PREFIX, Route, parse_routes
from django_outbox.transports.celery import broker_priority
from tests.support import REPO

HAS_TASKS = importlib.util.find_spec("django.tasks") is not None
needs_tasks = pytest.mark.skipif(not HAS_TASKS, reason="django.tasks is Django 6.0+")


@pytest.mark.parametrize(
    ("priority", "highest_first", "lowest_first"),
    [
        *((-100, 0, 9), (-81, 0, 9), (-80, 1, 8), (-1, 4, 5)),
        *((0, 5, 4), (79, 8, 1), (80, 9, 0), (100, 9, 0)),
    ],
)
def test_a_task_priority_falls_in_a_band_of_20_reversed_where_the_lowest_goes_first(
    priority, highest_first, lowest_first
):
    assert broker_priority(priority, lowest_first=False) == highest_first
    assert broker_priority(priority, lowest_first=True) == lowest_first


@pytest.mark.parametrize("value", [None, "100", 1.5, True, 101, -101])
def test_a_priority_that_is_not_a_whole_number_in_range_counts_as_the_default(value):
    assert broker_priority(value, lowest_first=False) == broker_priority(0, lowest_first=False)


def test_a_task_queue_destination_has_the_runner_route_whatever_the_settings():
    with override_settings(OUTBOX={"BROKER_URL": "amqp://", "DEFAULT_ROUTE": False}):
        outbox_settings.reload()
        route = outbox_settings.route_for(f"{TASKS_PREFIX}emails")
        assert outbox_settings.route_for("emails") is None
    outbox_settings.reload()
    assert route == Route(f"{TASKS_PREFIX}emails", celery_task=TASK_RUNNER, queue="emails")
    assert Route.for_tasks(TASKS_PREFIX) is None
    assert Route.for_tasks("emails") is None


def test_a_route_cannot_take_a_task_queue_destination():
    with pytest.raises(ValueError, match="kept for the queues of the Django tasks backend"):
        parse_routes({f"{TASKS_PREFIX}emails": {"queue": "x"}}, "outbox")


def test_celery_finds_the_runner_by_autodiscovery_on_any_django():
    """A fresh interpreter: nothing of django_outbox imported before autodiscovery."""
    code = (
        "import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'tests.settings'; "
        "django.setup(); from celery import Celery; app = Celery('t', set_as_current=False); "
        "app.autodiscover_tasks(); app.loader.import_default_modules(); "
        f"print({TASK_RUNNER!r} in app.tasks)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr


@pytest.mark.skipif(HAS_TASKS, reason="only where django.tasks does not exist")
def test_the_backend_says_it_needs_django_6_where_django_tasks_is_missing():
    import django_outbox.tasks

    with pytest.raises(ImportError, match=r"Django 6\.0 added; this is Django 5\."):
        django_outbox.tasks.OutboxTaskBackend  # noqa: B018


def backend(**params):  # type: ignore[no-untyped-def]
    from django_outbox.tasks import OutboxTaskBackend

    return OutboxTaskBackend("default", {"QUEUES": [], **params})


@needs_tasks
def test_the_test_settings_backend_has_nothing_to_report():
    from django.tasks import task_backends

    assert task_backends["default"].check() == []


@needs_tasks
@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"OPTIONS": []}, 'TASKS["default"]["OPTIONS"] must be a dict.'),
        ({"OPTIONS": {"USING": "x"}}, """TASKS["default"]["OPTIONS"] has no option 'USING'."""),
        (
            {"OPTIONS": {"REQUIRE_TRANSACTION": "yes"}},
            """TASKS["default"]["OPTIONS"]["REQUIRE_TRANSACTION"] must be True or False; """
            "got 'yes'.",
        ),
        (
            {"OPTIONS": {"DATABASE": "nope"}},
            """TASKS["default"]["OPTIONS"]["DATABASE"] is 'nope', which is not in DATABASES.""",
        ),
        (
            {"QUEUES": ["ok", "-bad", "two words", "é"]},
            """TASKS["default"]["QUEUES"] has '-bad', which cannot name a Celery queue here.""",
        ),
    ],
)
def test_a_misconfigured_backend_is_said_by_e019(params, message):
    found = backend(**params).check()
    assert message in [m.msg for m in found], found
    assert {m.id for m in found} == {"django_outbox.E019"}


@needs_tasks
def test_every_bad_queue_name_is_said():
    found = backend(QUEUES=["ok", "-bad", "two words", "x" * 243]).check()
    assert len(found) == 3


@needs_tasks
def test_a_backend_on_sqlite_is_warned_about_by_w006():
    (warning,) = backend(OPTIONS={"DATABASE": "lite"}).check()
    assert isinstance(warning, checks.Warning) and warning.id == "django_outbox.W006"
    assert "database 'lite' (sqlite)" in warning.msg


REQUIRED = {
    "default": {
        "BACKEND": "django_outbox.tasks.OutboxTaskBackend",
        "QUEUES": [],
        "OPTIONS": {"REQUIRE_TRANSACTION": True},
    }
}


@needs_tasks
def test_enqueue_outside_a_transaction_is_refused_before_any_sql_where_required():
    """(This layer has no database: any SQL would fail the test another way.)"""
    from asgiref.sync import async_to_sync

    from django_outbox import NotInTransaction
    from tests.testapp import djtasks

    refusal = (
        r"add\.enqueue\(\) on the outbox task backend must run inside "
        r"transaction\.atomic\(using='default'\), with the writes the task belongs to "
        r'\(TASKS\["default"\]\["OPTIONS"\]\["REQUIRE_TRANSACTION"\] is True\)$'
    )
    with override_settings(TASKS=REQUIRED):
        with pytest.raises(NotInTransaction, match=refusal):
            djtasks.add.enqueue(1, 2)
        with pytest.raises(NotInTransaction, match=refusal):  # async code: no transaction
            async_to_sync(djtasks.add.aenqueue)(1, 2)


@needs_tasks
def test_a_task_whose_arguments_are_not_json_is_refused_before_any_sql():
    from tests.testapp import djtasks

    with pytest.raises(TypeError, match="Unsupported type"):
        djtasks.add.enqueue(1, object())


@needs_tasks
def test_a_queue_the_backend_does_not_list_is_refused_by_django():
    from django.tasks.exceptions import InvalidTask

    from tests.testapp import djtasks

    configured = {"default": {"BACKEND": "django_outbox.tasks.OutboxTaskBackend"}}
    with override_settings(TASKS=configured), pytest.raises(InvalidTask, match="emails"):
        djtasks.add.using(queue_name="emails")


def checked_under(**app_options):  # type: ignore[no-untyped-def]
    """The backend's check() with a Celery app of ``app_options`` current; the test
    settings' app current again after."""
    from celery import Celery

    from tests.settings import CELERY_APP

    app = Celery("under-test", set_as_current=True, **app_options)
    try:
        return backend().check()
    finally:
        app.close()
        CELERY_APP.set_current()


@needs_tasks
def test_a_current_celery_app_without_a_broker_is_warned_about_by_w007():
    (warning,) = checked_under()
    assert warning.id == "django_outbox.W007"
    assert "has no broker URL" in warning.msg
    assert backend().check() == []


@needs_tasks
def test_a_current_celery_app_on_rabbitmq_without_confirms_is_warned_about_by_w004():
    (warning,) = checked_under(broker="amqp://guest@127.0.0.1:1//")
    assert warning.id == "django_outbox.W004"
    assert "without publisher confirms" in warning.msg


@needs_tasks
@pytest.mark.parametrize(
    ("argument", "refusal"),
    [
        (float("nan"), "not JSON-serialisable"),
        ("a\x00b", "NUL"),
        ("a\ud800b", "lone surrogate"),
        ("x" * 70_000, "bytes, more than"),
    ],
)
def test_arguments_the_database_cannot_store_are_refused_before_anything_else(argument, refusal):
    """Refused even before the transaction is looked at (this layer has no database)."""
    from django_outbox import StagingError
    from tests.testapp import djtasks

    with override_settings(OUTBOX={"BROKER_URL": "memory://", "MAX_PAYLOAD_BYTES": 65_536}):
        outbox_settings.reload()
        try:
            with pytest.raises(StagingError, match=refusal):
                djtasks.add.enqueue(1, argument)
        finally:
            outbox_settings.reload()


#: A project's settings where nothing imports django.tasks before ``manage.py check``,
#: and no Celery app is imported (its package forgot ``from .celery import app``).
FORGOT_CELERY_APP = """
SECRET_KEY = "x"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_outbox"]
DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "never-connected"}}
OUTBOX = {"BROKER_URL": "memory://"}
TASKS = {"default": {"BACKEND": "django_outbox.tasks.OutboxTaskBackend", "QUEUES": QUEUES}}
"""


@needs_tasks
@pytest.mark.parametrize(
    ("queues", "said", "code"),
    [
        (["default"], '?: (django_outbox.W007) TASKS["default"] is sent through', 0),
        (["two words"], '?: (django_outbox.E019) TASKS["default"]["QUEUES"] has', 1),
    ],
)
def test_manage_py_check_runs_the_backends_checks_though_nothing_imported_django_tasks(
    tmp_path, queues, said, code
):
    """Django registers its check of the TASKS backends when django.tasks is imported;
    the app registers it too. Before, this project's check said "no issues"."""
    (tmp_path / "forgot.py").write_text(f"QUEUES = {queues!r}\n{FORGOT_CELERY_APP}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    out = subprocess.run(
        [sys.executable, "-m", "django", "check", "--settings", "forgot"],
        cwd=REPO,
        env={**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
        capture_output=True,
        text=True,
    )
    assert said in out.stdout + out.stderr, out.stdout + out.stderr
    assert out.returncode == code
