"""factory-boy factories for the app's models (rows as the relay would find them)."""

from __future__ import annotations

import uuid

import factory
from django.utils import timezone

from django_outbox.models import InboxMessage, OutboxMessage


class OutboxMessageFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = OutboxMessage

    event_type = "order.placed"
    destination = "orders"
    payload = factory.Sequence(lambda n: {"order_id": n})
    status = OutboxMessage.Status.PENDING
    # As the check constraints want them: set exactly in their final state.
    published_at = factory.LazyAttribute(
        lambda row: timezone.now() if row.status == OutboxMessage.Status.PUBLISHED else None
    )
    abandoned_at = factory.LazyAttribute(
        lambda row: timezone.now() if row.status == OutboxMessage.Status.ABANDONED else None
    )
    last_error = factory.LazyAttribute(
        lambda row: "RuntimeError: failed" if row.status == OutboxMessage.Status.FAILED else ""
    )

    class Params:
        published = factory.Trait(
            status=OutboxMessage.Status.PUBLISHED,
            published_at=factory.LazyFunction(timezone.now),
        )


class InboxMessageFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = InboxMessage

    consumer = "billing"
    event_id = factory.LazyFunction(uuid.uuid4)
