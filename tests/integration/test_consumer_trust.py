"""The consumer trusts nothing it reads from a queue (issue 39): messages forged by anyone
who can publish to a consumer's queue, put on real RabbitMQ, cannot park a real event early
(a broker header the broker did not set), take a real event's place in its key's sequence,
inflate a compressed body in the consumer's memory, or pass for a relay's message when
signatures are verified."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import transaction
from django.test import override_settings

from django_outbox import ReceivedEvent, stage
from django_outbox.consumer import InboxConsumer
from django_outbox.envelope import CONTENT_TYPE
from django_outbox.exceptions import InvalidEvent
from django_outbox.models import InboxFailure
from tests.support import AMQP_URL, delete_queue, publish_raw, unique_destination

pytestmark = [pytest.mark.django_db(transaction=True)]


class Handler:
    """Remembers the event ids it ran for; fails the first ``fail`` calls."""

    def __init__(self, fail: int = 0) -> None:
        self.ran: list[uuid.UUID] = []
        self.fail = fail

    def __call__(self, event: ReceivedEvent) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the downstream is down")
        self.ran.append(event.event_id)


def forge(queue: str, payload: Any, **headers: Any) -> uuid.UUID:
    """Publish to ``queue`` what anyone with publish rights can: an outbox-looking
    message with the headers given and a fresh event id unless given."""
    headers.setdefault("event_id", str(uuid.uuid4()))
    headers.setdefault("event_type", "order.placed")
    publish_raw(
        queue,
        json.dumps(payload),
        content_type=CONTENT_TYPE,
        content_encoding="utf-8",
        headers=headers,
        message_id=headers["event_id"],
    )
    return uuid.UUID(headers["event_id"])


def consume(queue: str, handler: Handler, **options: Any) -> InboxConsumer:
    options = {"retry_delay": 0.05, "retry_max_delay": 0.2, **options}
    consumer = InboxConsumer(queue, handler, "trust", **options)
    consumer.run(idle_timeout=2)
    return consumer


@pytest.fixture(params=["classic", "quorum"])
def queue(request):
    """A queue of either type, declared by its route."""
    name = unique_destination("trust")
    routes = {name: {"queue": name, "queue_type": request.param}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        InboxConsumer(name, Handler(), "trust").run(idle_timeout=0.1)  # declares it
        yield name
    delete_queue(name)


# -- item 3: headers the broker sets are believed only where it sets them ------------


def test_a_forged_delivery_count_does_not_park_an_event_after_one_failure(queue):
    """x-delivery-count 40 from the publisher: on a classic queue the broker never sets
    it, on a quorum queue it leaves a publisher's in place on the first delivery. The
    event that fails once is retried and handled, not parked."""
    event_id = forge(queue, {"n": 1}, **{"x-delivery-count": 40})
    handler = Handler(fail=1)
    stats = consume(queue, handler, max_deliveries=5).stats
    assert (stats.failed, stats.parked, stats.handled) == (1, 0, 1)
    assert handler.ran == [event_id]
    assert not InboxFailure.objects.parked().exists()


@pytest.mark.parametrize(
    "name",
    [
        "x-delivery-count",
        "x-death",
        "x-first-death-queue",
        "x-last-death-reason",
        "x-received-from",
        "x-shovelled-timestamp",
        "CC",
        "BCC",
        "compression",
    ],
)
def test_stage_refuses_a_header_a_broker_or_kombu_interprets(name):
    with transaction.atomic(), pytest.raises(InvalidEvent) as refused:
        stage("order.placed", {"n": 1}, destination="orders", headers={name: "1"})
    assert str(refused.value) == (
        f"event 'order.placed': headers [{name!r}] are reserved for the relay, kombu and "
        "the brokers and cannot be given"
    )
