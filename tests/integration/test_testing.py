"""django_outbox.testing and the ``outbox`` fixture: under Django's TestCase, under
pytest-django with and without ``transaction=True``, on PostgreSQL and SQLite; and a
user's own project whose tests use only the documented names, with no broker."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import time

import pytest
from django.db import connections, transaction
from django.test import TestCase, TransactionTestCase, override_settings
from django.utils import timezone

from django_outbox import (
    NotInTransaction,
    ReceivedEvent,
    event_published,
    publish_on_success,
    stage,
    stage_many,
)
from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.models import OutboxMessage, OutboxStatus
from django_outbox.testing import captured_events, drain
from tests.hostile.testing import outbox_fixture_without_django
from tests.support import REPO

BOTH = pytest.mark.parametrize("using", ["default", "lite"])


def _stage(event_type: str, using: str, **kwargs) -> None:
    with transaction.atomic(using=using):
        stage(event_type, {"kind": event_type}, destination="orders", using=using, **kwargs)


def _rolled_back(event_type: str, using: str) -> None:
    with pytest.raises(ZeroDivisionError), transaction.atomic(using=using):
        stage(event_type, {}, destination="orders", using=using)
        1 / 0  # noqa: B018


class _Helpers:
    """The same checks under TestCase on each database (``using``)."""

    using = "default"

    def test_captured_events_holds_the_committed_ones_only(self):
        with captured_events() as events:
            _stage("order.placed", self.using, key="o-1", headers={"tenant": "acme"})
            _rolled_back("order.lost", self.using)
            with transaction.atomic(using=self.using):
                _stage("order.paid", self.using)
                _rolled_back("order.lost", self.using)
        assert [e.event_type for e in events] == ["order.placed", "order.paid"]
        placed = events[0]
        assert isinstance(placed, ReceivedEvent)
        assert placed.payload == {"kind": "order.placed"}
        assert placed.destination == "orders"
        assert placed.ordering_key == "o-1"
        assert placed.headers["tenant"] == "acme"
        row = OutboxMessage.objects.using(self.using).get(event_type="order.placed")
        assert placed.event_id == row.event_id
        assert placed.occurred_at == row.created_at

    def test_an_event_whose_transaction_is_still_open_is_not_captured(self):
        with transaction.atomic(using=self.using):
            with captured_events() as events:
                stage("order.placed", {}, destination="orders", using=self.using)
            assert events == []

    def test_events_staged_before_the_block_are_not_captured(self):
        _stage("order.before", self.using)
        with captured_events() as events:
            _stage("order.inside", self.using)
        assert [e.event_type for e in events] == ["order.inside"]

    def test_an_event_is_captured_once_when_the_test_runs_the_on_commit_callbacks(self):
        with (
            captured_events() as events,
            self.captureOnCommitCallbacks(using=self.using, execute=True),
        ):
            _stage("order.placed", self.using)
        assert [e.event_type for e in events] == ["order.placed"]

    def test_drain_publishes_every_due_row_in_order(self):
        published = []

        def on_published(messages, **kwargs):
            published.extend(m.event_type for m in messages)

        event_published.connect(on_published)
        self.addCleanup(event_published.disconnect, on_published)
        for n in range(3):
            _stage(f"order.{n}", self.using, key=f"k{n}")
        later = timezone.now() + dt.timedelta(hours=1)
        _stage("order.later", self.using, available_at=later)

        events = drain(using=self.using)

        assert [e.event_type for e in events] == ["order.0", "order.1", "order.2"]
        assert events[2].payload == {"kind": "order.2"}
        assert events[2].ordering_key == "k2"
        assert published == ["order.0", "order.1", "order.2"]
        rows = OutboxMessage.objects.using(self.using)
        assert rows.filter(status=OutboxStatus.PUBLISHED).count() == 3
        assert rows.get(event_type="order.later").status == OutboxStatus.PENDING
        assert drain(using=self.using) == []

    def test_drain_reclaims_a_lease_that_ran_out_by_the_wall_clock(self):
        """A relay's lease that ran out after the test's transaction began (by the wall
        clock, not by the transaction's): drain() claims the row again, as a relay would."""
        _stage("order.leased", self.using)
        time.sleep(0.05)  # the lease below ends after the transaction's clock
        rows = OutboxMessage.objects.using(self.using)
        rows.update(
            status=OutboxStatus.PROCESSING,
            locked_until=timezone.now() - dt.timedelta(milliseconds=10),
            locked_by="gone:1",
        )

        assert [e.event_type for e in drain(using=self.using)] == ["order.leased"]
        assert rows.get().status == OutboxStatus.PUBLISHED


class HelpersOnPostgreSQL(_Helpers, TestCase):
    databases = {"default"}


class HelpersOnSQLite(_Helpers, TestCase):
    databases = {"lite"}
    using = "lite"


@BOTH
@pytest.mark.django_db(databases=["default", "lite"])
def test_the_fixture_under_pytest_django(outbox, using):
    _stage("order.placed", using)
    _rolled_back("order.lost", using)
    assert [e.event_type for e in outbox.captured] == ["order.placed"]
    assert [e.event_type for e in outbox.drain(using)] == ["order.placed"]
    assert OutboxMessage.objects.using(using).get().status == OutboxStatus.PUBLISHED


@BOTH
@pytest.mark.django_db(transaction=True, databases=["default", "lite"])
def test_the_helpers_in_a_test_that_commits(outbox, using):
    with captured_events() as events:
        _stage("order.placed", using)
        assert [e.event_type for e in events] == ["order.placed"]  # filled as it commits
        _rolled_back("order.lost", using)
    assert [e.event_type for e in events] == ["order.placed"]
    assert [e.event_type for e in outbox.captured] == ["order.placed"]

    assert [e.destination for e in drain(using)] == ["orders"]
    assert not connections[using].in_atomic_block
    assert OutboxMessage.objects.using(using).get().status == OutboxStatus.PUBLISHED


@pytest.mark.django_db
def test_drain_needs_no_broker_and_takes_celery_routes_too(outbox):
    routes = {"emails": {"celery_task": "shop.tasks.send_receipt"}}
    with override_settings(OUTBOX={"ROUTES": routes}, CELERY_BROKER_URL=None):
        _stage("order.placed", "default")
        with transaction.atomic():
            stage("receipt.due", {"order": 1}, destination="emails")
        published = outbox.drain()
    assert [(e.destination, e.payload) for e in published] == [
        ("emails", {"order": 1}),
        ("orders", {"kind": "order.placed"}),
    ]


@pytest.mark.django_db
def test_drain_routes_a_non_default_alias_through_memory_without_its_broker(outbox):
    brokers = {"default": {"URL": "amqp://u:pw@nohost.invalid//"}, "events": {"URL": "sqs://"}}
    routes = {"clicks": {"queue": "clicks", "broker": "events"}}
    with override_settings(OUTBOX={"BROKERS": brokers, "ROUTES": routes}):
        with transaction.atomic():
            stage("page.viewed", {"page": 1}, destination="clicks")
        published = outbox.drain()
    assert [(e.destination, e.payload) for e in published] == [("clicks", {"page": 1})]


@pytest.mark.django_db
def test_drain_refuses_a_route_naming_a_broker_alias_that_is_not_configured(outbox):
    # The relay would stop on it (E015); a drain that published it would pass the test.
    routes = {"clicks": {"queue": "clicks", "broker": "evnets"}}
    brokers = {"default": {"URL": "amqp://u:s3cret-pw@nohost.invalid//"}}
    with override_settings(OUTBOX={"BROKERS": brokers, "ROUTES": routes}):
        with transaction.atomic():
            stage("page.viewed", {"page": 1}, destination="clicks")
        with pytest.raises(OutboxConfigurationError) as raised:
            outbox.drain()
    assert str(raised.value).startswith(
        "django_outbox.E015: Route 'clicks' names broker 'evnets': No broker 'evnets' in "
        "OUTBOX[\"BROKERS\"]; the only broker configured is 'default'."
    )
    assert "s3cret-pw" not in str(raised.value)
    assert OutboxMessage.objects.get().status == OutboxStatus.PENDING


def _stage_three(using: str = "default") -> None:
    events = [
        {"event_type": f"e.{n}", "payload": {"n": n}, "destination": "orders"} for n in range(3)
    ]
    with transaction.atomic(using=using):
        stage_many(events, using=using)


@publish_on_success("order.placed", destination="orders", payload=lambda result, n: {"n": n})
def _place(n: int) -> int:
    return n


def _staged_and_rolled_back() -> None:
    """stage_many, @publish_on_success, and one event rolled back in a nested block."""
    _stage_three()
    _place(7)
    with transaction.atomic():
        _place(8)
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            _place(9)
            1 / 0  # noqa: B018


STAGED = ["e.0", "e.1", "e.2", "order.placed", "order.placed"]


class EdgesUnderTestCase(TestCase):
    databases = {"default", "other"}

    def test_stage_many_publish_on_success_and_a_nested_rollback(self):
        with captured_events() as events:
            _staged_and_rolled_back()
        assert [e.event_type for e in events] == STAGED
        assert [e.payload for e in events[3:]] == [{"n": 7}, {"n": 8}]
        assert [e.event_type for e in drain()] == STAGED
        assert drain() == []

    def test_a_second_database(self):
        with captured_events() as events:
            _stage_three("other")
        assert [e.event_type for e in events] == ["e.0", "e.1", "e.2"]
        assert drain() == []
        assert [e.payload for e in drain("other")] == [{"n": 0}, {"n": 1}, {"n": 2}]

    def test_a_row_with_no_route_is_abandoned_not_returned(self):
        _stage_three()
        with override_settings(OUTBOX={"DEFAULT_ROUTE": False}):
            assert drain() == []
            assert drain() == []
        statuses = OutboxMessage.objects.values_list("status", "attempts")
        assert list(statuses) == [(OutboxStatus.ABANDONED, 1)] * 3


class EdgesUnderTransactionTestCase(TransactionTestCase):
    databases = {"default"}

    def test_the_helpers_where_transactions_commit(self):
        with captured_events() as events:
            _staged_and_rolled_back()
        assert [e.event_type for e in events] == STAGED
        assert len(drain()) == 5
        assert drain() == []
        with transaction.atomic():  # drain() inside a block of the test's own
            _place(4)
            assert [e.payload for e in drain()] == [{"n": 4}]


# -- stage() outside the user's own transaction fails in tests as in production ----------

NOT_IN_TRANSACTION = (
    r"^stage\(\) must run inside transaction.atomic\(using='default'\) together with the "
    r"business write it belongs to; .* \(a TestCase's own transaction does not count\)$"
)


class StagingOutsideATransactionUnderTestCase(TestCase):
    """TestCase wraps each test in atomic blocks of its own; production has none, so a
    stage() that only they enclose must fail here too, and stage nothing."""

    def test_stage_outside_atomic_raises_as_in_production(self):
        with captured_events() as events:
            with self.assertRaisesRegex(NotInTransaction, NOT_IN_TRANSACTION):
                stage("order.placed", {}, destination="orders")
            with self.assertRaisesRegex(NotInTransaction, NOT_IN_TRANSACTION):
                stage_many([{"event_type": "e", "payload": {}, "destination": "orders"}])
        self.assertEqual(events, [])
        self.assertFalse(OutboxMessage.objects.exists())

    def test_stage_inside_the_users_own_atomic_block_passes(self):
        with captured_events() as events:
            with transaction.atomic():
                stage("order.placed", {}, destination="orders")
        self.assertEqual([e.event_type for e in events], ["order.placed"])


@pytest.mark.django_db
def test_stage_outside_atomic_raises_under_pytest_django_too(outbox):
    with pytest.raises(NotInTransaction, match=NOT_IN_TRANSACTION):
        stage("order.placed", {}, destination="orders")
    _place(1)  # @publish_on_success opens its own block
    assert [e.payload for e in outbox.captured] == [{"n": 1}]


@pytest.mark.slow  # a pytest run in a subprocess
def test_the_fixture_without_django_set_up_says_what_it_needs(request):
    # One line (no traceback, no ImproperlyConfigured): the trigger keeps only that line.
    assert outbox_fixture_without_django(request) == (
        "the outbox fixture needs Django set up: run the tests with pytest-django and "
        "its DJANGO_SETTINGS_MODULE (docs/testing.md, With pytest)"
    )


def test_the_plugin_imports_before_django_is_set_up():
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    code = (
        "import django_outbox.pytest_plugin, sys;"
        "from django.conf import settings;"
        "assert not settings.configured;"
        "assert 'django_outbox.models' not in sys.modules"
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- a user's project ------------------------------------------------------------------

SITE_SETTINGS = """\
import environ

env = environ.Env()
SECRET_KEY = "user-site"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django_outbox", "shop"]
DATABASES = {"default": env.db("DATABASE_URL", default="sqlite:///db.sqlite3")}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
"""


def _docs_files() -> dict[str, str]:
    """The files of the user's project that docs/testing.md shows: each ```python (or
    ```ini) block whose first line is a comment naming its path."""
    page = (REPO / "docs" / "testing.md").read_text()
    blocks = re.findall(r"```(?:python|ini)\n# (\S+\.(?:py|ini))\n(.*?)```", page, re.DOTALL)
    return dict(blocks)


def _user_site(root) -> None:
    files = _docs_files()
    assert sorted(files) == ["pytest.ini", "shop/models.py", "shop/test_orders.py", "shop/tests.py"]
    for package in ("shop", "mysite"):
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    for path, text in files.items():
        (root / path).write_text(text)
    # The page's pytest.ini names mysite.settings; pytest-django puts manage.py's folder
    # on sys.path, as in the quickstart's project.
    (root / "mysite" / "settings.py").write_text(SITE_SETTINGS)
    (root / "manage.py").write_text("")


def _no_services_env(**extra: str) -> dict[str, str]:
    """The environment without any broker or server URL of this suite."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.endswith("_URL") and k not in {"DJANGO_SETTINGS_MODULE", "OUTBOX_OVERRIDES"}
    }
    return {**env, **extra}


@pytest.mark.slow
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_users_test_needs_no_broker(tmp_path, database):
    """The acceptance test of issue 13: a fresh project's tests, written only against
    django_outbox.testing (those docs/testing.md shows), pass with nothing but the database."""
    _user_site(tmp_path)
    extra = {}
    if database == "postgresql":
        params = connections["default"].settings_dict
        name = f"site_{tmp_path.name[-12:].replace('-', '_').lower()}"
        extra["DATABASE_URL"] = (
            f"postgres://{params['USER']}@{params['HOST']}:{params['PORT']}/{name}"
        )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "shop"],
        cwd=tmp_path,
        env=_no_services_env(**extra),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed" in result.stdout
