"""Every error this app raises derives from :class:`OutboxError`.

Each one also subclasses the builtin (or Django) exception a caller would
naturally catch, so ``except TypeError`` around a bad payload works without
importing this module. Messages name the setting or call that fixes the
problem and never contain payloads or credentials.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured
from django.db.transaction import TransactionManagementError


class OutboxError(Exception):
    """Root of every error raised by django_outbox."""


class OutboxConfigurationError(OutboxError, ImproperlyConfigured):
    """``settings.OUTBOX`` holds a value the app cannot use."""


class StagingError(OutboxError):
    """An event could not be staged; nothing was written."""


class NotInTransaction(StagingError, TransactionManagementError):
    """``stage()`` was called in autocommit mode, outside ``transaction.atomic()``."""


class PayloadNotSerializable(StagingError, TypeError):
    """The payload or headers cannot be encoded as JSON, or hold text PostgreSQL
    cannot store (a NUL character, a lone surrogate)."""


class PayloadTooLarge(StagingError, ValueError):
    """The encoded payload or headers exceed ``OUTBOX["MAX_PAYLOAD_BYTES"]``."""


class InvalidEvent(StagingError, ValueError):
    """An argument of ``stage()`` is malformed: event type, key, headers, time."""


class InvalidDestination(InvalidEvent):
    """The destination is empty or malformed."""


class UnknownDestination(InvalidDestination):
    """The destination is not in ``OUTBOX["ROUTES"]`` and the default route is off."""


class InvalidMessage(OutboxError, ValueError):
    """A consumed message is not an outbox event: undecodable body, or no valid event id."""


class BrokerUnreachable(OutboxError, ConnectionError):
    """A consumer given an idle timeout spent that long without reaching its broker,
    counted since its last message (or its start), and gave up."""


class BrokerRefusesWrites(OutboxError, ConnectionError):
    """The broker takes connections but refuses every write for now: a Redis out of
    memory, read-only (a replica after a failover) or unable to persist (``MISCONF``).
    An outage, as RabbitMQ's memory alarm is, never the messages' fault; ``condition``
    says which ("out of memory", "read-only", "unable to persist")."""

    def __init__(self, message: str, condition: str = "out of memory") -> None:
        super().__init__(message)
        self.condition = condition


class BrokerOutOfMemory(BrokerRefusesWrites):
    """The broker refuses every write for want of memory (Redis at its ``maxmemory``
    with nothing it may evict)."""


class RequeueRefused(OutboxError, ValueError):
    """A requeue named a row that does not exist or is not FAILED/ABANDONED;
    nothing was requeued."""


class SkipRefused(RequeueRefused):
    """A skip (or a head-only requeue) named a row that is not its key's blocked head:
    not found, not ordered, not the head, or not FAILED/ABANDONED; nothing changed.
    The message names each refused row and why."""


class CancelRefused(OutboxError, ValueError):
    """``cancel()`` named an event it may not remove (one of an ordered route, whose
    key's sequence would keep a gap); nothing was removed."""


class EventInFlight(CancelRefused):
    """``cancel()`` named an event a relay has claimed (PROCESSING): it may be on the
    broker already, so it is not cancelled."""
