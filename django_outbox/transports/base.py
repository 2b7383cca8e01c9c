"""The contract between the relay and a broker.

A transport publishes the claimed messages of one route and reports, for each
message, ``None`` (the broker has it: confirmed where the transport has
confirms) or a :class:`Failure`. It never raises for a message it could not
publish; the relay turns outcomes into state changes. Adding a broker is one
new module with a :class:`Transport` subclass.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..conf import Broker, Problem, outbox_settings
from ..conf.routes import Route
from ..envelope import ClaimedMessage

#: Longest error text kept on a row (``last_error``).
MAX_ERROR_LENGTH = 2000
#: Seconds until a row is due again after its broker failed to take it (an outage):
#: the relay does not publish through a broker that is down before it answers again.
OUTAGE_RETRY_DELAY = 1.0
#: The error of a message the broker nacked (publisher confirms): retried.
NACKED = "the broker refused the message (basic.nack)"


def unroutable(exchange: str, routing_key: str) -> str:
    """The error of a message that no queue would receive, on every transport."""
    return f"unroutable: no queue is bound to exchange {exchange!r} for routing key {routing_key!r}"


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """Why one message was not published.

    ``permanent`` failures (the message can never be published as it is:
    an unencodable header, a payload a Celery task cannot take) abandon the
    row at once; the others are retried with backoff and count an attempt.

    A failure that does not ``count`` was no attempt: nothing was sent (a
    configuration error such as a queue the broker refuses to declare, or a
    batch out of time). The row's attempts are unchanged and it is due again
    in ``retry_delay`` seconds (DESIGN guarantee 8: no attempt without a publish).

    An ``outage`` failure does not count either: the broker could not be reached,
    or took the messages and never confirmed them (a resource alarm, a silent
    network): the relay treats its broker as down, as when a connection fails.
    """

    error: str
    permanent: bool = False
    counts: bool = True
    retry_delay: float = 0.0
    outage: bool = False
    #: A short name for the kind of failure, from a small fixed set (the exception's
    #: class name, or ``nacked``, ``unroutable``, ``no_route``, ``out_of_memory``), for
    #: metrics labels; when empty, :attr:`error_type` tells it from the flags.
    kind: str = dataclasses.field(default="", compare=False)

    @classmethod
    def from_exception(cls, exc: BaseException, *, permanent: bool = False) -> Failure:
        # The driver's text may hold a URL or a password: neither reaches last_error.
        text = outbox_settings.redact(f"{type(exc).__name__}: {exc}")
        return cls(text[:MAX_ERROR_LENGTH], permanent, kind=type(exc).__name__)

    @property
    def error_type(self) -> str:
        """The kind of failure, never the error text (which may differ per row):
        :attr:`kind`, else ``broker_down`` (an outage), ``not_attempted``, ``permanent``
        or ``transient``."""
        if self.kind:
            return self.kind
        if self.outage:
            return "broker_down"
        if not self.counts:
            return "not_attempted"
        return "permanent" if self.permanent else "transient"

    @classmethod
    def not_attempted(cls, error: str, retry_delay: float) -> Failure:
        """Nothing was sent: no attempt counted, due again in ``retry_delay`` seconds."""
        return cls(error[:MAX_ERROR_LENGTH], counts=False, retry_delay=retry_delay)

    @classmethod
    def broker_down(
        cls, error: str, retry_delay: float = OUTAGE_RETRY_DELAY, *, kind: str = ""
    ) -> Failure:
        """The broker did not take the message: unreachable, or it never confirmed (a
        resource alarm, a silent network), out of memory, or known to be down. No attempt
        counted; the relay backs off from the broker and the row is due again in
        ``retry_delay``. ``kind`` names a particular outage (``out_of_memory``)."""
        return cls(
            outbox_settings.redact(error)[:MAX_ERROR_LENGTH],
            counts=False,
            retry_delay=retry_delay,
            outage=True,
            kind=kind,
        )


#: One outcome per message: None when the broker has it.
Outcome = Failure | None


class Transport(abc.ABC):
    """A way to publish. The class attributes say what the broker can do; the shared
    publishing code (:class:`~django_outbox.transports.kombu.KombuTransport`'s, for each
    of its subclasses) reads them, never the transport's type or its URL's scheme. The
    relay knows a transport only by :meth:`publish`, :meth:`check` and :meth:`close`."""

    #: A None outcome means the broker said it has the message (publisher confirms,
    #: or a store that holds it when ``publish`` returns), not only that it was written.
    supports_confirms: bool = False
    #: A batch is written in one go (one round trip); each message counts by the broker's
    #: reply to it, or none of them when the round trip itself failed.
    supports_batch: bool = False
    #: Each message's outcome says whether a queue received it: an unroutable message
    #: fails instead of counting as published.
    reports_unroutable: bool = False

    @abc.abstractmethod
    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        """Publish ``messages`` (all of ``route``) in order; one outcome each. The
        messages are the relay's record of its claim: read them, never change them."""

    def encoder(self, route: Route) -> Callable[[ClaimedMessage], Any] | None:
        """A function giving a message of ``route`` its wire form, as :meth:`publish` reads
        it back with :meth:`encoded`; None (the default) when the transport encodes as it
        publishes. It may raise the encoding's errors: :meth:`publish` meets them."""
        return None

    def prepare(self, route: Route, messages: Sequence[ClaimedMessage]) -> None:
        """Work out the wire form of ``messages`` (all of ``route``) ahead of
        :meth:`publish`: the relay calls it on its claim thread, which then has the
        interpreter while the relay's thread waits for the broker's acknowledgements of
        the batch before. A message whose encoding fails is left to :meth:`publish`,
        which encodes it again and meets the error as if nothing had been prepared (a
        bug's error too: a claim must not fail for it)."""
        try:
            encode = self.encoder(route)
        except Exception:  # said by publish, which asks for it again
            return
        if encode is None:
            return
        for message in messages:
            try:
                message.encoded = (route, self, encode(message))
            except Exception:  # said by publish, which encodes it again
                message.encoded = None

    def encoded(
        self, route: Route, message: ClaimedMessage, encode: Callable[[ClaimedMessage], Any]
    ) -> Any:
        """``message``'s wire form on ``route``: the one :meth:`prepare` left on it for this
        transport and route, else ``encode(message)``'s."""
        found = message.encoded
        if found is not None and found[0] is route and found[1] is self:
            return found[2]
        return encode(message)

    def target(self, route: Route) -> str:
        """Where ``route``'s messages go, as a log line names it: ``queue 'orders'
        (exchange 'outbox')`` on the brokers with exchanges and queues."""
        return f"queue {route.queue!r} (exchange {route.exchange!r})"

    @classmethod
    def problems(cls, broker: Broker) -> list[Problem]:
        """What keeps ``broker`` from working with this transport, found without
        connecting: for the system checks (the URL itself is checked by
        :func:`django_outbox.conf.broker_problem`)."""
        return []

    def recover(self) -> list[str]:
        """Event ids the broker holds whose rows a relay before this one may have left
        unmarked (a Kafka transactional route's record, see docs/kafka.md): the relay
        marks them PUBLISHED before it claims. Each is returned once; none by default."""
        return []

    def settle(self, event_ids: Iterable[str], linger: float = 0.0) -> None:
        """The rows of ``event_ids`` are marked PUBLISHED (``linger``: or will be by a
        relay that has them, within that many seconds). Nothing by default."""
        return None

    @abc.abstractmethod
    def check(self) -> None:
        """Connect if needed; raise the transport's connection error if the broker
        cannot be reached. Called by the relay while it waits out an outage."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop connections; the next call reconnects."""
