"""A claimed outbox row and the wire format it is published in.

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
