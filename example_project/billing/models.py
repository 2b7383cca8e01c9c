"""The consuming side of the example: billing invoices every placed order."""

from __future__ import annotations

from django.db import models


class Invoice(models.Model):
    """One per handled ``order.placed`` event. No unique constraint on purpose: the
    inbox alone keeps a redelivered event from invoicing an order twice."""

    order_id = models.BigIntegerField()
    customer = models.CharField(max_length=100)
    total = models.DecimalField(max_digits=10, decimal_places=2)
    event_id = models.UUIDField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"invoice for order {self.order_id}"
