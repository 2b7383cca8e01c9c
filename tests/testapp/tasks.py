"""A Celery task that dedupes through the inbox; run by a real worker in the tests."""

from __future__ import annotations

from celery import shared_task

from django_outbox.celery import InboxTask

from .models import Delivery


@shared_task(base=InboxTask, name="testapp.record_payment")
def record_payment(n: int) -> int:
    Delivery.objects.create(consumer="celery", event_id=record_payment.request.id, n=n)
    return n


@shared_task(name="testapp.hijacked")
def hijacked(**kwargs: object) -> None:
    """Never the task of a route: a worker that runs it was told to by a header."""
    Delivery.objects.create(consumer="hijacked", event_id=hijacked.request.id)


@shared_task(base=InboxTask, name="testapp.bill", inbox_event_types=["order.placed"])
def bill(order_id: int) -> int:
    """Bills order.placed only; an order.shipped task returns None, unrun."""
    Delivery.objects.create(consumer="bill", event_id=bill.request.id, n=order_id)
    return order_id
