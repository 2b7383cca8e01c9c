"""The relay: claim due rows, publish them, record the outcome.

One :class:`Relay` serves one database alias. :meth:`Relay.run_once` handles
one batch; :meth:`Relay.run` loops until its stop event is set, waking on
PostgreSQL NOTIFY (or every ``POLL_INTERVAL``: :class:`~django_outbox.wakeup.WakeUp`),
riding out broker and database outages with backoff (an
:class:`~django_outbox.outage.OutageTracker` each), while a
:class:`~django_outbox.retention.RetentionThread` cleans up on a thread of its own.
No argparse, no printing, no exits: ``run_outbox_relay`` is a thin command over
this class.

Each batch is three short steps: claim (one statement on PostgreSQL), publish
outside any transaction, and finalize, where every write is filtered by the
batch's lease token, so a relay whose lease was taken over changes nothing.
In :meth:`Relay.run` the database steps of neighbouring batches run on a claim thread
and a finalize thread (:class:`~django_outbox.pipeline.Pipeline`) while the relay's
thread publishes; a batch that caught up with what was due, after which the relay
waits for a NOTIFY, is finalized on the relay's thread.

The relay keeps its settings and its broker connections, no run state: each run (and
each ``run_once()``) has its own, in modules of one job each:

- :mod:`~django_outbox.relay.run`: the loop of a run (:class:`~django_outbox.relay.run.Run`),
- :mod:`~django_outbox.relay.batch`: one batch's claim, publish, finalize and report,
- :mod:`~django_outbox.relay.publish`: the transports and the publish by destination,
- :mod:`~django_outbox.relay.outages`: the run's outage record (per broker, per queue),
- :mod:`~django_outbox.relay.report`: a batch's stats, log records and signals.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from django.db import DatabaseError

from ..conf import outbox_settings
from ..conf.routes import Route
from ..state import store
from ..state.retry import RetryPolicy
from ..transports.base import Transport
from ..workers.heartbeat import process_name
from .batch import Batch, Batches
from .outages import Outages
from .publish import Publisher
from .report import MAX_LOGGED_REASONS, BatchStats, RunStats
from .run import SWITCH_INTERVAL, Run, quick_switches

logger = logging.getLogger("django_outbox.relay")  # the name the runbook documents

__all__ = [
    "MAX_LOGGED_REASONS",
    "SWITCH_INTERVAL",
    "Batch",
    "BatchStats",
    "Relay",
    "RunStats",
]


class Relay:
    """Claims due outbox rows of the database ``using``, publishes them through its
    transports, and records each row's outcome; ``manage.py run_outbox_relay`` runs one.

    ``batch_size`` and ``worker`` (the name written into claimed rows) default to
    ``OUTBOX["BATCH_SIZE"]`` and ``host:pid``; ``transports`` replaces the ones built from
    the settings (tests, :mod:`django_outbox.testing`). Use it as a context manager, or
    call :meth:`close`, to drop its broker connections.
    """

    def __init__(
        self,
        using: str = "default",
        *,
        batch_size: int | None = None,
        worker: str | None = None,
        transports: dict[str, Transport] | None = None,
    ) -> None:
        self.using = using
        self.batch_size = batch_size or outbox_settings.BATCH_SIZE
        self.worker = worker or process_name()
        self.policy = RetryPolicy.from_settings()
        self.lease_seconds = outbox_settings.LEASE_SECONDS
        #: Its transports, built on first use; their brokers are checked here: a
        #: malformed URL, a missing driver package, a route naming no broker, Celery
        #: routes without celery are said now (OutboxConfigurationError), not per batch.
        self.publisher = Publisher(transports)
        #: Whether these settings order a route. If not, the relay claims with the
        #: statement for unordered rows between whole claims (see :class:`Batches`).
        self.orders = outbox_settings.DEFAULT_ORDERED or any(
            route.ordered for route in outbox_settings.ROUTES.values()
        )

    def close(self) -> None:
        """Close the broker connections (``run()`` does it when it returns)."""
        self.publisher.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def transport(self, route: Route) -> Transport:
        """The transport of ``route``: its broker alias's (by the URL's scheme, see
        :mod:`django_outbox.transports`), or Celery's. Raises
        :class:`~django_outbox.exceptions.OutboxConfigurationError` naming the setting
        when there is none."""
        return self.publisher.transport(route)

    def batches(self) -> Batches:
        """A run's batches, with this relay's settings and transports: a fresh claim
        schedule (its first claim is whole)."""
        self.recover()
        settings = (self.using, self.batch_size, self.worker, self.policy, self.lease_seconds)
        return Batches(*settings, publisher=self.publisher, orders=self.orders)

    def recover(self) -> int:
        """Mark PUBLISHED the rows whose events a relay before this one committed in a
        Kafka transaction but did not mark (its transactional id's record says which:
        docs/kafka.md#exactly-once); returns how many. Nothing without such a route."""
        if not self.publisher.has_transactional:
            return 0
        event_ids = self.publisher.recover()
        if not event_ids:
            return 0
        try:
            count = store.mark_in_log(self.using, event_ids)
        except DatabaseError:  # they stay in the record: reclaimed, they are not sent again
            logger.warning("marking the rows the Kafka log holds failed", exc_info=True)
            return 0
        self.publisher.settle(event_ids, linger=self.lease_seconds)
        logger.info(
            "%d rows a relay before this one committed to Kafka were marked PUBLISHED",
            count,
            extra={"action": "outbox.kafka_recovered", "rows": count},
        )
        return count

    def outages(self) -> Outages:
        """A fresh outage record: every broker and queue taken to be up."""
        return Outages(self.publisher.describe)

    def run_once(self) -> BatchStats:
        """Claim, publish and finalize one batch; returns what happened. A broker that
        stalled in an earlier call is tried again (only :meth:`run` backs off from it)."""
        batches = self.batches()
        claim = batches.claim(whole=True)
        if claim is None:
            return BatchStats()
        return batches.report(batches.finalize(batches.publish(claim, self.outages())))

    def run(
        self,
        stop: threading.Event,
        *,
        drain: bool = False,
        on_batch: Callable[[BatchStats], None] | None = None,
    ) -> RunStats:
        """Relay until ``stop`` is set (or, with ``drain``, until nothing is due, or
        the broker cannot be reached: a drain gives up rather than wait for it).

        Each turn publishes a batch; with nothing due, the relay waits for the first
        of a wake-up, the poll interval, or ``stop``. Returns the totals. A batch in
        progress when ``stop`` is set is finished first, so its rows are not left
        PROCESSING.
        """
        with quick_switches(), Run(self.batches(), stop, drain=drain, on_batch=on_batch) as run:
            return run.loop()
