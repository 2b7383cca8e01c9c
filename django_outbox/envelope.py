"""The wire format: a claimed outbox row as the relay publishes it, and an event
as a consumer receives it.

Body: the payload as JSON text (``application/json``, utf-8), sent as stored,
never re-encoded. Headers: ``event_id``, ``event_type``, ``occurred_at``
(ISO 8601), ``ordering_key``, ``correlation_id`` (default: the event id),
``causation_id`` (default: None), then the user's headers; an event of an
ordered route also carries ``destination`` and ``sequence`` (its place among its
key's events, 1, 2, 3, ... in commit order), and the marker sent in place of a
skipped event carries ``skipped`` (True) and the body ``null``. The broker's
message id is the event id; delivery is persistent.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import operator
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .exceptions import InvalidMessage
from .signing import SIGNATURE_HEADER, canonical

CONTENT_TYPE = "application/json"
CONTENT_ENCODING = "utf-8"


@dataclasses.dataclass(slots=True)
class ClaimedMessage:
    """What a relay needs of one claimed row: no model instance, no ORM.

    Not frozen, though nothing changes it once claimed (a transport must not either):
    a frozen dataclass sets each field through ``object.__setattr__``, and was built
    in 3.5 µs against 0.47 µs, a tenth of the claim thread's time per row. (With its
    headers a dict, it was never hashable.)"""

    id: int
    event_id: uuid.UUID
    event_type: str
    destination: str
    payload: str  # JSON text, exactly as it goes on the wire
    headers: dict[str, Any]
    ordering_key: str
    attempts: int  # attempts made before this claim
    created_at: dt.datetime
    sequence: int | None = None  # on an ordered route: the key's sequence number
    skipped: bool = False  # an operator skipped it: a marker goes in its place
    #: The ``outbox_signature`` header's value, set once at claim time when the relay
    #: signs (``OUTBOX["SIGNING_KEYS"]``); not a column.
    signature: str | None = dataclasses.field(default=None, init=False)
    #: Its wire form, worked out ahead on the relay's claim thread while the batch before
    #: is published (:meth:`Transport.prepare <django_outbox.transports.base.Transport.prepare>`):
    #: ``(route, transport, form)``, read back only by that transport for that route, and
    #: dropped once it has published; not a column, nor part of its equality or repr.
    encoded: tuple[Any, Any, Any] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    @classmethod
    def reader(
        cls, columns: Sequence[str], **convert: Callable[[Any], Any]
    ) -> Callable[[Sequence[Any]], ClaimedMessage]:
        """A function that builds a message from one claimed row whose columns are
        named ``columns`` (e.g. from ``cursor.description``).

        Each field is read from the column of its name (:data:`CLAIMED_FIELDS`),
        wherever it stands, through ``convert[field]`` when given (the payload
        as JSON text, the headers decoded). A missing column is a ``TypeError``
        naming it, never a value in the wrong field."""
        index = {name: i for i, name in enumerate(columns)}
        missing = [field for field in CLAIMED_FIELDS if field not in index]
        if missing:
            raise TypeError(f"a claimed row has no column {', '.join(missing)}")
        pick = operator.itemgetter(*(index[field] for field in CLAIMED_FIELDS))
        steps = [(CLAIMED_FIELDS.index(field), function) for field, function in convert.items()]

        def build(row: Sequence[Any]) -> ClaimedMessage:
            values = list(pick(row))
            for position, function in steps:
                values[position] = function(values[position])
            return cls(*values)

        return build

    @property
    def wire_payload(self) -> str:
        """The JSON text of the body: the payload, or ``null`` for a skip marker."""
        return SKIPPED_BODY if self.skipped else self.payload

    @property
    def body(self) -> bytes:
        return self.wire_payload.encode(CONTENT_ENCODING)

    def wire_headers(self) -> dict[str, Any]:
        event_id = str(self.event_id)
        headers = {
            "correlation_id": event_id,
            "causation_id": None,
            **self.headers,
            "event_id": event_id,
            "event_type": self.event_type,
            "occurred_at": self.created_at.isoformat(),
            "ordering_key": self.ordering_key or None,
        }
        if self.sequence is not None:
            headers["destination"] = self.destination
            headers["sequence"] = self.sequence
        if self.skipped:
            headers["skipped"] = True
        if self.signature is not None:
            headers[SIGNATURE_HEADER] = self.signature
        return headers

    def envelope(self) -> bytes:
        """What its signature covers: :func:`~django_outbox.signing.canonical` of the
        fields as they go on the wire."""
        ordered = self.sequence is not None
        return canonical(
            self.event_id,
            self.event_type,
            self.ordering_key,
            self.destination if ordered else None,
            self.sequence,
            self.skipped,
            self.body,
        )


#: The body of the marker sent in place of a skipped event.
SKIPPED_BODY = "null"
#: The wire headers of an ordered route's events (and of a skip marker), which no
#: user header may take.
ORDERING_HEADERS = frozenset({"destination", "sequence", "skipped"})


#: Headers a broker sets or acts on: RabbitMQ's dead-lettering (``x-death`` and the
#: ``x-first-death-*``/``x-last-death-*`` prefixes below), a quorum queue's delivery count,
#: the shovel's and federation's marks, and sender-selected distribution (``CC``/``BCC``
#: route copies of the message to more queues). No user header takes them, and a consumer
#: reads none of them but where its broker sets it (see docs/hostile-input.md).
BROKER_HEADERS = frozenset(
    {"x-delivery-count", "x-death", "x-received-from", "x-shovelled", "CC", "BCC"}
)
BROKER_HEADER_PREFIXES = ("x-first-death-", "x-last-death-", "x-shovelled-")
#: The headers the relay writes besides the standard ones, which no user header may take.
RELAY_HEADERS = ORDERING_HEADERS | {SIGNATURE_HEADER}
#: The header that makes every kombu consumer inflate the body before any check.
COMPRESSION_HEADER = "compression"


def is_broker_header(name: str) -> bool:
    """Whether ``name`` is a header a broker sets or acts on (:data:`BROKER_HEADERS`)."""
    return name in BROKER_HEADERS or name.startswith(BROKER_HEADER_PREFIXES)


#: The outbox columns a claim reads, named as :class:`ClaimedMessage`'s fields.
CLAIMED_FIELDS = tuple(field.name for field in dataclasses.fields(ClaimedMessage) if field.init)


class ClaimedBatch(list[ClaimedMessage]):
    """The messages of one claim, in id order, and ``left_behind``: whether the claim
    picked due rows that its row or byte bound then left out. (A full batch may leave
    rows due without saying so: the picking stops at the row bound.) A relay that
    hears NOTIFYs rests after a batch whose claim left nothing behind, on the other
    conditions of docs/relay.md's "The loop"; otherwise it claims again at once.
    ``next_due_in``: seconds from the claim until the first row not due then comes due
    (a scheduled event, a retry), None when there is none or the claim found nothing:
    the rest after the batch ends by then."""

    __slots__ = ("left_behind", "next_due_in")

    def __init__(
        self,
        messages: Iterable[ClaimedMessage] = (),
        *,
        left_behind: bool,
        next_due_in: float | None = None,
    ) -> None:
        super().__init__(messages)
        self.left_behind = left_behind
        self.next_due_in = next_due_in


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivedEvent:
    """One event as a consumer's handler gets it, decoded from the wire format."""

    event_id: uuid.UUID
    event_type: str
    payload: Any  # the decoded JSON body
    headers: dict[str, Any]  # every header on the wire, the standard ones included
    #: A CloudEvent's attributes that no outbox header holds (``id`` as sent, ``source``,
    #: ``specversion``, ``datacontenttype``, other extensions), by their CloudEvents names;
    #: None for an event in the outbox's own envelope (see docs/cloudevents.md). Not
    #: compared: the same event reads equal in either envelope.
    cloudevent: dict[str, Any] | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def from_wire(
        cls,
        payload: Any,
        headers: dict[str, Any] | None,
        message_id: str | None = None,
        *,
        cloudevent: dict[str, Any] | None = None,
    ) -> ReceivedEvent:
        """Build from a decoded body, the message headers and the broker's message id.

        Raises :class:`~django_outbox.exceptions.InvalidMessage` when neither the
        ``event_id`` header nor the message id is a UUID: without one the inbox
        cannot dedupe; or when a ``sequence`` header is there but is not a whole
        number (a string, a boolean): read as no sequence, the event would be handled
        out of its key's turn and its key stalled behind the number it never takes.
        """
        headers = dict(headers or {})
        raw_id = headers.get("event_id") or message_id
        try:
            event_id = uuid.UUID(str(raw_id))
        except ValueError:
            raise InvalidMessage(
                "the message has no event_id header or message id that is a UUID; "
                "it was not published by an outbox relay"
            ) from None
        event = cls(event_id, str(headers.get("event_type") or ""), payload, headers, cloudevent)
        if headers.get("sequence") is not None and event.sequence is None:
            raise InvalidMessage(
                f"event {event_id} has a sequence header {headers['sequence']!r} that is not "
                "a whole number: it was not published by an outbox relay"
            )
        return event

    @property
    def occurred_at(self) -> dt.datetime | None:
        """When the event was staged (the outbox row's ``created_at``)."""
        value = self.headers.get("occurred_at")
        try:
            return dt.datetime.fromisoformat(value) if isinstance(value, str) else None
        except ValueError:
            return None

    @property
    def ordering_key(self) -> str | None:
        """The event's key; None without one, or when the header is not text (a message
        the relay did not write: its signature, if any, then fails)."""
        value = self.headers.get("ordering_key")
        return value if isinstance(value, str) and value else None

    @property
    def sequence(self) -> int | None:
        """The event's place among its key's events on an ordered route; None on others
        (or when the header is not a whole number)."""
        value = self.headers.get("sequence")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def destination_header(self) -> str | None:
        """The destination an ordered route's event was staged to (its ``destination``
        header): with the key, the scope of its sequence."""
        value = self.headers.get("destination")
        return value if isinstance(value, str) and value else None

    @property
    def skipped(self) -> bool:
        """Whether this is the marker of an event an operator skipped (no payload)."""
        return self.headers.get("skipped") is True

    @property
    def correlation_id(self) -> str | None:
        return self.headers.get("correlation_id") or None

    def envelope(self, body: bytes) -> bytes:
        """What a relay's signature of this event covers, with ``body`` as received."""
        return canonical(
            self.event_id,
            self.event_type,
            self.ordering_key,
            self.destination_header,
            self.sequence,
            self.skipped,
            body,
        )

    @property
    def causation_id(self) -> str | None:
        return self.headers.get("causation_id") or None


@dataclasses.dataclass(frozen=True, slots=True)
class OutboxEvent(ReceivedEvent):
    """An event as a consumer's handler receives it, and the destination it was staged
    to: what :mod:`django_outbox.testing` and the memory transport give."""

    destination: str = ""

    @classmethod
    def from_message(cls, message: ClaimedMessage) -> OutboxEvent:
        """The event a relay would put on the wire for ``message``, decoded again."""
        return cls(
            message.event_id,
            message.event_type,
            json.loads(message.wire_payload),
            message.wire_headers(),
            destination=message.destination,
        )
