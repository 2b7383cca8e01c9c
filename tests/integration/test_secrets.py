"""No check, log line, exception, last_error, command output or admin page shows a
broker or database password; a missing transport package is named with what to install.

Every test uses a password holding the characters URL parsers split on (``#?/@``)
and a marker string that must appear nowhere in what a user sees.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import threading
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import override_settings
from django.urls import reverse

from django_outbox.conf import outbox_settings
from django_outbox.consumer import InboxConsumer
from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.models import InboxFailure, OutboxMessage
from django_outbox.relay import Relay
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    delete_queue,
    manage_command,
    relay_env,
    stage_events,
    unique_destination,
    wait_until,
)

MARKER = f"zebra{uuid.uuid4().hex[:8]}"
#: The marker first, so that a parser that stops at "#" quotes it.
PASSWORD = f"{MARKER}#?/@{MARKER}"
AMQP_PORT = AMQP_URL.rsplit(":", 1)[1].split("/")[0]
#: Written as people do: the password pasted in, not percent-encoded.
MALFORMED = f"amqp://guest:{PASSWORD}@127.0.0.1:{AMQP_PORT}//"
#: The same password, percent-encoded: a URL kombu reads, at the real RabbitMQ
#: (which refuses the password).
WRONG_PASSWORD = f"amqp://guest:{quote(PASSWORD, safe='')}@127.0.0.1:{AMQP_PORT}//"
REDIS = REDIS_URL.split("://", 1)[1]


def outbox_errors(**settings: object) -> list[checks.CheckMessage]:
    with override_settings(**settings):
        # No database: Django 6.1 would ask each alias whether it supports JSONField.
        found = checks.run_checks(databases=[])
        return [m for m in found if m.id and m.id.startswith("django_outbox")]


def assert_hidden(*texts: str) -> None:
    for text in texts:
        assert MARKER not in text


# -- exceptions, logs, last_error, outbox_status, the admin --------------------------


def everything_shown(client) -> str:
    """What outbox_status and the admin's outbox pages show, and every last_error."""
    status = io.StringIO()
    call_command("outbox_status", stdout=status)
    pages = [client.get(reverse("admin:django_outbox_outboxmessage_changelist"))]
    pages += [
        client.get(reverse("admin:django_outbox_outboxmessage_change", args=[pk]))
        for pk in OutboxMessage.objects.values_list("pk", flat=True)
    ]
    assert all(page.status_code == 200 for page in pages)
    errors = list(OutboxMessage.objects.values_list("last_error", flat=True))
    return "\n".join([status.getvalue(), *errors, *(p.content.decode() for p in pages)])


@pytest.mark.django_db(transaction=True)
def test_a_relay_refuses_a_malformed_broker_url_and_shows_no_password(admin_client, caplog):
    """Before, kombu's URL parser failed on the first batch and its error, the start
    of the password, was logged with a traceback and stored in last_error."""
    stage_events(2, "orders")
    with override_settings(OUTBOX={"BROKER_URL": MALFORMED}):
        with pytest.raises(OutboxConfigurationError) as raised:
            with Relay() as relay:
                relay.run_once()
    assert str(raised.value).startswith(
        f"django_outbox.E010: The broker URL amqp://guest:***@127.0.0.1:{AMQP_PORT}// is malformed:"
    )
    assert_hidden(str(raised.value), caplog.text, everything_shown(admin_client))
    assert set(OutboxMessage.objects.values_list("status", "attempts")) == {("pending", 0)}


@pytest.mark.django_db(transaction=True)
def test_the_commands_refuse_a_malformed_broker_url_masked(caplog):
    out = io.StringIO()
    with override_settings(OUTBOX={"BROKER_URL": MALFORMED}):
        with pytest.raises(CommandError) as relay_error:
            call_command("run_outbox_relay", "--once", stdout=out, stderr=out)
        with pytest.raises(CommandError) as consumer_error:
            call_command(
                "run_outbox_consumer",
                "--queue=orders",
                "--handler=tests.testapp.handlers.record",
                "--consumer=c",
                stdout=out,
                stderr=out,
            )
    for error in (relay_error, consumer_error):
        assert str(error.value).startswith("django_outbox.E010: The broker URL amqp://guest:***@")
    assert_hidden(str(relay_error.value), str(consumer_error.value), out.getvalue(), caplog.text)


def test_a_consumer_given_a_malformed_url_says_so_masked():
    with pytest.raises(OutboxConfigurationError) as raised:
        InboxConsumer("orders", print, "c", url=MALFORMED)
    assert str(raised.value).startswith("django_outbox.E010:")
    assert_hidden(str(raised.value))


def run_until_the_broker_is_down(caplog, worker: Relay | InboxConsumer) -> None:
    """Run a relay or consumer (in a thread) until it logged a broker outage, then stop it."""
    stop = worker.stop if isinstance(worker, InboxConsumer) else threading.Event()

    def run() -> None:
        try:
            worker.run() if isinstance(worker, InboxConsumer) else worker.run(stop)
        finally:
            connections.close_all()  # this thread's

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_until(
            lambda: any(getattr(r, "action", "") == "outbox.broker_down" for r in caplog.records),
            timeout=60,
            what="the broker_down log line",
        )
    finally:
        stop.set()
        thread.join(60)


@pytest.mark.django_db(transaction=True)
def test_a_wrong_password_at_the_real_rabbitmq_shows_nowhere(admin_client, caplog):
    """The real py-amqp error text goes to the log and to last_error, without the password."""
    caplog.set_level(logging.INFO, logger="django_outbox")
    stage_events(1, "orders")
    with override_settings(OUTBOX={"BROKER_URL": WRONG_PASSWORD}):
        run_until_the_broker_is_down(caplog, Relay())
    (row,) = OutboxMessage.objects.all()
    assert "ACCESS_REFUSED" in row.last_error  # the broker's refusal, as py-amqp words it
    assert "ACCESS_REFUSED" in caplog.text
    assert_hidden(caplog.text, everything_shown(admin_client))


@pytest.mark.django_db(transaction=True)
def test_a_consumer_refused_by_the_real_rabbitmq_logs_no_password(caplog):
    caplog.set_level(logging.INFO, logger="django_outbox")
    with override_settings(OUTBOX={"BROKER_URL": WRONG_PASSWORD}):
        run_until_the_broker_is_down(caplog, InboxConsumer("orders", print, "c"))
    assert "ACCESS_REFUSED" in caplog.text
    assert_hidden(caplog.text)


@pytest.mark.django_db(transaction=True)
def test_a_wrong_password_at_the_real_redis_shows_nowhere(admin_client, caplog):
    """Our Redis has no such user: redis-py's AUTH fails with the server's own text."""
    stage_events(1, "orders")
    url = f"redis://nobody:{quote(PASSWORD, safe='')}@{REDIS}"
    with override_settings(OUTBOX={"BROKER_URL": url}):
        with Relay() as relay:
            assert relay.run_once().failed == 1
    (row,) = OutboxMessage.objects.all()
    assert "invalid username-password pair" in row.last_error
    assert_hidden(caplog.text, everything_shown(admin_client))


@pytest.mark.django_db(transaction=True)
def test_a_handler_error_holding_a_password_is_stored_and_shown_masked(admin_client, caplog):
    """A handler's exception text (say, its own database driver's) is what the consumer
    logs, keeps in InboxFailure.last_error and the admin shows."""
    destination = unique_destination("secret")

    def handler(event: object) -> None:
        raise ConnectionError(f"cannot reach {MALFORMED}: bad port '{MARKER}'")

    try:
        stage_events(1, destination)
        with Relay() as relay:
            assert relay.run_once().published == 1
        consumer = InboxConsumer(destination, handler, "c", max_deliveries=1)
        assert consumer.run(idle_timeout=2).parked == 1
    finally:
        delete_queue(destination)
    (failure,) = InboxFailure.objects.all()
    assert failure.last_error.startswith("ConnectionError: cannot reach amqp://")
    pages = [
        admin_client.get(reverse("admin:django_outbox_inboxfailure_changelist")),
        admin_client.get(reverse("admin:django_outbox_inboxfailure_change", args=[failure.pk])),
    ]
    assert all(page.status_code == 200 for page in pages)
    assert_hidden(failure.last_error, caplog.text, *(page.content.decode() for page in pages))


def test_a_driver_error_holding_a_url_is_logged_masked(caplog):
    """Whatever a driver puts in its error text (a URL, a quoted piece of the password)
    is masked in the relay's, the consumer's and the outage log lines, traceback included."""
    for name in ("django_outbox.relay", "django_outbox.consumer", "django_outbox.outage"):
        try:
            raise ConnectionError(f"cannot reach {MALFORMED}: bad port '{MARKER}'")
        except ConnectionError as exc:
            logging.getLogger(name).warning("failed (%s)", exc, exc_info=True)
    # In the message and in the traceback ("guest" is masked too: it is the password of
    # the tests' own broker URL).
    assert caplog.text.count(f"cannot reach amqp://***:***@127.0.0.1:{AMQP_PORT}//") == 6
    assert_hidden(caplog.text)


# -- missing optional packages ------------------------------------------------------


@pytest.fixture
def without_redis(tmp_path: Path) -> dict[str, str]:
    """The environment of a manage.py subprocess in which ``import redis`` fails.

    The test venv has redis installed (the Redis tests need it), so a missing package
    is simulated: a sitecustomize.py on PYTHONPATH, run at interpreter start-up,
    makes every ``import redis`` raise ImportError, as it would without the package.
    """
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["redis"] = None\n')
    env = relay_env(BROKER_URL=REDIS_URL)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        manage_command(*args), env=env, capture_output=True, text=True, timeout=120, check=False
    )


INSTALL_REDIS = 'pip install "django-transactional-outbox[redis]"'


def test_check_names_the_extra_to_install_for_redis(without_redis):
    result = run(without_redis, "check")
    assert result.returncode == 1
    assert (
        "(django_outbox.E011) The broker URL redis://127.0.0.1:" in result.stderr
        and f"needs the Python package 'redis', which is not installed: {INSTALL_REDIS}"
        in result.stderr
    )
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # two processes in a venv without redis-py
def test_the_relay_and_consumer_name_the_extra_to_install_for_redis(without_redis):
    # With the system checks, the relay stops on E011; without them, its start-up says it.
    checked = run(without_redis, "run_outbox_relay", "--once")
    skipped = run(without_redis, "run_outbox_relay", "--once", "--skip-checks")
    consumer = run(
        without_redis,
        "run_outbox_consumer",
        "--skip-checks",
        "--queue=orders",
        "--handler=tests.testapp.handlers.record",
        "--consumer=c",
    )
    for result in (checked, skipped, consumer):
        assert result.returncode == 1
        assert "django_outbox.E011" in result.stderr and INSTALL_REDIS in result.stderr
        assert "Traceback" not in result.stderr
    assert skipped.stderr.startswith("CommandError: django_outbox.E011: The broker URL redis://")


def test_a_transport_whose_package_is_missing_names_kombus_extra():
    """boto3 is not installed in the test venv: this is the real missing package."""
    with pytest.raises(ImportError):
        __import__("boto3")
    (error,) = outbox_errors(OUTBOX={"BROKER_URL": f"sqs://AKIA:{quote(PASSWORD, safe='')}@"})
    assert (error.id, error.msg) == (
        "django_outbox.E011",
        "The broker URL sqs://AKIA:***@ needs the Python package 'boto3', which is not "
        'installed: pip install "kombu[sqs]"',
    )


def test_a_transport_kombu_cannot_load_gets_kombus_own_error():
    """pgmq is not installed in the test venv, and this app knows no package for it."""
    (error,) = outbox_errors(OUTBOX={"BROKER_URL": f"pgmq://u:{quote(PASSWORD, safe='')}@db/x"})
    assert (error.id, error.msg) == (
        "django_outbox.E011",
        "The broker URL pgmq://u:***@db/x names kombu transport 'pgmq', which cannot be loaded: "
        "ImportError: PGMQ transport requires the pgmq library: pip install kombu[pgmq]",
    )


@pytest.mark.parametrize(
    "settings",
    [
        {"OUTBOX": {"BROKER_URL": AMQP_URL, "BROKER_TRANSPORT_OPTIONS": {"password": MARKER}}},
        {
            "OUTBOX": {
                "BROKER_URL": AMQP_URL,
                "BROKER_TRANSPORT_OPTIONS": {"sentinel_kwargs": {"password": MARKER}},
            }
        },
        {
            "OUTBOX": {"BROKER_URL": AMQP_URL},
            "CELERY_BROKER_TRANSPORT_OPTIONS": {
                "predefined_queues": {"q": {"url": f"sqs://key:{quote(MARKER, safe='')}@host/q"}}
            },
        },
    ],
    ids=["password", "sentinel-kwargs", "celery-url-in-options"],
)
def test_a_password_in_the_transport_options_is_scrubbed_from_what_the_relay_logs(settings, caplog):
    """Transport options may hold a password (Redis Sentinel's ``sentinel_kwargs``, SQS
    keys); a driver's error that quotes one is logged masked, as a URL's password is."""
    with override_settings(**settings):
        try:
            raise ConnectionError(f"AUTH failed with '{MARKER}'")
        except ConnectionError:
            logging.getLogger("django_outbox.relay").exception("cannot connect")
        assert outbox_settings.redact(f"x {MARKER} y") == "x *** y"
    assert "cannot connect" in caplog.text
    assert_hidden(caplog.text)
