"""Effectively-once handling: the inbox.

A relay delivers at least once, so a consumer sees some events twice. The inbox
records ``(consumer, event_id)`` in the same transaction as the handler's
writes: both commit or neither does, and a redelivered event finds its mark and
is skipped. The mark is inserted first (``ON CONFLICT DO NOTHING`` where the
database has it), never checked first, so two concurrent deliveries of one
event cannot both run the handler: on PostgreSQL the second waits on the unique
index until the first transaction ends.

Failed deliveries are counted in :class:`~django_outbox.models.InboxFailure`,
outside the rolled-back handler transaction, so that a consumer can park a
message that keeps failing (see :mod:`django_outbox.consumer`).
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import models, transaction
from django.db.models.functions import Now

from . import db
from .exceptions import InvalidMessage

if TYPE_CHECKING:
    from .envelope import ReceivedEvent

logger = logging.getLogger(__name__)

R = TypeVar("R")


@contextmanager
def process_once(
    consumer: str, event_id: uuid.UUID | str, using: str = "default"
) -> Iterator[bool]:
    """Open a transaction on ``using`` that marks ``event_id`` handled by ``consumer``.

    Yields True when this is the first time (do the work inside the block), False
    when the event was already handled (do nothing)::

        with process_once("billing", event.event_id) as new:
            if new:
                Invoice.objects.create(order_id=event.payload["order_id"])

    An exception inside the block rolls back the mark with the handler's writes,
    so the event counts as not handled and a redelivery runs it again.
    """
    if not isinstance(consumer, str) or not 0 < len(consumer) <= 255:
        raise ValueError(f"an inbox consumer name is 1-255 characters; got {consumer!r}")
    from .models import InboxMessage

    event_uuid = as_event_id(event_id)
    with transaction.atomic(using=using):
        yield db.insert_if_absent(using, InboxMessage, consumer=consumer, event_id=event_uuid)


def inbox_handler(
    consumer: str, *, using: str = "default"
) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Decorate a handler ``func(event, *args, **kwargs)`` to run once per event.

    ``event`` is a :class:`~django_outbox.envelope.ReceivedEvent`, or anything
    with an ``event_id`` attribute or key. A duplicate returns None without
    calling ``func``. ``run_outbox_consumer`` recognises a decorated handler and
    takes its consumer name from here.
    """

    def decorate(func: Callable[..., R]) -> Callable[..., R | None]:
        @functools.wraps(func)
        def handle(event: Any, *args: Any, **kwargs: Any) -> R | None:
            call = functools.partial(func, event, *args, **kwargs)
            return run_once(consumer, event_id_of(event), using, call)

        handle.inbox_consumer = consumer  # type: ignore[attr-defined]
        handle.inbox_using = using  # type: ignore[attr-defined]
        return handle

    return decorate


def run_once(
    consumer: str,
    event_id: uuid.UUID | str,
    using: str,
    call: Callable[[], R],
    *,
    log_level: int = logging.DEBUG,
) -> R | None:
    """``call()`` inside :func:`process_once` if the event is new; else log and return None."""
    with process_once(consumer, event_id, using) as new:
        if new:
            return call()
    logger.log(
        log_level,
        "%s: event %s already handled; skipped",
        consumer,
        event_id,
        extra={"action": "inbox.duplicate", "consumer": consumer, "event_id": str(event_id)},
    )
    return None


def as_event_id(value: object) -> uuid.UUID:
    """``value`` as a UUID, or :class:`InvalidMessage` saying why not."""
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise InvalidMessage(f"an event id must be a UUID; got {value!r}") from None


def event_id_of(event: object) -> uuid.UUID:
    """The event id of a :class:`ReceivedEvent`, an object or a mapping that has one."""
    raw = event.get("event_id") if isinstance(event, Mapping) else getattr(event, "event_id", None)
    if raw is None:
        raise InvalidMessage(
            f"an inbox handler's first argument needs an event_id; got {type(event).__name__}"
        )
    return as_event_id(raw)


def record_failure(
    consumer: str,
    event: ReceivedEvent,
    *,
    error: str,
    queue: str = "",
    body: str = "",
    broker_deliveries: int = 0,
    park_after: int | None = None,
    using: str = "default",
) -> tuple[int, bool]:
    """Count one failed delivery of ``event`` to ``consumer``; park it at ``park_after``.

    Runs in its own transaction (call it after the handler's transaction rolled
    back). The delivery count is the larger of the failures recorded here and
    ``broker_deliveries`` (a broker's own count, such as RabbitMQ quorum queues'
    ``x-delivery-count``). Parking keeps ``body`` and the headers in the row.
    Returns ``(deliveries, parked)``.
    """
    from .models import InboxFailure

    failures = InboxFailure.objects.using(using).filter(consumer=consumer, event_id=event.event_id)
    with transaction.atomic(using=using):
        db.insert_if_absent(
            using,
            InboxFailure,
            consumer=consumer,
            event_id=event.event_id,
            queue=queue,
            event_type=event.event_type,
        )
        failures.update(attempts=models.F("attempts") + 1, last_error=error, last_failed_at=Now())
        deliveries = max(failures.values_list("attempts", flat=True).get(), broker_deliveries)
        parked = park_after is not None and deliveries >= park_after
        if parked:
            failures.update(parked_at=Now(), body=body, headers=event.headers)
    return deliveries, parked
