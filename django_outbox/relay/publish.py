"""A relay's publishing: its transports (one per broker alias, one for the Celery routes,
built on first use), and the publish of a claimed batch by destination, each through its
route's transport, but for the destinations the run's outage record
(:class:`~django_outbox.relay.outages.Outages`) blocks and those whose turn came too late.

Its records come from the logger ``django_outbox.relay``, the name the runbook documents.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import tracing
from ..conf import outbox_settings
from ..conf.redact import mask_url
from ..conf.routes import DEFAULT_BROKER, Route
from ..envelope import ClaimedMessage
from ..exceptions import BrokerUnreachable, OutboxConfigurationError
from ..transports import celery_transport, for_broker, require_celery
from ..transports.base import Failure, Outcome, Transport
from .outages import Outages, transport_key

logger = logging.getLogger("django_outbox.relay")  # the name the runbook documents

#: The destinations this process has published by the default route: each is logged once.
_DEFAULT_ROUTED: set[str] = set()

#: The failure of an event whose headers are no JSON object: a row written around
#: ``stage()`` (raw SQL, ``objects.create``), which no transport nor the tracing can read.
MALFORMED_HEADERS = Failure(
    "the event's headers are not a JSON object (the row was not written by stage())",
    permanent=True,
    kind="malformed_headers",
)


class Publisher:
    """The transports of a relay, and its publish of a batch through them.

    ``transports`` replaces the ones built from the settings (tests,
    :mod:`django_outbox.testing`); the brokers of the others are checked when it is
    made: a malformed URL, a missing driver package, a route naming no broker, Celery
    routes without celery are said now (:class:`OutboxConfigurationError`), not per
    batch. :meth:`close` drops the broker connections.
    """

    def __init__(self, transports: dict[str, Transport] | None = None) -> None:
        #: A transport per broker alias of ``OUTBOX["BROKERS"]`` and one for the Celery
        #: routes ("celery"), built on first use (given ones are used as they are).
        self.transports: dict[str, Transport] = dict(transports or {})
        _refuse_unknown_keys(self.transports)
        self._brokers = {
            alias: outbox_settings.require_broker(alias)
            for alias in sorted(outbox_settings.broker_aliases() | set(outbox_settings.brokers))
            if alias not in self.transports
        }
        #: The broker attributes of the ``send`` spans, per transport key.
        self._broker_spans: dict[str, dict[str, Any]] = {}
        self._celery_routes = sorted(
            name for name, route in outbox_settings.ROUTES.items() if route.is_celery
        )
        if "celery" not in self.transports:
            require_celery(self._celery_routes)
        #: Whether a route is transactional (its transports hear of every marked row).
        self.has_transactional = any(r.transactional for r in outbox_settings.ROUTES.values())

    def transactional(self) -> list[Transport]:
        """The transports of the transactional routes (docs/kafka.md#exactly-once)."""
        found = {
            transport_key(route): self.transport(route)
            for route in outbox_settings.ROUTES.values()
            if route.transactional
        }
        return list(found.values())

    def recover(self) -> list[str]:
        """The event ids the transactional routes' brokers hold whose rows a relay
        before this one may have left unmarked (:meth:`Transport.recover`)."""
        return [event_id for t in self.transactional() for event_id in t.recover()]

    def settle(self, event_ids: list[str], linger: float = 0.0) -> None:
        """Tell the transactional routes' transports that these rows are marked."""
        if not event_ids:
            return
        for transport in self.transactional():
            transport.settle(event_ids, linger)

    def close(self) -> None:
        """Close the broker connections."""
        for transport in self.transports.values():
            transport.close()

    def keys(self) -> set[str]:
        """The keys of every transport the relay may publish through."""
        return {*self.transports, *self._brokers, *(["celery"] if self._celery_routes else [])}

    def transport(self, route: Route) -> Transport:
        """The transport of ``route``: its broker alias's (by the URL's scheme, see
        :mod:`django_outbox.transports`), or Celery's. Raises
        :class:`OutboxConfigurationError` naming the setting when there is none."""
        key = transport_key(route)
        if key not in self.transports:
            if route.is_celery:
                self.transports[key] = celery_transport(self._celery_routes)
            else:
                broker = self._brokers.get(key) or outbox_settings.require_broker(key)
                self.transports[key] = for_broker(broker)
        return self.transports[key]

    def prepare(self, messages: Sequence[ClaimedMessage]) -> None:
        """Work out the wire form of ``messages`` ahead of :meth:`publish`
        (:meth:`Transport.prepare`), for the transports built already: called on the claim
        thread, which must not build one (the relay's thread does, on its first publish)."""
        by_destination: dict[str, list[ClaimedMessage]] = {}
        for message in messages:
            by_destination.setdefault(message.destination, []).append(message)
        for destination, group in by_destination.items():
            if (pair := self._preparing(destination)) is not None:
                pair[1].prepare(pair[0], group)

    def _preparing(self, destination: str) -> tuple[Route, Transport] | None:
        """The route of ``destination`` and its transport, when it is built already; None
        otherwise, or when the route cannot be told (the publish says why)."""
        try:
            route = outbox_settings.route_for(destination)
            transport = route and self.transports.get(transport_key(route))
        except Exception:  # said by the publish, which asks again; a claim must not fail
            return None
        return (route, transport) if route and transport else None

    def publish(
        self,
        messages: Sequence[ClaimedMessage],
        *,
        deadline: float,
        lease_seconds: float,
        outages: Outages,
    ) -> tuple[list[Outcome], frozenset[str]]:
        """Publish by destination; returns the outcomes and the destinations tried.
        Destinations whose turn comes after ``deadline`` (half the lease) are not
        attempted (they fail, to be retried), so that no other relay can take over rows
        this one is still publishing; nor are those ``outages`` blocks, which learns
        what each publish said of its broker."""
        outcomes: dict[int, Outcome] = {}
        tried: set[str] = set()
        # A destination back from a stall goes last: its confirm timeout, if it stalls
        # again, then delays no other destination of the batch. (The plain order when
        # none stalled: this sort runs for every message of every batch.)
        stalls = outages.stalled_queues()
        order = (lambda m: (m.destination in stalls, _publish_order(m))) if stalls else None
        by_destination = itertools.groupby(
            sorted(messages, key=order or _publish_order), key=lambda m: m.destination
        )
        for destination, group in by_destination:
            batch = list(group)
            route = outbox_settings.route_for(destination)
            now = time.monotonic()
            if now > deadline:
                results: list[Outcome] = [_late(lease_seconds)] * len(batch)
            elif (blocked := outages.blocked(route, destination, now)) is not None:
                results = [blocked] * len(batch)
            elif route is None:
                results = [_no_route(destination)] * len(batch)
            else:
                results = self._publish_route(route, batch, outages)
                tried.add(destination)
            outcomes.update(zip((m.id for m in batch), results, strict=True))
        for message in messages:  # its wire form, if prepared, goes no further than the publish
            message.encoded = None
        return [outcomes[m.id] for m in messages], frozenset(tried)

    def _publish_route(
        self, route: Route, batch: list[ClaimedMessage], outages: Outages
    ) -> list[Outcome]:
        """Publish ``batch`` through ``route``'s transport, and tell ``outages`` how it
        went (when the broker did not take them, the batch's later destinations on that
        broker are not attempted: each would wait its confirm timeout in turn)."""
        if not all(type(message.headers) is dict for message in batch):
            publish = functools.partial(self._publish_route, route, outages=outages)
            return _refusing_malformed(batch, publish)
        # No broker for the route raises OutboxConfigurationError: the relay
        # cannot run as configured.
        transport = self.transport(route)
        _note_default_route(route, transport)
        with tracing.sending(route.destination, self._span_attributes(route), batch) as span:
            try:
                results = transport.publish(route, batch)
            except Exception as exc:  # a bug or an error no transport classified
                logger.exception(
                    "publishing to %r failed unexpectedly",
                    route.destination,
                    extra={"action": "outbox.publish_error", "destination": route.destination},
                )
                results = [Failure.from_exception(exc)] * len(batch)
                span.failed(type(exc).__name__, "the transport raised")
            else:
                _trace_failures(span, results)
        outages.published(route, results)
        return results

    def _span_attributes(self, route: Route) -> dict[str, Any]:
        """The broker's attributes of the ``send`` spans of ``route`` (see
        :func:`django_outbox.tracing.broker_attributes`), worked out once per broker."""
        key = transport_key(route)
        if key not in self._broker_spans:
            # A transport given to the relay may have no broker in the settings at all
            # (django_outbox.testing's memory transport): it is no reason to fail.
            broker = self._brokers.get(key) or outbox_settings.brokers.get(key)
            self._broker_spans[key] = (
                {"messaging.system": "celery"}
                if route.is_celery
                else tracing.broker_attributes(broker.url)
                if broker is not None
                else {"messaging.system": "memory"}
            )
        return self._broker_spans[key]

    def unreachable(self, key: str, exc: Exception) -> str:
        """Why the broker of transport ``key`` (a broker alias, or "celery") cannot be
        reached, with its URL masked; a broker of ``OUTBOX["BROKERS"]`` by its alias."""
        if isinstance(exc, BrokerUnreachable) and isinstance(exc.__cause__, Exception):
            exc = exc.__cause__  # the transport's check named the broker: said below
        return f"{self.describe(key)} is unreachable ({Failure.from_exception(exc).error})"

    def describe(self, key: str) -> str:
        """The broker of transport ``key``, as errors name it (its URL masked)."""
        known = self._brokers.get(key)
        if key == "celery":
            broker = "Celery's broker"
        elif known is None:
            broker = "the broker" if key == DEFAULT_BROKER else f"the broker {key!r}"
        elif known.named:
            broker = f"the broker {key!r} ({mask_url(known.url)})"
        else:
            broker = f"the broker {mask_url(known.url)}"
        return broker


def _late(lease_seconds: float) -> Failure:
    return Failure.not_attempted(
        "not attempted: the batch used half its lease "
        f"(LEASE_SECONDS={lease_seconds:g}) before this destination's turn",
        retry_delay=0.0,
    )


def _no_route(destination: str) -> Failure:
    return Failure(
        f"destination {destination!r} has no route: it is not in OUTBOX['ROUTES'] "
        "and OUTBOX['DEFAULT_ROUTE'] is False",
        permanent=True,
        kind="no_route",
    )


def _note_default_route(route: Route, transport: Transport) -> None:
    """Log, once per process, the first publish of a destination ``ROUTES`` does not
    name. The default route declares a queue of that name (a topic, a subject), so a
    typo (``"order"`` for ``"orders"``) would otherwise fill one nobody reads without a
    word."""
    name = route.destination
    if name in _DEFAULT_ROUTED or route.is_celery or name in outbox_settings.ROUTES:
        return
    _DEFAULT_ROUTED.add(name)
    logger.warning(
        "destination %r is not in OUTBOX['ROUTES']: the default route publishes it to %s; "
        "if that is a typo, no consumer reads it. Name your destinations in ROUTES and set "
        "OUTBOX['DEFAULT_ROUTE'] = False to refuse unknown ones at stage time",
        name,
        transport.target(route),
        extra={"action": "outbox.default_route", "destination": name},
    )


def _publish_order(message: ClaimedMessage) -> tuple[str, bool, str, int]:
    """The order a batch is published in: by destination, unordered rows by id, then
    each key's ordered rows in sequence order (the order they must reach the broker)."""
    if message.sequence is None:
        return (message.destination, False, "", message.id)
    return (message.destination, True, message.ordering_key, message.sequence)


def _refusing_malformed(
    batch: list[ClaimedMessage], publish: Callable[[list[ClaimedMessage]], list[Outcome]]
) -> list[Outcome]:
    """Fail the messages of ``batch`` whose headers are not a dict for good (they would
    fail every attempt, or stop the relay in the tracing), and ``publish`` the others."""
    readable = [message for message in batch if type(message.headers) is dict]
    published = iter(publish(readable) if readable else [])
    return [
        next(published) if type(message.headers) is dict else MALFORMED_HEADERS for message in batch
    ]


def _trace_failures(span: tracing.SendSpan, results: Sequence[Outcome]) -> None:
    """Mark ``span`` failed when some of its messages were not published: ``error.type``
    is the first failure's :attr:`~Failure.error_type`, the value the metrics label it by."""
    failures = [result for result in results if result is not None]
    if failures:
        span.failed(failures[0].error_type, f"{len(failures)} of {len(results)} not published")


def _refuse_unknown_keys(transports: dict[str, Transport]) -> None:
    """Refuse given transports under a key that is neither a broker alias (of
    ``OUTBOX["BROKERS"]`` or named by a route) nor ``"celery"``: the relay would
    never use them and would publish through a broker built from the settings."""
    known = {"celery", *outbox_settings.broker_aliases(), *outbox_settings.brokers}
    if unknown := sorted(set(transports) - known):
        raise OutboxConfigurationError(
            f"Relay(transports=...) has no broker {', '.join(map(repr, unknown))}: its keys "
            f"are broker aliases ({', '.join(sorted(known - {'celery'}))}) or 'celery'"
        )
