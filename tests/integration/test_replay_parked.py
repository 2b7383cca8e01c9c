"""outbox_replay_parked against real RabbitMQ: park, replay, handled once."""

from __future__ import annotations

import re
import uuid

import kombu
import pytest
from django.utils import timezone

from django_outbox.models import InboxFailure
from tests.integration.test_silent_broker import memory_alarm
from tests.support import (
    broker_connection,
    delete_queue,
    drain_raw,
    manage,
    run_relay,
    stage_events,
    unique_destination,
)
from tests.testapp.models import Delivery

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.disrupts]

FLAKY = ("--handler", "tests.testapp.handlers.flaky", "--consumer", "audit")


@pytest.fixture
def destination():
    name = unique_destination("r")
    yield name
    delete_queue(name)


def consume(queue: str, *args: str) -> str:
    result = manage("run_outbox_consumer", "--queue", queue, *FLAKY, "--idle-timeout", "2", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def replay(*args: str) -> list[str]:
    result = manage("outbox_replay_parked", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def queue_depth(queue: str) -> int:
    with broker_connection() as connection:
        return kombu.Queue(queue, channel=connection.channel()).queue_declare(passive=True)[1]


def test_parked_messages_are_replayed_to_their_queue_and_handled_once(destination, monkeypatch):
    staged = stage_events(3, destination)
    run_relay("--drain")
    monkeypatch.setenv("TESTAPP_FAIL_FOR", "3600")
    out = consume(destination, "--max-deliveries", "2", "--retry-delay", "0")
    assert "parked 3" in out
    assert InboxFailure.objects.parked().count() == 3

    # --dry-run lists them and changes nothing.
    lines = replay("--dry-run")
    assert lines[-1] == "would replay 3 parked messages"
    assert sorted(re.match(r"would replay (\S+) ", line)[1] for line in lines[:-1]) == sorted(
        staged
    )
    assert f"(test.event) of audit to {destination}: ConnectionError: downstream" in lines[0]
    assert InboxFailure.objects.parked().count() == 3
    assert queue_depth(destination) == 0

    # One by event id, then the rest by consumer; the filters leave others alone.
    assert replay("--queue", "elsewhere") == ["replayed 0 parked messages"]
    assert replay("--event-id", staged[0])[-1] == "replayed 1 parked message"
    assert queue_depth(destination) == 1
    assert replay("--consumer", "audit")[-1] == "replayed 2 parked messages"
    assert queue_depth(destination) == 3
    assert not InboxFailure.objects.parked().exists()
    assert set(InboxFailure.objects.values_list("attempts", flat=True)) == {0}

    # The handler is fixed: each replayed event is handled once, nothing parked again.
    monkeypatch.setenv("TESTAPP_FAIL_FOR", "0")
    assert "handled 3, duplicates 0, ignored 0, failed 0, parked 0, rejected 0" in consume(
        destination
    )
    assert sorted(map(str, Delivery.objects.values_list("event_id", flat=True))) == sorted(staged)
    assert replay() == ["replayed 0 parked messages"]


def test_an_event_id_that_is_not_parked_refuses_the_whole_replay(destination, monkeypatch):
    staged = stage_events(2, destination)
    run_relay("--drain")
    monkeypatch.setenv("TESTAPP_FAIL_FOR", "3600")
    consume(destination, "--max-deliveries", "1")
    missing = "7d3c1a52-5f0e-4a8e-9c11-0b6f4c1f2e9a"
    result = manage("outbox_replay_parked", "--event-id", staged[0], missing)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"CommandError: no parked message matches {missing}; nothing replayed"
    )
    assert InboxFailure.objects.parked().count() == 2
    assert queue_depth(destination) == 0


def test_a_replay_keeps_the_events_own_x_headers_and_drops_the_brokers(destination):
    """stage() lets a user header be called x-tenant; only what the broker or kombu added
    on delivery (x-delivery-count, x-death ..., redelivered) is left out of the replay."""
    event_id = uuid.uuid4()
    headers = {
        "event_id": str(event_id),
        "event_type": "test.event",
        "x-tenant": "acme",
        "x-delivery-count": 4,
        "x-death": [{"queue": destination, "count": 1}],
        "x-first-death-queue": destination,
        "x-last-death-reason": "rejected",
        "redelivered": True,
    }
    InboxFailure.objects.create(
        consumer="audit",
        event_id=event_id,
        queue=destination,
        attempts=2,
        body='{"n": 1}',
        headers=headers,
        parked_at=timezone.now(),
    )
    assert replay()[-1] == "replayed 1 parked message"
    [message] = drain_raw(destination)
    assert message.headers == {
        "event_id": str(event_id),
        "event_type": "test.event",
        "x-tenant": "acme",
    }
    assert message.body == '{"n": 1}'  # py-amqp decodes it by its content encoding


def park(queue: str) -> InboxFailure:
    event_id = uuid.uuid4()
    return InboxFailure.objects.create(
        consumer="audit",
        event_id=event_id,
        queue=queue,
        attempts=2,
        body='{"n": 1}',
        headers={"event_id": str(event_id)},
        parked_at=timezone.now(),
    )


def test_a_replay_the_broker_refuses_is_a_one_line_error_and_stays_parked(destination):
    """A full queue with x-overflow reject-publish nacks the replay: a CommandError, no
    traceback, and the record stays parked for the next replay."""
    park(destination)
    full = {
        "queue": destination,
        "queue_arguments": {"x-max-length": 0, "x-overflow": "reject-publish"},
    }
    result = manage("outbox_replay_parked", ROUTES={destination: full})
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        f"CommandError: the broker refused the message replayed to {destination} "
        "(negative acknowledgement); nothing more replayed"
    )
    assert InboxFailure.objects.parked().count() == 1


@pytest.mark.slow
def test_a_replay_whose_confirm_never_comes_fails_instead_of_hanging(destination):
    """RabbitMQ's memory alarm blocks publishers: the confirm never comes. The replay
    gives up after the confirm timeout (3 s here, 30 by default) with a one-line error,
    the record stays parked."""
    park(destination)
    with memory_alarm():
        result = manage("outbox_replay_parked", "--confirm-timeout", "3", timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("CommandError: cannot reach the broker: "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert InboxFailure.objects.parked().count() == 1
