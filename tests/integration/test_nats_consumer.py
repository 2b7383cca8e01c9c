"""``run_outbox_consumer`` on a NATS JetStream broker (issue 45, the consuming half), on
the real three-node cluster (``scripts/services nats start``).

Events are staged and relayed by the real relay (``run_outbox_relay``), consumed by the
real command in a subprocess, killed with real signals; the cluster's nodes are SIGKILLed
and SIGSTOPped for real. What the stream and its durable consumers hold is asked of
nats-py directly.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
import uuid
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings

from django_outbox import stage
from django_outbox.models import InboxFailure, InboxMessage
from tests.integration.test_nats import (
    NATS_URL,
    SERVERS,
    live,
    node_pids,
    nodes_stopped,
)
from tests.support import (
    manage,
    run_relay,
    services_output,
    stage_events,
    start_command,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp.models import Delivery

nats = pytest.importorskip("nats", reason="nats-py is not installed (the [nats] extra)")

pytestmark = live

SUMMARY = re.compile(
    r"received (?P<received>\d+): handled (?P<handled>\d+), duplicates (?P<duplicates>\d+), "
    r"ignored (?P<ignored>\d+), failed (?P<failed>\d+), parked (?P<parked>\d+), "
    r"rejected (?P<rejected>\d+)(?:, held back (?P<held>\d+))? in [\d.]+s .*"
)
RECORD = ("--handler", "tests.testapp.handlers.record", "--consumer", "audit")
#: The durable consumer of inbox consumer "audit": its own name (docs/nats.md).
DURABLE = "audit"


@pytest.fixture
def route() -> Any:
    """A destination whose events go to subject ``outbox.<destination>`` of a stream of
    three replicas of its own, on the broker alias "events" (the default broker stays
    RabbitMQ's); and the OUTBOX of the relay and the consumer."""
    destination = unique_destination("natsc")
    stream = destination.replace("-", "_").upper()
    outbox = {
        "BROKER_URL": None,
        "BROKERS": {
            "default": {"URL": os.environ["OUTBOX_BROKER_URL"]},
            "events": {"URL": NATS_URL},
        },
        "ROUTES": {
            destination: {
                "broker": "events",
                "subject": f"outbox.{destination}",
                "stream": stream,
                "replicas": 3,
            }
        },
        "RETRY_BASE_DELAY": 0.2,
        "RETRY_MAX_DELAY": 1,
        "POLL_INTERVAL": 0.2,
    }
    yield destination, stream, outbox
    assert sorted(node_pids()) == [1, 2, 3], "the test left a node stopped"


def consumer_args(stream: str, *args: str) -> list[str]:
    return ["run_outbox_consumer", "--broker", "events", "--queue", stream, *args]


def consume(stream: str, *args: str, idle: float = 3, **outbox: Any) -> dict[str, int]:
    """Run the consumer until the stream has been quiet for ``idle`` s: its counts."""
    result = manage(*consumer_args(stream, "--idle-timeout", str(idle), *args), **outbox)
    assert result.returncode == 0, result.stderr
    match = SUMMARY.fullmatch(result.stdout.strip().splitlines()[-1])
    assert match, result.stdout
    return {key: int(value or 0) for key, value in match.groupdict().items()}


def start_consumer(stream: str, *args: str, **outbox: Any) -> Any:
    return start_command(*consumer_args(stream, *args), **outbox)


def counts(**given: int) -> dict[str, int]:
    base = dict.fromkeys(
        ("handled", "duplicates", "ignored", "failed", "parked", "rejected", "held"), 0
    )
    return {**base, **given, "received": sum(given.values())}


def js_call(call: Any) -> Any:
    """``await call(js)`` on a connection of nats-py's own."""

    async def run() -> Any:
        nc = await nats.connect(SERVERS, connect_timeout=2)
        try:
            return await call(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(run())


def handled_ids() -> collections.Counter[str]:
    return collections.Counter(str(i) for i in Delivery.objects.values_list("event_id", flat=True))


# -- tests -------------------------------------------------------------------------------


def test_relayed_events_are_handled_once_with_their_headers(route):
    destination, stream, outbox = route
    with transaction.atomic():
        for n in range(5):
            stage(
                "order.placed",
                {"n": n},
                destination=destination,
                key=f"k{n}",
                headers={"tenant": "acme"},
            )
    run_relay("--drain", **outbox)
    summary = consume(
        stream, "--handler", "tests.testapp.handlers.described", "--consumer", "audit", **outbox
    )
    assert summary == counts(handled=5)
    assert sorted(Delivery.objects.values_list("consumer", "n")) == [
        (f"order.placed acme k{n}", n) for n in range(5)
    ]
    # Acked: the durable (named after the consumer) has nothing pending, nothing unacked.
    info = js_call(lambda js: js.consumer_info(stream, DURABLE))
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    assert consume(stream, *RECORD, idle=2, **outbox) == counts()


def test_a_subject_is_consumed_from_the_stream_that_takes_it(route):
    destination, _stream, outbox = route
    ids = stage_events(3, destination)
    run_relay("--drain", **outbox)
    assert consume(f"outbox.{destination}", *RECORD, **outbox) == counts(handled=3)
    assert handled_ids() == collections.Counter(ids)


def test_a_redelivered_event_is_a_duplicate_and_a_foreign_message_is_terminated(route):
    """A second copy of a handled event reaches the stream (published again past the
    duplicate window: another Nats-Msg-Id) with a message that is no outbox event."""
    destination, stream, outbox = route
    [event_id] = stage_events(1, destination)
    run_relay("--drain", **outbox)
    assert consume(stream, *RECORD, **outbox) == counts(handled=1)
    [first] = js_call(lambda js: _fetch_all(js, stream))
    headers = {**first.headers, "Nats-Msg-Id": str(uuid.uuid4())}
    subject = f"outbox.{destination}"
    js_call(lambda js: js.publish(subject, first.data, headers=headers))
    js_call(lambda js: js.publish(subject, b"hello", headers={"Nats-Msg-Id": "x"}))
    assert consume(stream, *RECORD, **outbox) == counts(duplicates=1, rejected=1)
    assert handled_ids() == {event_id: 1}
    info = js_call(lambda js: js.consumer_info(stream, DURABLE))
    assert (info.num_pending, info.num_ack_pending) == (0, 0), "terminated, not redelivered"


async def _fetch_all(js: Any, stream: str) -> list[Any]:
    sub = await js.pull_subscribe(">", durable=f"reader-{uuid.uuid4().hex[:8]}", stream=stream)
    messages = await sub.fetch(100, timeout=2)
    for message in messages:
        await message.ack()
    return messages


def test_a_failing_handler_is_backed_off_parked_then_replayed(route):
    destination, stream, outbox = route
    with transaction.atomic():
        poison = stage("e", {"fail": True, "n": 0}, destination=destination)
    ids = stage_events(4, destination)
    run_relay("--drain", **outbox)
    summary = consume(
        stream,
        *RECORD,
        "--max-deliveries",
        "3",
        "--retry-delay",
        "0.2",
        "--retry-max-delay",
        "0.5",
        **outbox,
    )
    assert summary == counts(handled=4, failed=2, parked=1)
    failure = InboxFailure.objects.get()
    assert (failure.event_id, failure.attempts, failure.queue) == (
        poison.event_id,
        3,
        f"outbox.{destination}",
    )
    assert failure.parked_at is not None
    assert failure.last_error == f"RuntimeError: handler refuses event {poison.event_id}"
    # The server delivered it three times: the nak'd deliveries came back.
    info = js_call(lambda js: js.consumer_info(stream, DURABLE))
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)

    replayed = manage("outbox_replay_parked", "--consumer", "audit", **outbox)
    assert replayed.returncode == 0, replayed.stderr
    assert f"replayed {poison.event_id} (e) of audit to outbox.{destination}" in replayed.stdout
    fixed = ("--handler", "tests.testapp.handlers.accepting", "--consumer", "audit")
    assert consume(stream, *fixed, **outbox) == counts(handled=1)
    assert handled_ids() == collections.Counter([*ids, str(poison.event_id)])
    assert InboxFailure.objects.get().parked_at is None


def test_a_consumer_killed_mid_handler_then_restarted_handles_each_event_once(
    route, tmp_path, monkeypatch
):
    """The handler blocks on event 10 of 30; the consumer is SIGKILLed there. The durable
    (made beforehand with a 3 s ack wait, which the consumer uses as it is) delivers the
    unacked rest again to the restarted consumer."""
    destination, stream, outbox = route
    ids = stage_events(10, destination)
    with transaction.atomic():
        blocker = stage("e", {"block": True, "n": 10}, destination=destination)
    ids += [str(blocker.event_id), *stage_events(19, destination)]
    run_relay("--drain", **outbox)
    marker = tmp_path / "blocked"
    monkeypatch.setenv("TESTAPP_BLOCKED", str(marker))
    js_call(
        lambda js: js.add_consumer(
            stream,
            nats.js.api.ConsumerConfig(
                durable_name="audit", ack_policy="explicit", ack_wait=3, max_deliver=-1
            ),
        )
    )
    args = ("--handler", "tests.testapp.handlers.blocking", "--consumer", "audit")
    consumer = start_consumer(stream, *args, **outbox)
    wait_until(marker.exists, timeout=60, what="the handler blocked", process=consumer)
    consumer.send_signal(signal.SIGKILL)
    consumer.communicate(timeout=30)
    assert handled_ids() == collections.Counter(ids[:10])
    assert consume(stream, *args, **outbox)["handled"] == 20
    assert handled_ids() == collections.Counter(ids), "each event handled once"
    assert InboxMessage.objects.filter(consumer="audit").count() == 30


def test_sigterm_finishes_the_message_in_hand_and_the_rest_comes_at_once(route):
    destination, stream, outbox = route
    ids = stage_events(300, destination)
    run_relay("--drain", **outbox)
    args = ("--handler", "tests.testapp.handlers.slow_ordered", "--consumer", "audit")
    consumer = start_consumer(stream, *args, **outbox)
    wait_until(
        lambda: Delivery.objects.count() >= 50, timeout=60, what="50 handled", process=consumer
    )
    code, out, err = stop(consumer, signal.SIGTERM)
    assert code == 0, err
    assert "SIGTERM: stopping after the message in hand" in err
    handled = int(SUMMARY.fullmatch(out.strip().splitlines()[-1])["handled"])
    assert Delivery.objects.count() == handled < 300
    # The fetched rest was nak'd: a second run takes it at once (no ack wait).
    assert consume(stream, *args, **outbox)["handled"] == 300 - handled
    assert handled_ids() == collections.Counter(ids)


def test_an_ordered_route_keeps_each_keys_order(route):
    destination, stream, outbox = route
    outbox["ROUTES"][destination]["ordered"] = True
    with override_settings(OUTBOX=outbox):
        stage_events(200, destination, keys=4)
    run_relay("--drain", **outbox)
    args = ("--handler", "tests.testapp.handlers.ordered", "--consumer", "audit")
    assert consume(stream, *args, "--prefetch", "7", **outbox)["handled"] == 200
    by_key = collections.defaultdict(list)
    for consumer, n in Delivery.objects.order_by("id").values_list("consumer", "n"):
        by_key[consumer.split()[1]].append(n)
    assert dict(by_key) == {f"k{k}": list(range(1, 51)) for k in range(4)}


@pytest.mark.slow
def test_a_node_killed_while_consuming_loses_nothing(route):
    destination, stream, outbox = route
    ids = stage_events(1500, destination)
    run_relay("--drain", **outbox)
    args = ("--handler", "tests.testapp.handlers.slow_ordered", "--consumer", "audit")
    consumer = start_consumer(stream, *args, "--prefetch", "20", **outbox)
    try:
        wait_until(
            lambda: Delivery.objects.count() >= 200, timeout=60, what="consuming", process=consumer
        )
        leader = js_call(lambda js: js.stream_info(stream)).cluster.leader
        victim = int(leader.removeprefix("n"))
        os.kill(node_pids()[victim], signal.SIGKILL)
        try:
            at = Delivery.objects.count()
            wait_until(
                lambda: Delivery.objects.count() >= at + 200,
                timeout=90,
                what="consuming resumed",
                process=consumer,
            )
        finally:
            services_output("nats", "start-node", str(victim), timeout=120)
        wait_until(
            lambda: Delivery.objects.count() >= 1500,
            timeout=120,
            what="all handled",
            process=consumer,
        )
    finally:
        code, _out, err = stop(consumer)
    assert code == 0, err
    assert handled_ids() == collections.Counter(ids), "none lost, none handled twice"
    assert not InboxFailure.objects.exists()


def test_the_cluster_down_is_waited_out_without_counting_and_idle_timeout_gives_up(route):
    destination, stream, outbox = route
    first = stage_events(20, destination)
    run_relay("--drain", **outbox)
    consumer = start_consumer(stream, *RECORD, **outbox)
    try:
        wait_until(
            lambda: Delivery.objects.count() == 20,
            timeout=60,
            what="first handled",
            process=consumer,
        )
        with nodes_stopped():
            gave_up = manage(*consumer_args(stream, *RECORD, "--idle-timeout", "2"), **outbox)
            later = stage_events(20, destination)
        # The cluster elects its leaders again: the relay retries until it publishes.
        wait_until(
            lambda: manage("run_outbox_relay", "--drain", **outbox).returncode == 0,
            timeout=120,
            interval=1,
            what="the relay published again",
        )
        wait_until(
            lambda: Delivery.objects.count() == 40, timeout=90, what="all handled", process=consumer
        )
    finally:
        code, _out, err = stop(consumer)
    assert code == 0, err
    assert err.count("broker unreachable") == 1, err
    assert err.count("broker reachable again") == 1, err
    assert handled_ids() == collections.Counter(first + later)
    assert not InboxFailure.objects.exists(), "the outage counted no delivery"
    assert gave_up.returncode == 1
    assert "gave up after 2s without a broker: nats://" in gave_up.stderr, gave_up.stderr


def test_a_missing_stream_and_a_misfit_durable_are_one_line_errors(route):
    destination, stream, outbox = route
    result = manage(*consumer_args("NOPE", *RECORD, "--idle-timeout", "2"), **outbox)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "CommandError: no JetStream stream is named 'NOPE' or takes subject 'NOPE' on "
        f"{NATS_URL}: give --queue a stream or a subject of one (the relay creates its "
        "route's stream when it first publishes)"
    )
    stage_events(1, destination)
    run_relay("--drain", **outbox)
    js_call(
        lambda js: js.add_consumer(
            stream,
            nats.js.api.ConsumerConfig(
                durable_name="audit", ack_policy="none", filter_subject=f"outbox.{destination}"
            ),
        )
    )
    result = manage(*consumer_args(stream, *RECORD, "--idle-timeout", "2"), **outbox)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "CommandError: "
        f"JetStream consumer 'audit' of stream {stream!r} exists, but ack_policy none, not "
        f"explicit; filter_subject 'outbox.{destination}', not None: delete it (nats consumer "
        f"rm {stream} audit) or consume under another --consumer name"
    )


def test_signed_events_are_handled_and_altered_or_unsigned_copies_parked(route):
    """The relay signs (an ordered route: the signature covers the sequence, which NATS
    carries as text); a verifying consumer handles the real events and parks a copy with
    another body and one without a signature, unrun."""
    destination, stream, outbox = route
    outbox["ROUTES"][destination]["ordered"] = True
    key = "k" * 32 + "-new"
    with override_settings(OUTBOX=outbox):
        ids = stage_events(3, destination, keys=1)
    run_relay("--drain", SIGNING_KEYS=[key], **outbox)
    [first] = js_call(lambda js: _fetch_all(js, stream))[:1]
    subject = f"outbox.{destination}"
    altered = {**first.headers, "Nats-Msg-Id": "altered", "event_id": str(uuid.uuid4())}
    unsigned = {
        name: value
        for name, value in {**altered, "Nats-Msg-Id": "unsigned"}.items()
        if name != "outbox_signature"
    }
    unsigned["event_id"] = str(uuid.uuid4())
    js_call(lambda js: js.publish(subject, b'{"n": 1000}', headers=altered))
    js_call(lambda js: js.publish(subject, first.data, headers=unsigned))
    summary = consume(
        stream, *RECORD, "--verify-signatures", SIGNING_KEYS=["k" * 32 + "-old", key], **outbox
    )
    assert (summary["handled"], summary["parked"]) == (3, 2), summary
    assert handled_ids() == collections.Counter(ids)
    errors = dict(InboxFailure.objects.values_list("event_id", "last_error"))
    assert errors[uuid.UUID(unsigned["event_id"])] == (
        "unsigned: the message has no outbox_signature header"
    )
    assert errors[uuid.UUID(altered["event_id"])].startswith("the signature (key id ")
