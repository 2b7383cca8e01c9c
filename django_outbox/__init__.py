"""django-transactional-outbox: stage events with the business write, relay them, handle them once.

The public API lives here and imports without a configured Django
(``django.setup()`` is not needed to import it).
"""

from __future__ import annotations

from .exceptions import (
    InvalidDestination,
    InvalidEvent,
    NotInTransaction,
    OutboxConfigurationError,
    OutboxError,
    PayloadNotSerializable,
    StagingError,
    UnknownDestination,
)
from .signals import event_abandoned, event_committed, event_failed, event_published
from .staging import publish_on_success, stage, stage_many

__version__ = "0.1.0"

__all__ = [
    "InvalidDestination",
    "InvalidEvent",
    "NotInTransaction",
    "OutboxConfigurationError",
    "OutboxError",
    "PayloadNotSerializable",
    "StagingError",
    "UnknownDestination",
    "__version__",
    "event_abandoned",
    "event_committed",
    "event_failed",
    "event_published",
    "publish_on_success",
    "stage",
    "stage_many",
]
