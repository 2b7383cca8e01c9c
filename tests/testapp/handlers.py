"""Handlers that tests run through run_outbox_consumer (by dotted path) and the inbox."""

from __future__ import annotations

import os
import signal
import time

from django_outbox import ReceivedEvent, inbox_handler

from .models import Delivery


def record(event: ReceivedEvent) -> None:
    """Write one Delivery per run; a payload {"fail": true} raises instead."""
    if isinstance(event.payload, dict) and event.payload.get("fail"):
        raise RuntimeError(f"handler refuses event {event.event_id}")
    Delivery.objects.create(consumer="record", event_id=event.event_id, n=event.payload.get("n"))


_first_call: list[float] = []


def flaky(event: ReceivedEvent) -> None:
    """Fail (a downstream outage) for $TESTAPP_FAIL_FOR seconds from this process's
    first call, then record."""
    if not _first_call:
        _first_call.append(time.monotonic())
    if time.monotonic() - _first_call[0] < float(os.environ.get("TESTAPP_FAIL_FOR", "0")):
        raise ConnectionError("downstream unavailable")
    record(event)


def killer(event: ReceivedEvent) -> None:
    """SIGKILL this very process on a payload {"kill": true} (a poison message that
    crashes every consumer, like an OOM kill); record anything else."""
    if isinstance(event.payload, dict) and event.payload.get("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    record(event)


@inbox_handler("decorated")
def decorated(event: ReceivedEvent) -> None:
    Delivery.objects.create(consumer="decorated", event_id=event.event_id)


not_callable = 42


@inbox_handler("billing", event_types=["order.placed"])
def bill(event: ReceivedEvent) -> None:
    """The quickstart's billing handler: order.placed only; order.shipped is ignored."""
    Delivery.objects.create(consumer="billing", event_id=event.event_id)


def ordered(event: ReceivedEvent) -> None:
    """Record which process handled which sequence of which key (one Delivery per run:
    consumer "<pid> <ordering key>", n the sequence), for the ordered consumption tests."""
    Delivery.objects.create(
        consumer=f"{os.getpid()} {event.ordering_key}", event_id=event.event_id, n=event.sequence
    )


def slow_ordered(event: ReceivedEvent) -> None:
    """:func:`ordered`, taking 10 ms more per event, so a test can act mid-stream."""
    time.sleep(0.01)
    ordered(event)


def tracked(event: ReceivedEvent) -> None:
    """Record who handled what: one Delivery per run, consumer "<pid> <ordering key>
    <header tenant>", n the payload's n (for the Kafka consumer's tests). Driven by the
    environment: $TESTAPP_SLEEP seconds per event; a payload {"fail": true} raises while
    the file $TESTAPP_REFUSE exists; a payload {"block": true} creates the file
    $TESTAPP_BLOCKED and blocks (a handler hung mid-event) while that variable is set."""
    time.sleep(float(os.environ.get("TESTAPP_SLEEP", "0")))
    payload = event.payload if isinstance(event.payload, dict) else {}
    refuse = os.environ.get("TESTAPP_REFUSE")
    if payload.get("fail") and refuse and os.path.exists(refuse):
        raise RuntimeError(f"handler refuses event {event.event_id}")
    blocked = os.environ.get("TESTAPP_BLOCKED")
    if payload.get("block") and blocked:
        open(blocked, "w").close()
        time.sleep(600)
    who = f"{os.getpid()} {event.ordering_key} {event.headers.get('tenant')}"
    Delivery.objects.create(consumer=who, event_id=event.event_id, n=payload.get("n"))


def described(event: ReceivedEvent) -> None:
    """Record the event's type, its tenant header and its key (as the consumer name)."""
    Delivery.objects.create(
        consumer=f"{event.event_type} {event.headers.get('tenant')} {event.ordering_key}",
        event_id=event.event_id,
        n=event.payload.get("n"),
    )


def blocking(event: ReceivedEvent) -> None:
    """On a payload {"block": true}, the first time only: create the file
    $TESTAPP_BLOCKED (so a test knows the handler is in hand) and block; record the rest."""
    marker = os.environ.get("TESTAPP_BLOCKED", "")
    if isinstance(event.payload, dict) and event.payload.get("block") and marker:
        if not os.path.exists(marker):
            with open(marker, "w"):
                pass
            time.sleep(600)
    record(event)


def accepting(event: ReceivedEvent) -> None:
    """:func:`record`, which no longer refuses {"fail": true}: the fixed handler."""
    Delivery.objects.create(consumer="record", event_id=event.event_id, n=event.payload.get("n"))
