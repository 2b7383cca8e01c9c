"""The outage record of one relay run: per broker, whether it is down, when it is checked
again and which of its destinations stalled since its last check; per destination, whether
its queue stalled while its broker answered, and when it is tried again.

:class:`Outages` is a value the run owns and hands to each publish: the publish asks it
which destinations not to attempt (:meth:`Outages.blocked`) and tells it what each
destination's publish said of its broker (:meth:`Outages.published`); the loop has it
check the brokers that are down (:meth:`Outages.check`). Each broker and each stalled
queue has an :class:`~django_outbox.outage.OutageTracker`, which logs (as
``django_outbox.outage``) when its outage starts and ends and spaces out the checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from ..conf.routes import Route
from ..transports.base import Failure, Outcome, Transport
from ..transports.redis_wire import refusal_named
from ..workers.outage import OutageTracker, broker_outage, queue_outage


def transport_key(route: Route) -> str:
    """The key of ``route``'s transport: its broker alias, or "celery"."""
    return "celery" if route.is_celery else route.broker


class Outages:
    """What is down during one run of a relay, by transport key (a broker alias, or
    "celery") and by destination. ``describe(key)`` names a transport's broker in the
    errors of the rows not attempted (its URL masked).

    A broker is *suspected* after a transient publish error (it is checked before the
    next batch), and *down* once a destination's publish stalled on it (no confirm, not
    reached) or a check failed: from then on its rows are not attempted, no attempt
    spent, until a check succeeds. A check that succeeds on a broker with confirms (a
    probe was confirmed) blames the destinations that stalled on it since the check
    before on their queue instead (a quorum queue without a majority): each is then
    backed off on its own while the broker's other destinations go on.
    """

    def __init__(self, describe: Callable[[str], str]) -> None:
        self._describe = describe
        #: One tracker per broker, and when each broker that is down is to be checked
        #: again (monotonic clock): a broker with a time is not attempted meanwhile.
        self._brokers: dict[str, OutageTracker] = {}
        self._retry_at: dict[str, float] = {}
        #: By broker, the destinations that stalled since it was last checked.
        self._stalled: dict[str, set[str]] = {}
        #: Destinations whose queue stalled while its broker answered: a tracker each,
        #: and when each is to be tried again.
        self._queues: dict[str, OutageTracker] = {}
        self._queue_retry_at: dict[str, float] = {}

    def tracker(self, key: str) -> OutageTracker:
        """The outage tracker of the broker of transport ``key``."""
        if key not in self._brokers:
            self._brokers[key] = broker_outage(None if key == "celery" else key)
        return self._brokers[key]

    def down(self) -> list[str]:
        """The transport keys whose broker is down or suspected."""
        return [key for key, tracker in self._brokers.items() if tracker.down]

    def due(self, now: float) -> list[str]:
        """The brokers down or suspected that are due for a check at ``now``."""
        return [key for key in self.down() if now >= self._retry_at.get(key, 0.0)]

    def next_check(self) -> float | None:
        """When the next broker that is down is due for a check (monotonic clock)."""
        return min(self._retry_at.values(), default=None)

    def any_up(self, keys: Iterable[str]) -> bool:
        """Whether a broker of ``keys`` (every transport of the relay) is not down."""
        down = self.down()
        return not down or set(keys) > set(down)

    def lasting(self) -> dict[str, int]:
        """What is down now and for how many whole seconds: each broker (``broker
        'alias'``) and each queue not confirming (``queue of destination 'name'``)."""
        # Read by the heartbeat's thread: the dicts are copied first (atomic under the GIL).
        named = [(f"broker {key!r}", tracker) for key, tracker in list(self._brokers.items())]
        named += [(tracker.what, tracker) for tracker in list(self._queues.values())]
        return {
            what: int(lasted) for what, tracker in named if (lasted := tracker.lasted()) is not None
        }

    def stalled_queues(self) -> set[str]:
        """The destinations whose queue stalled (due again or not): published last."""
        return set(self._queue_retry_at)

    def blocked(self, route: Route | None, destination: str, now: float) -> Failure | None:
        """The outcome of the rows of ``destination`` (by ``route``, None when it has
        none) not to be attempted at ``now``: their broker is down, or their queue
        stalled and is not due again; None when they are to be attempted. The failure
        counts no attempt and makes them due when they are tried next."""
        key = None if route is None else transport_key(route)
        if key is not None and key in self._retry_at and self.tracker(key).down:
            refusal = refusal_named(self._brokers[key].condition)
            return Failure.broker_down(
                f"not attempted: {self._describe(key)} is "
                f"{'down' if refusal is None else refusal.condition}",
                retry_delay=max(self._retry_at[key] - now, 1.0),
                kind="" if refusal is None else refusal.kind,
            )
        left = self._queue_retry_at.get(destination, now) - now
        if left > 0:
            return Failure.broker_down(
                f"not attempted: the queue of {destination!r} is not confirming",
                retry_delay=max(left, 1.0),
            )
        return None

    def published(self, route: Route, results: Sequence[Outcome]) -> None:
        """What a publish to ``route`` said of its broker and queue. Messages the broker
        did not take (an outage failure): the broker is down, its other destinations are
        not attempted, and it is checked next; a transient error: it is suspected; a
        message taken by a queue that had stalled: that queue is back."""
        key = transport_key(route)
        failures = [result for result in results if result is not None]
        if any(failure.outage for failure in failures):
            self.tracker(key).suspect()
            self._retry_at.setdefault(key, time.monotonic())  # check it next
            self._stalled.setdefault(key, set()).add(route.destination)
        elif any(failure.counts and not failure.permanent for failure in failures):
            self.tracker(key).suspect()
        if route.destination in self._queues and len(failures) < len(results):
            self._queues.pop(route.destination).recovered()
            self._queue_retry_at.pop(route.destination, None)

    def check(self, key: str, transport: Transport, *, log: bool = True) -> Exception | None:
        """Check the broker of transport ``key`` again; returns the error when it is
        still down (logged as the outage's start, once, unless ``log`` is false: a drain
        gives up instead), and sets when to check next. When it answers (with confirms:
        it confirmed a probe), the destinations that stalled on it since the last check
        had a queue that stalled, not their broker: each is backed off on its own."""
        tracker = self.tracker(key)
        try:
            transport.check()
        except Exception as exc:  # any connect error: still down
            self._stalled.pop(key, None)  # the broker's outage explains their stall
            if log:
                tracker.failed(exc)
            self._retry_at[key] = time.monotonic() + tracker.backoff()
            return exc
        tracker.recovered()
        self._retry_at.pop(key, None)
        stalled = self._stalled.pop(key, set())
        if transport.supports_confirms:  # its check had a probe confirmed
            for destination in sorted(stalled):
                self._queue_stalled(destination)
        return None

    def _queue_stalled(self, destination: str) -> None:
        """The broker of ``destination`` answers, but its queue took messages without
        confirming them: log it once, back off from that destination alone."""
        if destination not in self._queues:
            self._queues[destination] = queue_outage(destination)
        tracker = self._queues[destination]
        tracker.failed(
            ConnectionError("its messages were not confirmed while its broker answered a probe")
        )
        self._queue_retry_at[destination] = time.monotonic() + tracker.backoff()
