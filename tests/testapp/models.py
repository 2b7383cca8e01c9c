"""A business model for the tests: the write an event must agree with."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    customer = models.CharField(max_length=100)
    total = models.DecimalField(max_digits=10, decimal_places=2)

    def __str__(self) -> str:
        return f"order {self.pk}"


class Delivery(models.Model):
    """A side effect of handling an event: one row per handler run, never deduped here,
    so duplicates in this table mean the inbox failed."""

    consumer = models.CharField(max_length=100)
    event_id = models.UUIDField(null=True)
    n = models.IntegerField(null=True)

    def __str__(self) -> str:
        return f"{self.consumer}: {self.event_id}"
