"""Handlers that tests run through run_outbox_consumer (by dotted path) and the inbox."""

from __future__ import annotations

from django_outbox import ReceivedEvent, inbox_handler

from .models import Delivery


def record(event: ReceivedEvent) -> None:
    """Write one Delivery per run; a payload {"fail": true} raises instead."""
    if isinstance(event.payload, dict) and event.payload.get("fail"):
        raise RuntimeError(f"handler refuses event {event.event_id}")
    Delivery.objects.create(consumer="record", event_id=event.event_id, n=event.payload.get("n"))


@inbox_handler("decorated")
def decorated(event: ReceivedEvent) -> None:
    Delivery.objects.create(consumer="decorated", event_id=event.event_id)


not_callable = 42
