"""Failures that say why (issue 19, "loud failures"): a failed publish is logged at
WARNING once per batch, destination and reason; ``run_outbox_relay --once/--drain``
print the reasons and the rows waiting for a retry, and exit 1; ``--drain`` gives up on
a broker it cannot reach; ``outbox_status`` shows the frequent errors and the parked
inbox messages; the ``LOGGING`` snippet of docs/deploying.md shows the WARNINGs.

Real PostgreSQL, real subprocesses for the commands; the broker that fails is a
loopback port nothing listens on, or a ``filesystem://`` folder that does not exist."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import subprocess
import time
import uuid

import pytest
from django.db import transaction
from django.test.utils import override_settings
from django.utils import timezone

from django_outbox import stage
from django_outbox.models import InboxFailure, OutboxMessage
from django_outbox.relay import Relay
from tests.factories import OutboxMessageFactory
from tests.support import (
    REPO,
    manage,
    manage_command,
    never_migrated_env,
    relay_env,
    running,
    stage_events,
    start_relay,
    status_counts,
    unique_destination,
    unreachable_broker_url,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

Status = OutboxMessage.Status
PASSWORD = "s3cret-Passw0rd"
REFUSED = "ConnectionRefusedError: [Errno 111] Connection refused"


def records(caplog, action: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "action", "") == action]


def missing_folder_broker(tmp_path) -> dict:
    missing = str(tmp_path / "no-such-folder")
    return {
        "BROKER_URL": "filesystem://",
        "BROKER_TRANSPORT_OPTIONS": {
            "data_folder_in": missing,
            "data_folder_out": missing,
            # Not kombu's default control/ in the working directory (the repository).
            "control_folder": str(tmp_path / "control"),
        },
    }


# -- the relay's log ----------------------------------------------------------------------


def test_a_failed_publish_logs_one_warning_per_batch_and_destination_with_the_reason(
    tmp_path, caplog
):
    orders, invoices = unique_destination(), unique_destination()
    stage_events(2000, orders)
    stage_events(1000, invoices)
    with override_settings(OUTBOX=missing_folder_broker(tmp_path)):
        with caplog.at_level(logging.WARNING, logger="django_outbox"), Relay() as relay:
            relay.batch_size = 3000
            stats = relay.run_once()
    assert (stats.claimed, stats.failed) == (3000, 3000)

    failed = records(caplog, "outbox.publish_failed")
    assert sorted((r.destination, r.count) for r in failed) == sorted(
        [(orders, 2000), (invoices, 1000)]
    )  # one line each, not 3000
    for record in failed:
        assert record.levelno == logging.WARNING
        assert "No such file or directory" in record.error and "no-such-folder" in record.error
        assert 0 < record.retry_in <= 1.0  # RETRY_BASE_DELAY's first wait, jitter shortened
        message = record.getMessage()
        assert message.startswith(f"publishing {record.count} row(s) to {record.destination!r}")
        assert record.error in message and "the next retry is due in" in message


def test_abandoned_rows_are_one_error_per_destination_and_reason_and_say_why(caplog):
    orders = unique_destination()
    with transaction.atomic():
        for n in range(6):
            stage("order.placed", {"n": n}, destination=orders)
    # Half of them on their last attempt: abandoned; the others wait for a retry.
    OutboxMessage.objects.filter(id__in=OutboxMessage.objects.order_by("id")[:3]).update(attempts=9)
    retired = OutboxMessageFactory.create_batch(4, destination="retired")
    OutboxMessage.objects.filter(id=retired[0].id).update(attempts=2)  # attempts differ
    outbox = {
        "BROKER_URL": unreachable_broker_url(PASSWORD),
        "ROUTES": {orders: {"queue": orders}},
        "DEFAULT_ROUTE": False,
    }
    with override_settings(OUTBOX=outbox):
        with caplog.at_level(logging.WARNING, logger="django_outbox"), Relay() as relay:
            stats = relay.run_once()
    assert (stats.failed, stats.abandoned) == (3, 7)

    abandoned = {r.destination: r for r in records(caplog, "outbox.abandoned")}
    assert sorted(abandoned) == sorted([orders, "retired"])
    assert abandoned[orders].count == 3 and abandoned[orders].error == REFUSED
    assert abandoned[orders].getMessage() == (
        f"abandoned 3 row(s) to {orders!r} (attempts exhausted, MAX_ATTEMPTS=10): {REFUSED}"
    )
    assert abandoned["retired"].count == 4  # one record, though their attempts differ
    assert (
        abandoned["retired"]
        .getMessage()
        .startswith(
            "abandoned 4 row(s) to 'retired' (a permanent error): destination 'retired' has no "
        )
    )
    (failed,) = records(caplog, "outbox.publish_failed")
    assert (failed.destination, failed.count, failed.error) == (orders, 3, REFUSED)
    assert PASSWORD not in caplog.text


# -- run_outbox_relay --once / --drain ----------------------------------------------------


def test_once_prints_the_reasons_and_the_rows_waiting_and_exits_1():
    orders = unique_destination()
    stage_events(4, orders)
    OutboxMessageFactory(destination="retired")
    result = manage(
        "run_outbox_relay",
        "--once",
        BROKER_URL=unreachable_broker_url(PASSWORD),
        ROUTES={orders: {"queue": orders}},
        DEFAULT_ROUTE=False,
        RETRY_BASE_DELAY=60,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == [
        "claimed 5, published 0, failed 4, abandoned 1, lease lost 0",
        f"failed 4 to {orders!r}: {REFUSED}",
        "abandoned 1 to 'retired': destination 'retired' has no route: it is not in "
        "OUTBOX['ROUTES'] and OUTBOX['DEFAULT_ROUTE'] is False",
    ]
    assert re.fullmatch(r"4 rows wait for a retry; the next is due in \d\ds", lines[3]), lines
    assert len(lines) == 4
    assert result.stderr.splitlines()[-1] == (
        "CommandError: 5 of 5 claims in this run were not published: failed 4, abandoned 1"
    )
    assert PASSWORD not in result.stdout + result.stderr


def test_drain_gives_up_on_a_broker_it_cannot_reach_instead_of_waiting_forever():
    orders = unique_destination()
    stage_events(3, orders)
    url = unreachable_broker_url(PASSWORD)
    result = manage("run_outbox_relay", "--drain", BROKER_URL=url, RETRY_BASE_DELAY=60, timeout=60)
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("claimed 3, published 0, failed 3, abandoned 0, lease lost 0 in ")
    assert lines[1] == f"failed 3 to {orders!r}: {REFUSED}"
    assert re.fullmatch(r"3 rows wait for a retry; the next is due in \d\ds", lines[2]), lines
    masked = url.replace(PASSWORD, "***")
    assert result.stderr.splitlines()[-1] == (
        f"CommandError: --drain gave up: the broker {masked} is unreachable ({REFUSED})"
    )
    assert PASSWORD not in result.stdout + result.stderr
    assert set(OutboxMessage.objects.values_list("status", "attempts")) == {("failed", 1)}


def test_drain_with_a_missing_broker_folder_ends_with_the_rows_waiting_and_exits_1(tmp_path):
    orders = unique_destination()
    stage_events(3, orders)
    # --skip-checks: the system check for filesystem folders would refuse to start.
    result = manage(
        "run_outbox_relay",
        "--drain",
        "--skip-checks",
        timeout=60,
        **missing_folder_broker(tmp_path),
    )
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(
        rf"failed 3 to {orders!r}: FileNotFoundError: \[Errno 2\] No such file or directory: "
        r"'.*no-such-folder.*'",
        lines[1],
    ), lines
    assert re.fullmatch(r"3 rows wait for a retry; the next is due in 1s", lines[2]), lines
    # The broker check looks for the folder too: the drain gives up, naming it.
    assert re.fullmatch(
        r"CommandError: --drain gave up: the broker filesystem:// is unreachable "
        r"\(FileNotFoundError: The filesystem:// broker's folder '.*no-such-folder' "
        r"\(OUTBOX\[\"BROKER_TRANSPORT_OPTIONS\"\]\['data_folder_in'\]\) does not exist\.\)",
        result.stderr.splitlines()[-1],
    ), result.stderr


def test_a_folder_gone_while_the_relay_runs_is_an_outage_that_spends_no_more_attempts(tmp_path):
    """A filesystem:// folder that is missing once the relay runs (removed, an unmounted
    volume; --skip-checks stands in for "it was there at start") used to fail every
    batch and spend an attempt of each row per retry, on to ABANDONED. The relay's
    broker check now looks for the folders: the first batch fails, then the relay waits
    the outage out, and publishes once the folder is back."""
    broker = missing_folder_broker(tmp_path)
    folder = tmp_path / "no-such-folder"
    orders = unique_destination()
    stage_events(3, orders)
    relay = start_relay("--skip-checks", RETRY_BASE_DELAY=0.1, RETRY_JITTER=0, **broker)
    with running(relay):
        wait_until(lambda: status_counts()["failed"] == 3, timeout=60, what="the first failure")
        # With a retry due every 0.1-0.8 s, the old relay spent several attempts in this time.
        time.sleep(3)
        assert set(OutboxMessage.objects.values_list("status", "attempts")) == {("failed", 1)}
        folder.mkdir()
        wait_until(lambda: status_counts()["published"] == 3, timeout=60, what="publishing")
    assert len(list(folder.iterdir())) == 3  # the three messages, as files


def test_drain_says_which_rows_wait_for_a_retry_and_exits_0_when_none_failed_in_its_run():
    OutboxMessageFactory(
        status=Status.FAILED, attempts=1, available_at=timezone.now() + dt.timedelta(minutes=5)
    )
    result = manage("run_outbox_relay", "--drain")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("claimed 0, published 0, failed 0, abandoned 0, lease lost 0")
    assert re.fullmatch(r"1 row waits for a retry; the next is due in [45]\.\d min", lines[1])


def test_many_reasons_are_cut_to_the_five_with_most_rows():
    for n in range(7):
        OutboxMessageFactory.create_batch(n + 1, destination=f"retired-{n}")
    result = manage("run_outbox_relay", "--once", DEFAULT_ROUTE=False)
    assert result.returncode == 1
    fates = [line.split(":")[0] for line in result.stdout.splitlines()[1:]]
    assert fates == [
        "abandoned 7 to 'retired-6'",
        "abandoned 6 to 'retired-5'",
        "abandoned 5 to 'retired-4'",
        "abandoned 4 to 'retired-3'",
        "abandoned 3 to 'retired-2'",
        "and 3 more rows for other reasons",  # abandoned ones: not "failed"
    ]


# -- outbox_status ------------------------------------------------------------------------


def test_status_shows_the_frequent_errors_and_the_parked_messages_per_consumer():
    now = timezone.now()
    failed = {"status": Status.FAILED, "attempts": 1}
    OutboxMessageFactory.create_batch(3, last_error="ConnectionRefusedError: refused", **failed)
    OutboxMessageFactory(last_error="TimeoutError: slow\n  second line", **failed)
    OutboxMessageFactory.create_batch(
        2, status=Status.ABANDONED, abandoned_at=now, last_error="destination 'x' has no route"
    )

    def parked(consumer: str, error: str, minutes_ago: int) -> None:
        InboxFailure.objects.create(
            consumer=consumer,
            event_id=uuid.uuid4(),
            attempts=5,
            last_error=error,
            parked_at=now - dt.timedelta(minutes=minutes_ago),
        )

    parked("billing", "ValueError: an older one", 10)
    parked("billing", "KeyError: 'total'", 1)
    parked("shipping", "ValueError: bad", 3)
    InboxFailure.objects.create(consumer="audit", event_id=uuid.uuid4(), attempts=1)  # not parked

    out = manage("outbox_status").stdout
    tail = out.split("oldest due row:")[1].splitlines()
    assert tail[
        tail.index("most frequent errors of the latest 1000 failed and abandoned rows:") :
    ] == [
        "most frequent errors of the latest 1000 failed and abandoned rows:",
        "        3  failed     ConnectionRefusedError: refused",
        "        2  abandoned  destination 'x' has no route",
        "        1  failed     TimeoutError: slow second line",
        "parked inbox messages by consumer (the newest one's error):",
        "        2  billing: KeyError: 'total'",
        "        1  shipping: ValueError: bad",
    ]


# -- the LOGGING snippet of docs/deploying.md ----------------------------------------------


def logging_snippet() -> str:
    text = (REPO / "docs" / "deploying.md").read_text()
    section = text.split("\n## Logging\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def relay_once_with_settings(tmp_path, name, settings_text, destination):
    """``run_outbox_relay --once`` in a subprocess, settings module ``name`` written from
    ``settings_text``, after two events staged to ``destination`` on a broker that
    refuses connections; its result, the relay exited 1."""
    (tmp_path / f"{name}.py").write_text(settings_text)
    stage_events(2, destination)
    env = relay_env(BROKER_URL=unreachable_broker_url())
    env.update(
        DJANGO_SETTINGS_MODULE=name,
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO)]),
    )
    result = subprocess.run(
        manage_command("run_outbox_relay", "--once"),
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    return result


def test_the_logging_snippet_shows_the_relays_warnings_on_stderr(tmp_path):
    orders = unique_destination()
    settings_text = "from tests.settings import *  # noqa: F403\n\n" + logging_snippet()
    result = relay_once_with_settings(tmp_path, "snippet_settings", settings_text, orders)
    pattern = (
        rf"\d{{4}}-\d\d-\d\d [\d:,]+ WARNING django_outbox.relay publishing 2 row\(s\) to "
        rf"'{orders}' failed: {re.escape(REFUSED)}; the next retry is due in [\d.]+s"
    )
    assert re.search(pattern, result.stderr, re.MULTILINE), result.stderr


def test_without_logging_a_warning_reaches_stderr_bare_and_info_not_at_all(tmp_path):
    """What docs/deploying.md's Logging section says of a project with no ``LOGGING``:
    Python's last-resort handler prints a WARNING as the bare message; INFO is dropped."""
    orders = unique_destination()
    settings_text = "from tests.settings import *  # noqa: F403\n\ndel LOGGING  # noqa: F821\n"
    result = relay_once_with_settings(tmp_path, "bare_settings", settings_text, orders)
    bare = rf"^publishing 2 row\(s\) to '{orders}' failed: {re.escape(REFUSED)}; the next retry"
    assert re.search(bare, result.stderr, re.MULTILINE), result.stderr
    assert "WARNING" not in result.stderr


@pytest.mark.parametrize(
    ("command", "table"),
    [
        (["run_outbox_relay", "--drain"], "django_outbox_outboxmessage"),
        (["outbox_status"], "django_outbox_outboxmessage"),
        (["outbox_inbox_start", "--consumer", "c", "--like", "b"], "django_outbox_inboxsequence"),
        (
            [
                "run_outbox_consumer",
                "--queue",
                "orders",
                "--handler",
                "tests.testapp.handlers.bill",
            ],
            "django_outbox_inboxmessage",
        ),
    ],
)
def test_a_command_on_a_database_never_migrated_says_run_migrate(tmp_path, command, table):
    """A new user who skipped ``migrate``: one line naming the table, not a traceback."""
    env = never_migrated_env(tmp_path)
    result = subprocess.run(
        manage_command(*command), cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip() == (
        f"CommandError: database 'default' has no table {table}: django_outbox's migrations "
        "are not applied there; run python manage.py migrate"
    )
