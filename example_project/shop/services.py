"""The shop's business operations: each one writes its rows and stages its event together."""

from __future__ import annotations

from decimal import Decimal

from django_outbox import publish_on_success

from .models import Order


@publish_on_success(
    "order.placed",
    destination="orders",
    payload=lambda order, *args, **kwargs: {
        "order_id": order.pk,
        "customer": order.customer,
        "total": order.total,
    },
    key=lambda order, *args, **kwargs: f"customer-{order.customer}",
)
def place_order(customer: str, total: Decimal) -> Order:
    """Write the order; the ``order.placed`` event commits with it or not at all."""
    return Order.objects.create(customer=customer, total=total)
