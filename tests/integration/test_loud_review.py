"""Attacks on issue 19's loud failures, each a bug found in review: real RabbitMQ (through
a TCP proxy of the tests' own where a broker must flap: no real part drops connections on
cue), real subprocesses for the commands."""

from __future__ import annotations

import logging
import re
import threading

import pytest
from django.core import checks
from django.test.utils import override_settings

from django_outbox.db import EXACT_COUNT_LIMIT
from django_outbox.models import OutboxMessage
from django_outbox.ops.checks import check_brokers
from django_outbox.relay.loop import MAX_LOGGED_REASONS, Relay
from tests.integration.test_consumer import RECORD, SUMMARY
from tests.integration.test_silent_broker import BROKER, FreezableProxy
from tests.support import (
    AMQP_URL,
    broker_connection,
    delete_queue,
    manage,
    stage_events,
    start_command,
    stop,
    unique_destination,
    unreachable_broker_url,
)

pytestmark = pytest.mark.django_db(transaction=True)

PASSWORD = "s3cret-Passw0rd"


def test_idle_timeout_exits_0_when_the_broker_flaps_but_no_message_comes():
    """A broker whose connections drop every 3 s, reachable again within a second each
    time: no message came for --idle-timeout 5, so the consumer is idle and exits 0. It
    used to restart its idle clock at every reconnection and add up the seconds between
    them, until it exited 1 saying it had been 5 s without a broker."""
    queue = unique_destination()
    proxy = FreezableProxy(BROKER)
    done = threading.Event()

    def flap() -> None:
        while not done.wait(3.0):
            proxy.thaw()  # resets every connection; new ones pass at once

    flapper = threading.Thread(target=flap, daemon=True)
    consumer = start_command(
        "run_outbox_consumer",
        "--queue",
        queue,
        *RECORD,
        "--idle-timeout",
        "5",
        BROKER_URL=proxy.url,
    )
    flapper.start()
    try:
        out, err = consumer.communicate(timeout=90)
    finally:
        done.set()
        if consumer.poll() is None:
            stop(consumer)
        proxy.close()
        delete_queue(queue)
    assert consumer.returncode == 0, err
    assert "gave up" not in err
    assert SUMMARY.fullmatch(out.strip()), out


def test_a_drain_whose_failed_rows_were_published_later_in_the_run_says_it_truly():
    """No queue is bound to the route until the drain is under way (a consumer that
    starts late): the first batches fail as unroutable, the later ones publish, and the
    failed rows, due again within the drain, are published too. The drain still exits 1
    (publishes failed in its run), but it used to say "N of M claimed rows were not
    published" while every row was published; it counts claims, and no row waits for a
    retry."""
    orders = unique_destination()
    routing_key = f"{orders}.late"
    stage_events(3000, orders)
    relay = start_command(
        "run_outbox_relay",
        "--drain",
        "--skip-checks",  # its warning that no queue is bound yet is this test's point
        "--batch-size",
        "100",
        ROUTES={orders: {"exchange": "amq.topic", "routing_key": routing_key}},
        RETRY_BASE_DELAY=0.01,
    )
    try:
        first = relay.stderr.readline()  # the first failed batch's WARNING
        with broker_connection(AMQP_URL) as connection:
            channel = connection.channel()
            channel.queue_declare(queue=orders, durable=True, auto_delete=False)
            channel.queue_bind(queue=orders, exchange="amq.topic", routing_key=routing_key)
        out, err = relay.communicate(timeout=120)
    finally:
        if relay.poll() is None:
            stop(relay)
        delete_queue(orders)
    assert first.startswith(f"publishing 100 row(s) to {orders!r} failed: unroutable"), first
    assert OutboxMessage.objects.filter(status="published").count() == 3000
    assert relay.returncode == 1, err
    summary = re.match(r"claimed (\d+), published 3000, failed (\d+), abandoned 0", out)
    assert summary, out
    claimed, failed = int(summary[1]), int(summary[2])
    assert claimed == 3000 + failed
    assert "wait for a retry" not in out
    assert err.splitlines()[-1] == (
        f"CommandError: {failed} of {claimed} claims in this run were not published: "
        f"failed {failed}, abandoned 0"
    )


# -- the folders of a filesystem:// broker (E012, W005) -----------------------------------

OPTIONS = 'OUTBOX["BROKER_TRANSPORT_OPTIONS"]'


def filesystem_check(options):
    with override_settings(
        OUTBOX={"BROKER_URL": "filesystem://", "BROKER_TRANSPORT_OPTIONS": options}
    ):
        return check_brokers()


def test_a_folder_and_a_symlink_to_it_are_one_folder_not_w005(tmp_path):
    """They used to be compared as paths: W005 said no event would ever be consumed,
    though the relay writes where the consumers read."""
    (tmp_path / "broker").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "broker")
    options = {
        "data_folder_in": str(tmp_path / "broker"),
        "data_folder_out": str(tmp_path / "link"),
    }
    assert filesystem_check(options) == []


def test_a_file_where_the_folder_should_be_is_not_said_to_be_missing(tmp_path):
    """It used to say "does not exist", with a hint (mkdir -p) that fails on the file."""
    path = tmp_path / "broker"
    path.write_text("")
    assert filesystem_check({"data_folder_in": str(path), "data_folder_out": str(path)}) == [
        checks.Error(
            f"The filesystem:// broker's folder {str(path)!r} ({OPTIONS}[{option!r}]) is not "
            "a folder.",
            hint=f"Set {OPTIONS}[{option!r}] to a folder, or put a folder in its place.",
            id="django_outbox.E012",
        )
        for option in ("data_folder_in", "data_folder_out")
    ]


def test_a_folder_under_home_written_with_a_tilde_says_kombu_does_not_expand_it(
    tmp_path, monkeypatch
):
    """kombu takes "~/broker" literally (a folder "~" in the working directory). The
    check used to say it did not exist, hinting "mkdir -p ~/broker": that folder then
    existed, and the check still failed."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "broker").mkdir()  # what mkdir -p ~/broker makes
    options = {"data_folder_in": "~/broker", "data_folder_out": "~/broker"}
    assert filesystem_check(options) == [
        checks.Error(
            f"The filesystem:// broker's folder '~/broker' ({OPTIONS}[{option!r}]) starts "
            'with "~", which kombu does not expand: it would be a folder named "~" in the '
            "working directory.",
            hint=f"Write the whole path, such as {str(tmp_path / 'broker')!r} "
            "(os.path.expanduser('~/broker')).",
            id="django_outbox.E012",
        )
        for option in ("data_folder_in", "data_folder_out")
    ]


# -- run_outbox_relay --drain -------------------------------------------------------------


def drain_to_a_dead_broker():
    """``run_outbox_relay --drain`` in batches of 100 to a broker that refuses connections
    (its URL holding ``PASSWORD``), retries a minute away."""
    return manage(
        "run_outbox_relay",
        "--drain",
        "--batch-size",
        "100",
        BROKER_URL=unreachable_broker_url(PASSWORD),
        RETRY_BASE_DELAY=60,
    )


def test_a_drain_that_gave_up_says_how_many_rows_it_never_tried():
    """250 rows, batches of 100, the broker down: the drain fails the batch it tried (an
    attempt each: the connection was refused), does not attempt the claim made ahead
    (its broker is down by then: no attempt spent, due again at once) and gives up. It
    used to name only the rows waiting for a retry, as if the outbox held no more; the
    rows never tried (those claimed ahead and those never claimed) are due, untried."""
    orders = unique_destination()
    stage_events(250, orders)
    result = drain_to_a_dead_broker()
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    waiting = int(re.search(r"^(\d+) rows wait for a retry", result.stdout, re.M)[1])
    untried = 250 - waiting
    assert untried > 0, lines
    assert lines[-1] == f"{untried} rows are due and were not tried: the drain stopped first", lines
    assert OutboxMessage.objects.filter(attempts=0).count() == untried
    assert PASSWORD not in result.stdout + result.stderr


# -- the relay's log: one record per batch and destination, whatever the error texts ------


def test_unroutable_rows_with_a_routing_key_each_are_not_one_warning_per_row(caplog):
    """A route whose routing key holds ``{key}`` and to which no queue is bound: each
    row's error names its own routing key, so 300 rows had 300 reasons, and the relay
    logged 300 WARNINGs for one batch. Now a destination gets a few records per batch,
    the rest of its reasons summed up in one."""
    orders = unique_destination()
    stage_events(300, orders, keys=300)
    outbox = {
        "BROKER_URL": AMQP_URL,
        "ROUTES": {orders: {"exchange": "amq.topic", "routing_key": "nobody.{key}"}},
        "RETRY_BASE_DELAY": 60,
    }
    with override_settings(OUTBOX=outbox), Relay(batch_size=300) as relay:
        with caplog.at_level(logging.WARNING, logger="django_outbox"):
            stats = relay.run_once()
    assert (stats.claimed, stats.failed) == (300, 300)
    failed = [r for r in caplog.records if getattr(r, "action", "") == "outbox.publish_failed"]
    assert len(failed) <= MAX_LOGGED_REASONS + 1, len(failed)
    assert sum(r.count for r in failed) == 300
    rest = failed[-1]
    assert rest.getMessage().startswith(
        f"publishing {rest.count} row(s) to {orders!r} failed: "
        f"{300 - MAX_LOGGED_REASONS} other errors, such as unroutable: no queue is bound to "
        "exchange 'amq.topic' for routing key 'nobody.k"
    ), rest.getMessage()


def test_more_rows_left_than_counted_exactly_are_a_true_lower_bound_not_an_estimate():
    """Past EXACT_COUNT_LIMIT due rows, the drain printed the planner's estimate ("about
    37264 rows are due" with 10800 left, after the table's rows had changed since its
    last ANALYZE). A lower bound read from the rows themselves is always true."""
    orders = unique_destination()
    stage_events(EXACT_COUNT_LIMIT + 300, orders)
    result = drain_to_a_dead_broker()
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines()[-1] == (
        f"more than {EXACT_COUNT_LIMIT} rows are due and were not tried: the drain stopped first"
    ), result.stdout
