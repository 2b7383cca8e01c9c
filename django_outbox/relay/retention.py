"""Deleting rows whose retention has passed: outbox rows in a final state, inbox
marks, and inbox failure records.

Deletes go in bounded batches (each its own short statement), so cleanup never
holds long locks and can run beside relays and consumers. Cut-offs come from the
database clock.

=============  ==========================================  =======================
kind           rows                                         kept for
=============  ==========================================  =======================
``published``  PUBLISHED outbox rows, by ``published_at``  ``PUBLISHED_RETENTION``
``abandoned``  unordered ABANDONED rows, ``abandoned_at``  ``ABANDONED_RETENTION``
``inbox``      inbox marks, by ``processed_at``            ``INBOX_RETENTION``
``failures``   unparked inbox failures, by last failure    ``INBOX_RETENTION``
``parked``     parked inbox failures, by ``parked_at``     ``ABANDONED_RETENTION``
``tasks``      finished Django task results, by            ``TASK_RESULT_RETENTION``
               ``finished_at``
``samples``    the admin chart's samples, by ``taken_at``  a day (``SAMPLE_RETENTION``)
``workers``    heartbeat rows of relays and consumers,     a week
               by their last beat                          (``HEARTBEAT_RETENTION``)
=============  ==========================================  =======================

On a partitioned outbox (``manage.py outbox_partition``), outbox rows are not deleted
one by one but a partition at a time: a pass drops each partition whose rows are all
past their retention, and keeps ``OUTBOX["PARTITIONING"]["ahead"]`` empty partitions
above the ids drawn (:mod:`django_outbox.db.partitions`). Only the default partition's
rows, those staged when no partition was made ahead, are deleted one by one.

An ABANDONED **ordered** row (one with a ``sequence``) is never deleted: it is its
key's head, or becomes it once the events before it are published, and deleting it
would let the key move on past a gap no consumer is told about. It blocks its key
until an operator requeues or skips it (``outbox_requeue``, ``outbox_skip``, the
admin); a skipped row is published as a marker and then expires like any other.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, close_old_connections, connections
from django.db.models import Q, QuerySet

from ..conf import PARTITIONING_DEFAULTS, outbox_settings
from ..conf.redact import SecretFilter
from ..db import partitions
from ..db.expressions import now_minus
from ..models import (
    InboxFailure,
    InboxMessage,
    OutboxMessage,
    OutboxSample,
    TaskResultRecord,
    WorkerHeartbeat,
)
from ..state import store

logger = logging.getLogger("django_outbox.retention")
logger.addFilter(SecretFilter(outbox_settings.redact))  # drivers' texts and tracebacks

DELETE_BATCH = 1000
#: The SQLSTATE of a statement the database role may not run.
INSUFFICIENT_PRIVILEGE = "42501"
#: How long the samples of :mod:`django_outbox.workers.samples` are kept: the chart shows an hour.
SAMPLE_RETENTION = dt.timedelta(days=1)
#: How long the heartbeat row of a process that stopped beating is kept: each process
#: started leaves one (see :mod:`django_outbox.workers.heartbeat`).
HEARTBEAT_RETENTION = dt.timedelta(days=7)


def expired(using: str = "default") -> dict[str, QuerySet[Any]]:
    """The rows retention would delete now, per kind (see the module docstring); on a
    partitioned outbox, the outbox rows of the default partition only."""
    outbox = OutboxMessage.objects.using(using).exclude(_in_ranges(using))
    failures = InboxFailure.objects.using(using)
    return {
        "published": outbox.published().filter(
            published_at__lt=now_minus(outbox_settings.PUBLISHED_RETENTION)
        ),
        "abandoned": outbox.abandoned().filter(
            sequence__isnull=True,  # an ordered row would leave a silent gap: see above
            abandoned_at__lt=now_minus(outbox_settings.ABANDONED_RETENTION),
        ),
        "inbox": InboxMessage.objects.using(using).filter(
            processed_at__lt=now_minus(outbox_settings.INBOX_RETENTION)
        ),
        "failures": failures.failing().filter(
            last_failed_at__lt=now_minus(outbox_settings.INBOX_RETENTION)
        ),
        "parked": failures.parked().filter(
            parked_at__lt=now_minus(outbox_settings.ABANDONED_RETENTION)
        ),
        "tasks": TaskResultRecord.objects.using(using).filter(
            finished_at__lt=now_minus(outbox_settings.TASK_RESULT_RETENTION)
        ),
        "samples": OutboxSample.objects.using(using).filter(
            taken_at__lt=now_minus(SAMPLE_RETENTION)
        ),
        "workers": WorkerHeartbeat.objects.using(using).filter(
            beat_at__lt=now_minus(HEARTBEAT_RETENTION)
        ),
    }


def _in_ranges(using: str) -> Q:
    """The outbox rows of a partitioned outbox's ranges (no row when not partitioned)."""
    spans = partitions.range_spans(connections[using])
    ranges = Q(pk__in=[])
    for lower, upper in spans:
        ranges |= Q(pk__lt=upper) if lower is None else Q(pk__gte=lower, pk__lt=upper)
    return ranges


def cleanup(
    using: str = "default", *, dry_run: bool = False, batch_size: int = DELETE_BATCH
) -> dict[str, int]:
    """Delete (or with ``dry_run`` count) expired rows; returns counts per kind, and on a
    partitioned outbox the partitions dropped (``partitions``)."""
    dropped = _maintain_partitions(using, dry_run)
    if dry_run:
        return {kind: rows.count() for kind, rows in expired(using).items()} | dropped
    counts = {
        kind: store.delete_in_batches(rows, batch_size) for kind, rows in expired(using).items()
    } | dropped
    if any(counts.values()):
        logger.info(
            "retention deleted %s",
            describe(counts),
            extra={"action": "outbox.cleanup", "using": using, **counts},
        )
    return counts


def _maintain_partitions(using: str, dry_run: bool) -> dict[str, int]:
    """On a partitioned outbox: drop the expired partitions (with ``dry_run`` count
    them) and make partitions ahead; ``{"partitions": dropped}``, or ``{}`` when the
    outbox is not partitioned."""
    connection = connections[using]
    if not partitions.is_partitioned(connection):
        return {}
    published, abandoned = outbox_settings.PUBLISHED_RETENTION, outbox_settings.ABANDONED_RETENTION
    if dry_run:
        return {"partitions": len(partitions.droppable(connection, published, abandoned))}
    sizes = outbox_settings.PARTITIONING or PARTITIONING_DEFAULTS
    try:
        made = partitions.ensure_ahead(connection, sizes["rows"], sizes["ahead"])
        dropped = partitions.drop_expired(connection, published, abandoned)
    except DatabaseError as error:
        if getattr(error.__cause__, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
            raise
        logger.warning(  # row retention goes on: it needs no DDL
            "retention could not make or drop partitions (%s): the relay's database role "
            "must own the outbox table and its partitions",
            str(error).strip().splitlines()[0],
            extra={"action": "outbox.partition_failed", "using": using},
        )
        return {"partitions": 0}
    for verb, changed in (("made", made), ("dropped", dropped)):
        for partition in changed:
            logger.info(
                "retention %s partition %s (%s)",
                verb,
                partition.name,
                partition.ids,
                extra={
                    "action": f"outbox.partition_{verb}",
                    "using": using,
                    "partition": partition.name,
                    "lower": partition.lower,
                    "upper": partition.upper,
                },
            )
    return {"partitions": len(dropped)}


def describe(counts: dict[str, int]) -> str:
    """``"3 published, 0 abandoned, ... rows"``, and on a partitioned outbox ``" and 2
    partitions"`` after: one line for logs and commands."""
    rows = ", ".join(f"{count} {kind}" for kind, count in counts.items() if kind != "partitions")
    if "partitions" not in counts:
        return f"{rows} rows"
    dropped = counts["partitions"]
    return f"{rows} rows and {dropped} partition{'' if dropped == 1 else 's'}"


class RetentionThread(threading.Thread):
    """Runs :func:`cleanup` for database ``using`` every ``interval`` seconds (the
    first time after ``first_in`` seconds), on a thread of its own with its own
    database connection, so a long DELETE never holds up the relay's batches.

    A database error is logged (``outbox.cleanup_failed``) and the next pass tries
    again. :meth:`stop` ends the thread after the pass in hand, closes its
    connection, and waits for it.
    """

    def __init__(
        self,
        using: str,
        *,
        interval: float,
        first_in: float = 0.0,
        cleanup: Callable[[str], object] = cleanup,
    ) -> None:
        super().__init__(name=f"outbox-retention-{using}", daemon=True)
        self.using = using
        self.interval = interval
        self.first_in = first_in
        self._cleanup = cleanup
        self._stop_event = threading.Event()

    def run(self) -> None:
        """The thread's body: a pass every ``interval`` seconds until :meth:`stop`."""
        try:
            wait = self.first_in
            while not self._stop_event.wait(wait):
                self._pass()
                wait = self.interval
        finally:
            connections.close_all()  # this thread's connections only

    def stop(self) -> None:
        """End the thread after the pass in hand and wait for it."""
        self._stop_event.set()
        if self.is_alive():
            self.join()

    def _pass(self) -> None:
        close_old_connections()  # honours CONN_MAX_AGE between passes
        try:
            self._cleanup(self.using)
        except DatabaseError:
            logger.warning(
                "retention cleanup failed",
                exc_info=True,
                extra={"action": "outbox.cleanup_failed", "using": self.using},
            )
            connections[self.using].close()  # the next pass opens a fresh one
