"""The wire format: a claimed outbox row as the relay publishes it, and an event
as a consumer receives it.

Body: the payload as JSON text (``application/json``, utf-8), sent as stored,
never re-encoded. Headers: ``event_id``, ``event_type``, ``occurred_at``
(ISO 8601), ``ordering_key``, ``correlation_id`` (default: the event id),
``causation_id`` (default: None), then the user's headers. The broker's
message id is the event id; delivery is persistent.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from .exceptions import InvalidMessage

#: The outbox columns a claim reads, in :class:`ClaimedMessage` order.
CLAIMED_FIELDS = (
    "id",
    "event_id",
    "event_type",
    "destination",
    "payload",
    "headers",
    "ordering_key",
    "attempts",
    "created_at",
)
CONTENT_TYPE = "application/json"
CONTENT_ENCODING = "utf-8"


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimedMessage:
    """What a relay needs of one claimed row: no model instance, no ORM."""

    id: int
    event_id: uuid.UUID
    event_type: str
    destination: str
    payload: str  # JSON text, exactly as it goes on the wire
    headers: dict[str, Any]
    ordering_key: str
    attempts: int  # attempts made before this claim
    created_at: dt.datetime

    @classmethod
    def from_columns(
        cls, columns: Sequence[Any], *, payload: str, headers: dict[str, Any]
    ) -> ClaimedMessage:
        """Build from a row of :data:`CLAIMED_FIELDS`, with the payload as JSON text."""
        pk, event_id, event_type, destination, _, _, key, attempts, created_at = columns
        return cls(
            pk, event_id, event_type, destination, payload, headers, key, attempts, created_at
        )

    @property
    def body(self) -> bytes:
        return self.payload.encode(CONTENT_ENCODING)

    def wire_headers(self) -> dict[str, Any]:
        event_id = str(self.event_id)
        return {
            "correlation_id": event_id,
            "causation_id": None,
            **self.headers,
            "event_id": event_id,
            "event_type": self.event_type,
            "occurred_at": self.created_at.isoformat(),
            "ordering_key": self.ordering_key or None,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class ReceivedEvent:
    """One event as a consumer's handler gets it, decoded from the wire format."""

    event_id: uuid.UUID
    event_type: str
    payload: Any  # the decoded JSON body
    headers: dict[str, Any]  # every header on the wire, the standard ones included

    @classmethod
    def from_wire(
        cls, payload: Any, headers: dict[str, Any] | None, message_id: str | None = None
    ) -> ReceivedEvent:
        """Build from a decoded body, the message headers and the broker's message id.

        Raises :class:`~django_outbox.exceptions.InvalidMessage` when neither the
        ``event_id`` header nor the message id is a UUID: without one the inbox
        cannot dedupe.
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
        return cls(event_id, str(headers.get("event_type") or ""), payload, headers)

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
        return self.headers.get("ordering_key") or None

    @property
    def correlation_id(self) -> str | None:
        return self.headers.get("correlation_id") or None

    @property
    def causation_id(self) -> str | None:
        return self.headers.get("causation_id") or None
