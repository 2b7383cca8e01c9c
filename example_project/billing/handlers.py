"""Billing's handler for ``order.placed``, run once per event through the inbox::

    python manage.py run_outbox_consumer --queue orders \
        --handler example_project.billing.handlers.invoice_order
"""

from __future__ import annotations

from decimal import Decimal

from django_outbox import ReceivedEvent, inbox_handler

from .models import Invoice


@inbox_handler("billing")
def invoice_order(event: ReceivedEvent) -> Invoice:
    order = event.payload
    return Invoice.objects.create(
        order_id=order["order_id"],
        customer=order["customer"],
        total=Decimal(order["total"]),
        event_id=event.event_id,
    )
