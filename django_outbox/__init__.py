"""django-transactional-outbox: stage events with the business write, relay them, handle them once.

The public API lives here and imports without a configured Django
(``django.setup()`` is not needed to import it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import apps as _apps  # noqa: F401  (registers E050: imported, not in INSTALLED_APPS)
from .envelope import ReceivedEvent
from .exceptions import (
    BrokerUnreachable,
    CancelRefused,
    EventInFlight,
    InvalidDestination,
    InvalidEvent,
    InvalidMessage,
    NotInTransaction,
    OutboxConfigurationError,
    OutboxError,
    PayloadNotSerializable,
    PayloadTooLarge,
    StagingError,
    UnknownDestination,
)
from .inbox.records import inbox_handler, process_once
from .signals import event_abandoned, event_committed, event_failed, event_published
from .staging.stage import cancel, publish_on_success, stage, stage_many

if TYPE_CHECKING:
    from .celery import InboxTask

__version__ = "0.1.0"

__all__ = [
    "BrokerUnreachable",
    "CancelRefused",
    "EventInFlight",
    "InboxTask",
    "InvalidDestination",
    "InvalidEvent",
    "InvalidMessage",
    "NotInTransaction",
    "OutboxConfigurationError",
    "OutboxError",
    "PayloadNotSerializable",
    "PayloadTooLarge",
    "ReceivedEvent",
    "StagingError",
    "UnknownDestination",
    "__version__",
    "cancel",
    "event_abandoned",
    "event_committed",
    "event_failed",
    "event_published",
    "inbox_handler",
    "process_once",
    "publish_on_success",
    "stage",
    "stage_many",
]


def __getattr__(name: str) -> Any:
    # InboxTask imports Celery, which a project that never consumes tasks need not pay for.
    if name == "InboxTask":
        from .celery import InboxTask

        return InboxTask
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
