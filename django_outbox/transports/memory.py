"""The in-memory transport (``memory://``): messages kept in this process, per broker
alias and queue, for tests and for trying the outbox without a broker.

Each message the relay publishes through it is kept, in publish order, and
:func:`sent` reads them back as :class:`~django_outbox.envelope.OutboxEvent` objects
(the payload decoded and every wire header, as a consumer's handler gets them)::

    OUTBOX = {"BROKERS": {"default": {"URL": "memory://"}}}
    ...
    from django_outbox.transports import memory
    assert [e.event_type for e in memory.sent("default", queue="orders")] == ["order.placed"]
    memory.clear()

With a ``memory://`` URL the messages also go through kombu's in-process memory
broker, so a kombu consumer (``run_outbox_consumer``) in the same process reads them
as from any broker, and a message that no queue would receive fails as unroutable,
as on RabbitMQ or Redis. Without a URL (:func:`django_outbox.testing.drain` builds it
so) every message is kept, Celery routes' too, and none goes anywhere else.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..conf.routes import DEFAULT_BROKER, Route
from ..envelope import ClaimedMessage, OutboxEvent
from .base import Outcome, Transport
from .kombu import KombuTransport

#: alias -> [(queue, event)] in publish order, for every transport of this process.
_STORES: collections.defaultdict[str, list[tuple[str | None, OutboxEvent]]] = (
    collections.defaultdict(list)
)
_LOCK = threading.Lock()


def sent(alias: str = DEFAULT_BROKER, *, queue: str | None = None) -> list[OutboxEvent]:
    """The events published to the memory broker ``alias`` in this process, in publish
    order; with ``queue``, only those kept under that queue (a route's ``queue``; a
    route that declares none, or a Celery route, keeps its events under its
    destination)."""
    with _LOCK:
        kept = list(_STORES.get(alias, ()))
    return [event for name, event in kept if queue is None or name == queue]


def clear(alias: str | None = None) -> None:
    """Forget the events of the memory broker ``alias`` (of every one, by default)."""
    with _LOCK:  # emptied in place: the transports built before keep their list
        for name, kept in _STORES.items():
            if alias is None or name == alias:
                kept.clear()


class MemoryTransport(Transport):
    """Keeps what it publishes in this process (see :func:`sent`). A message is the
    store's when ``publish`` returns: that is its confirm."""

    supports_confirms = True
    reports_unroutable = True  # with a URL, kombu's lookup; without, nothing is unroutable

    def __init__(
        self,
        url: str | None = None,
        transport_options: Mapping[str, Any] | None = None,
        *,
        alias: str | None = None,
        store: list[tuple[str | None, OutboxEvent]] | None = None,
    ) -> None:
        self.alias = alias or DEFAULT_BROKER
        #: Where the events go: the process-wide list of ``alias``, unless given one.
        self.store = _STORES[self.alias] if store is None else store
        self._kombu = KombuTransport(url, transport_options) if url else None

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        """Keep each message in :attr:`store` (through kombu's memory broker first,
        when built with a URL: a message it refuses is not kept)."""
        if self._kombu is not None and not route.is_celery:
            outcomes = self._kombu.publish(route, messages)
        else:
            outcomes = [None] * len(messages)
        queue = route.queue or route.destination
        kept = [
            (queue, OutboxEvent.from_message(message))
            for message, outcome in zip(messages, outcomes, strict=True)
            if outcome is None
        ]
        with _LOCK:
            self.store += kept
        return outcomes

    def check(self) -> None:
        """Always reachable (kombu's memory broker is this process)."""
        if self._kombu is not None:
            self._kombu.check()

    def close(self) -> None:
        """Close kombu's connection, if any; what was kept stays kept."""
        if self._kombu is not None:
            self._kombu.close()
