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

import enum
import functools
import logging
import math
import uuid
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from django.db import models, transaction
from django.db.models import Case, Value, When
from django.db.models.functions import Now

from .. import db
from ..exceptions import InvalidMessage

if TYPE_CHECKING:
    from ..envelope import ReceivedEvent
    from ..models import InboxFailure, InboxSequence

logger = logging.getLogger("django_outbox.inbox")

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
    from ..models import InboxMessage

    event_uuid = as_event_id(event_id)
    with transaction.atomic(using=using):
        yield db.insert_if_absent(using, InboxMessage, consumer=consumer, event_id=event_uuid)


class Turn(enum.Enum):
    """Where an ordered event stands against the last sequence its consumer handled
    of its key (see :func:`process_in_order`)."""

    #: The next one of its key (sequence = last + 1): handle it.
    DUE = "due"
    #: Handled already (sequence <= last): acknowledge it, do nothing.
    DUPLICATE = "duplicate"
    #: An earlier event of its key is not handled yet (sequence > last + 1): hold it back.
    EARLY = "early"
    #: Another event than the one handled claims its sequence (sequence <= last, its event
    #: id not in the inbox), or a handled event claims a later one: a forged or misrouted
    #: message. Park it; never ack it as a duplicate.
    CONFLICT = "conflict"


#: The scope of an ordered event's sequence for one consumer:
#: ``(consumer, destination, ordering_key)``.
Scope = tuple[str, str, str]


#: The longest destination or ordering key an :class:`~django_outbox.models.InboxSequence`
#: stores (as the outbox's own columns and stage()).
MAX_SCOPE_LENGTH = 255


def sequence_scope(consumer: str, event: ReceivedEvent) -> Scope:
    """The scope whose last handled sequence guards ``event`` (which has a sequence);
    :class:`InvalidMessage` when its ``destination`` or ``ordering_key`` header is
    missing or not storable as a key (a NUL, over 255 characters: PostgreSQL's error
    would read as a database outage), or its sequence is not positive."""
    destination, key = event.destination_header, event.ordering_key
    if destination is None or key is None:
        raise InvalidMessage(
            f"event {event.event_id} has a sequence but no destination or ordering_key "
            "header: it was not published by an outbox relay"
        )
    if (event.sequence or 0) < 1:
        raise InvalidMessage(f"event {event.event_id} has sequence {event.sequence}, not 1 or more")
    for name, value in (("destination", destination), ("ordering_key", key)):
        if len(value) > MAX_SCOPE_LENGTH or storable(value) != value:
            raise InvalidMessage(
                f"event {event.event_id}: its {name} header cannot key the inbox's sequences "
                f"(1-{MAX_SCOPE_LENGTH} characters, no NUL or lone surrogate): "
                "it was not published by an outbox relay"
            )
    return consumer, destination, key


def _turn(using: str, consumer: str, event: ReceivedEvent, last: int, start: int) -> Turn:
    """The turn of ``event`` against its key's ``last`` handled and ``start`` sequences.
    At or below ``last``, it is a duplicate only if the inbox has its event id (or its
    sequence is at most ``start``, which counts as handled without inbox rows): a
    sequence number alone is anyone's to write."""
    from ..models import InboxMessage

    sequence = event.sequence
    assert sequence is not None
    if sequence > last:
        return Turn.DUE if sequence == last + 1 else Turn.EARLY
    if sequence <= start:
        return Turn.DUPLICATE
    handled = InboxMessage.objects.using(using).filter(consumer=consumer, event_id=event.event_id)
    return Turn.DUPLICATE if handled.exists() else Turn.CONFLICT


def conflict_reason(consumer: str, event: ReceivedEvent, using: str = "default") -> str:
    """Why ``event``, whose turn was :attr:`Turn.CONFLICT`, is refused: one line."""
    from ..models import InboxMessage

    where = f"sequence {event.sequence} of key {event.ordering_key!r}"
    handled = InboxMessage.objects.using(using).filter(consumer=consumer, event_id=event.event_id)
    if handled.exists():
        return f"sequence conflict: this event was handled already, not at {where}"
    return f"sequence conflict: {where} was handled already as another event"


def _sequences(using: str, scope: Scope) -> models.QuerySet[InboxSequence]:
    from ..models import InboxSequence

    consumer, destination, key = scope
    return InboxSequence.objects.using(using).filter(
        consumer=consumer, destination=destination, ordering_key=key
    )


def peek_turn(consumer: str, event: ReceivedEvent, using: str = "default") -> Turn:
    """The turn of ``event`` as last committed, read without a lock: a DUPLICATE stays
    one (the last sequence only grows); DUE and EARLY are settled by
    :func:`process_in_order`."""
    assert event.sequence is not None
    position = _sequences(using, sequence_scope(consumer, event)).values_list(
        "last_sequence", "start_sequence"
    )
    return _turn(using, consumer, event, *next(iter(position), (0, 0)))


@contextmanager
def process_in_order(consumer: str, event: ReceivedEvent, using: str = "default") -> Iterator[Turn]:
    """Open a transaction holding the lock on ``event``'s key for ``consumer`` and yield
    its :class:`Turn`; do the work inside the block only when it is ``Turn.DUE``.

    The :class:`~django_outbox.models.InboxSequence` row of ``(consumer, destination,
    ordering_key)`` is locked (``SELECT ... FOR UPDATE``; created at 0 first if absent),
    so two deliveries of one key never run at once. When the turn is DUE, the event is
    marked handled first (an event id the inbox has already makes it a CONFLICT); when
    the block then ends without an exception, the key's last sequence is advanced to
    its own, in the same transaction as the mark and the handler's writes.
    """
    from ..models import InboxMessage, InboxSequence

    assert event.sequence is not None
    scope = sequence_scope(consumer, event)
    with transaction.atomic(using=using):
        position = (
            _sequences(using, scope)
            .select_for_update()
            .values_list("last_sequence", "start_sequence")
        )
        found = next(iter(position), None)  # one statement once the key is known
        if found is None:
            db.insert_if_absent(
                using, InboxSequence, consumer=scope[0], destination=scope[1], ordering_key=scope[2]
            )
            found = position.get()
        turn = _turn(using, consumer, event, *found)
        if turn is Turn.DUE and not db.insert_if_absent(
            using, InboxMessage, consumer=consumer, event_id=event.event_id
        ):
            turn = Turn.CONFLICT  # handled already, at another sequence
        yield turn
        if turn is Turn.DUE:
            _sequences(using, scope).update(last_sequence=event.sequence, updated_at=Now())


def start_positions(
    consumer: str, positions: Mapping[tuple[str, str], int], using: str = "default"
) -> int:
    """Start ``consumer`` in the middle of ordered streams: ``positions`` maps
    ``(destination, ordering_key)`` to the last sequence to count as handled, so the
    key's next event handled is that number + 1 and every earlier one is acked as a
    duplicate. For a new consumer name on a stream others consumed before it (it
    would otherwise hold back every key's events for ever, waiting for sequence 1).
    A key only moves forward (a lower number than its last is left alone: going back
    would run handlers again); all keys in one transaction. :class:`ValueError` (one
    line, nothing changed) for a negative number or an empty name. Returns how many
    keys moved."""
    from ..models import InboxSequence

    bad = [f"{d!r} {k!r} at {n!r}" for (d, k), n in positions.items() if not (d and k and n >= 0)]
    if not consumer or bad:
        raise ValueError(
            f"consumer {consumer!r}: a position needs a destination, a key and a sequence "
            f">= 0; not {', '.join(bad) or 'an empty consumer name'}; nothing changed"
        )
    moved = 0
    with transaction.atomic(using=using):
        for (destination, key), last in sorted(positions.items()):
            scope = consumer, destination, key
            db.insert_if_absent(
                using, InboxSequence, consumer=consumer, destination=destination, ordering_key=key
            )
            ahead = _sequences(using, scope).filter(last_sequence__lt=last)
            moved += ahead.update(last_sequence=last, start_sequence=last, updated_at=Now())
    return moved


def positions_of(consumer: str, using: str = "default") -> dict[tuple[str, str], int]:
    """The last sequence ``consumer`` handled of each ordered key it has seen, as
    :func:`start_positions` takes them (to start another consumer where it stands)."""
    from ..models import InboxSequence

    rows = InboxSequence.objects.using(using).filter(consumer=consumer)
    return {
        (d, k): n for d, k, n in rows.values_list("destination", "ordering_key", "last_sequence")
    }


def inbox_handler(
    consumer: str, *, using: str = "default", event_types: Iterable[str] | None = None
) -> Callable[[Callable[..., R]], Callable[..., R | None]]:
    """Decorate a handler ``func(event, *args, **kwargs)`` to run once per event.

    ``event`` is a :class:`~django_outbox.envelope.ReceivedEvent`, or anything
    with an ``event_id`` attribute or key. A duplicate returns None without
    calling ``func``. ``run_outbox_consumer`` recognises a decorated handler and
    takes its consumer name from here.

    ``event_types`` (``["order.placed"]``) are the only event types ``func``
    handles: another event returns None without calling ``func`` and without an
    inbox row, and ``run_outbox_consumer`` acks it and counts it as ignored.
    """
    types = handled_types(event_types)

    def decorate(func: Callable[..., R]) -> Callable[..., R | None]:
        @functools.wraps(func)
        def handle(event: Any, *args: Any, **kwargs: Any) -> R | None:
            event_id = event_id_of(event)
            if types is not None and not handles(consumer, types, event_type_of(event), event_id):
                return None
            call = functools.partial(func, event, *args, **kwargs)
            return run_once(consumer, event_id, using, call)

        handle.inbox_consumer = consumer  # type: ignore[attr-defined]
        handle.inbox_using = using  # type: ignore[attr-defined]
        handle.inbox_event_types = types  # type: ignore[attr-defined]
        return handle

    return decorate


def handled_types(event_types: Iterable[str] | None) -> frozenset[str] | None:
    """``event_types`` as a set, or a TypeError/ValueError saying what is wrong with it
    (raised where the handler is decorated, not at its first event)."""
    if event_types is None:
        return None
    if isinstance(event_types, str):
        raise TypeError(
            f"event_types must be a list of event type names, not one str: "
            f"write event_types=[{event_types!r}]"
        )
    if isinstance(event_types, bytes) or not isinstance(event_types, Iterable):
        raise TypeError(
            f"event_types must be a list of event type names; "
            f"got {type(event_types).__name__} {event_types!r}"
        )
    types = list(event_types)
    if not types:
        raise ValueError("event_types must name at least one event type; got an empty list")
    wrong = [item for item in types if not isinstance(item, str) or not item]
    if wrong:
        raise TypeError(f"event_types must hold non-empty str event type names; got {wrong[0]!r}")
    return frozenset(types)


def handles(
    consumer: str, event_types: Collection[str], event_type: str, event_id: uuid.UUID | str
) -> bool:
    """Whether ``event_type`` is one of ``event_types``; logs the event ignored if not."""
    if event_type in event_types:
        return True
    logger.debug(
        "%s: event %s of type %r ignored (handles only %s)",
        consumer,
        event_id,
        event_type,
        ", ".join(sorted(event_types)),
        extra={
            "action": "inbox.ignored",
            "consumer": consumer,
            "event_id": str(event_id),
            "event_type": event_type,
        },
    )
    return False


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


def event_type_of(event: object) -> str:
    """The event type of a :class:`ReceivedEvent`, an object or a mapping; "" if none."""
    raw = (
        event.get("event_type") if isinstance(event, Mapping) else getattr(event, "event_type", "")
    )
    return str(raw or "")


def record_failure(
    consumer: str,
    event: ReceivedEvent,
    *,
    error: str,
    queue: str = "",
    body: str = "",
    broker_deliveries: int = 0,
    park_after: int | None = None,
    counted: bool = False,
    using: str = "default",
) -> tuple[int, bool]:
    """Count one failed delivery of ``event`` to ``consumer``; park it at ``park_after``.

    Runs in its own transaction (call it after the handler's transaction rolled
    back). The delivery count is the larger of the deliveries recorded here and
    ``broker_deliveries`` (a broker's own count, such as RabbitMQ quorum queues'
    ``x-delivery-count``). ``counted`` says that :func:`record_redelivery`
    already counted this delivery before the handler ran: the error is recorded
    but the delivery is not counted twice. Parking keeps ``body`` and the
    headers in the row. Returns ``(deliveries, parked)``.
    """
    with transaction.atomic(using=using):
        failures = _failure_record(consumer, event, queue, using)
        attempts = models.F("attempts") + (0 if counted else 1)
        failures.update(attempts=attempts, last_error=storable(error), last_failed_at=Now())
        deliveries = max(failures.values_list("attempts", flat=True).get(), broker_deliveries)
        parked = park_after is not None and deliveries >= park_after
        if parked:
            _park(failures, body, event)
    return deliveries, parked


#: The error a failure record gets when its only failed deliveries were never acked.
UNACKED_ERROR = (
    "a delivery was never acknowledged: its consumer stopped, lost the broker "
    "or died (killed, out of memory) while holding it"
)


def record_redelivery(
    consumer: str,
    event: ReceivedEvent,
    *,
    queue: str = "",
    body: str = "",
    broker_deliveries: int = 0,
    park_after: int | None = None,
    using: str = "default",
) -> tuple[int, bool]:
    """Count a delivery the broker marked *redelivered*, before its handler runs.

    An earlier delivery of this message ended without an ack: a handler that
    failed (already counted by :func:`record_failure`), or a consumer that died
    mid-handler (counted by nobody). Counting every redelivered delivery when it
    starts, and not again if it then fails (``record_failure(counted=True)``),
    counts both. When ``park_after`` deliveries were already made, the message
    is parked instead and the handler must not run. Returns
    ``(deliveries, parked)``; ``deliveries`` includes this one unless parked.
    An event already in the inbox (handled, but its ack was lost) is a duplicate,
    not a failed delivery: nothing is counted and ``(0, False)`` returned.
    """
    from ..models import InboxMessage

    if (
        InboxMessage.objects.using(using)
        .filter(consumer=consumer, event_id=event.event_id)
        .exists()
    ):
        return 0, False
    with transaction.atomic(using=using):
        failures = _failure_record(consumer, event, queue, using)
        earlier = max(failures.values_list("attempts", flat=True).get(), broker_deliveries - 1)
        if park_after is not None and earlier >= park_after:
            _park(failures, body, event)
            return earlier, True
        failures.update(
            attempts=models.F("attempts") + 1,
            last_failed_at=Now(),
            last_error=Case(
                When(last_error="", then=Value(UNACKED_ERROR)),
                default=models.F("last_error"),
                output_field=models.TextField(),
            ),
        )
    return earlier + 1, False


def forget_redelivery(consumer: str, event_id: uuid.UUID, using: str = "default") -> None:
    """Drop the record :func:`record_redelivery` made of a delivery that then went
    well, when that is all it holds: one delivery counted, no error. A message that
    comes back once because its consumer stopped holding it is no failure. Call it
    inside the handler's transaction, so it commits with the handler's writes."""
    from ..models import InboxFailure

    InboxFailure.objects.using(using).filter(
        consumer=consumer, event_id=event_id, attempts=1, last_error=UNACKED_ERROR, parked_at=None
    ).delete()


def park_refused(
    consumer: str,
    event: ReceivedEvent,
    *,
    error: str,
    queue: str = "",
    body: str = "",
    using: str = "default",
) -> None:
    """Park ``event`` unrun, at once, with ``error``: a message the consumer will not
    handle (a sequence conflict, a missing or wrong signature) keeps its body and
    headers in :class:`~django_outbox.models.InboxFailure` for an operator to judge,
    as one that failed ``max_deliveries`` times does. Its own transaction.

    Anyone who can publish can put any event id on a message: a refused copy never
    replaces what an event already parked under that id keeps (its body, headers and
    reason; the consumer's log line tells of the copy), and its body is stored up to
    ``OUTBOX["MAX_PAYLOAD_BYTES"]``, the most a relay would have sent."""
    from ..conf import outbox_settings

    with transaction.atomic(using=using):
        failures = _failure_record(consumer, event, queue, using).filter(parked_at=None)
        failures.update(last_error=storable(error), last_failed_at=Now())
        kept = body.encode("utf-8", "replace")[: outbox_settings.MAX_PAYLOAD_BYTES]
        _park(failures, kept.decode("utf-8", "ignore"), event)


def _failure_record(
    consumer: str, event: ReceivedEvent, queue: str, using: str
) -> models.QuerySet[InboxFailure]:
    """The failure record of ``event`` for ``consumer``, created if absent (inside
    the caller's transaction)."""
    from ..models import InboxFailure

    db.insert_if_absent(
        using,
        InboxFailure,
        consumer=consumer,
        event_id=event.event_id,
        queue=queue,
        event_type=storable(event.event_type)[:255],
    )
    return InboxFailure.objects.using(using).filter(consumer=consumer, event_id=event.event_id)


def _park(failures: models.QuerySet[InboxFailure], body: str, event: ReceivedEvent) -> None:
    failures.update(parked_at=Now(), body=storable(body), headers=storable(event.headers))


def unpark(failure: InboxFailure) -> None:
    """Unpark ``failure`` with a fresh count, once its message is on its queue again
    (:func:`django_outbox.consumer.replay.replay_parked`), so ``max_deliveries``
    applies anew; the body stays (retention deletes the record). A record parked again
    meanwhile (a ``parked_at`` of its own) is left parked."""
    type(failure).objects.using(failure._state.db).filter(
        pk=failure.pk, parked_at=failure.parked_at
    ).update(parked_at=None, attempts=0, last_failed_at=Now())


def storable(value: Any) -> Any:
    """``value`` as PostgreSQL can store it in a text or JSON column: NUL characters
    and lone surrogates replaced, non-finite floats and other types (bytes,
    datetimes from AMQP headers) as text. Keeps a foreign message's headers from
    failing the very write that records its failure."""
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8").replace("\x00", "\ufffd")
    if isinstance(value, Mapping):
        return {storable(str(key)): storable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [storable(item) for item in value]
    if (
        value is None
        or isinstance(value, bool | int)
        or (isinstance(value, float) and math.isfinite(value))
    ):
        return value
    return storable(str(value))
