"""The outbox once a minute: the backlog and the publish rate behind the admin's chart.

:func:`record_sample` writes one :class:`~django_outbox.models.OutboxSample` per minute
and database. Relays call it often (from their heartbeat); whichever gets there first in
a minute takes the sample, and every other call in that minute costs one lookup of the
sample table's primary key. Minutes come from the **database clock**, so relays on hosts
whose clocks disagree still agree on the minute, and the published count compares
``published_at`` (written by the database clock) with bounds from the same clock.

Retention deletes samples older than a day (``SAMPLE_RETENTION`` in
:mod:`django_outbox.relay.retention`); the chart shows the last hour.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db.models.functions import Now, TruncMinute

from ..db import database_now, insert_if_absent
from ..models import OutboxMessage, OutboxSample
from ..state.status import summary

MINUTE = dt.timedelta(minutes=1)


def this_minute() -> TruncMinute:
    """The database clock's current minute (UTC), as an expression."""
    return TruncMinute(Now(), tzinfo=dt.UTC)


def current_minute(using: str) -> dt.datetime:
    """The database clock truncated to the minute."""
    return database_now(using).replace(second=0, microsecond=0)


def record_sample(using: str = "default") -> bool:
    """Take this minute's sample of database ``using`` unless it has one; returns
    whether this call inserted it.

    The backlog is :func:`~django_outbox.state.status.summary`'s counts (exact up to
    ``EXACT_COUNT_LIMIT`` rows per state, PostgreSQL's estimate beyond) and oldest
    due age; the published count is exact, a range of ``outbox_published_idx``.
    Callers racing for the same minute are settled by the primary key (insert-first,
    ``ON CONFLICT DO NOTHING``): one inserts, the others return False.
    """
    samples = OutboxSample.objects.using(using)
    if samples.filter(taken_at=this_minute()).exists():
        return False
    minute = current_minute(using)
    backlog = summary(using, ("pending", "processing", "failed"))
    published = (
        OutboxMessage.objects.using(using)
        .published()
        .filter(published_at__gte=minute - MINUTE, published_at__lt=minute)
        .count()
    )
    age = backlog.oldest_due_age
    return insert_if_absent(
        using,
        OutboxSample,
        taken_at=minute,
        pending=backlog.counts["pending"].value,
        processing=backlog.counts["processing"].value,
        failed=backlog.counts["failed"].value,
        published=published,
        oldest_due_age=None if age is None else age.total_seconds(),
    )


@dataclasses.dataclass(frozen=True)
class Window:
    """The samples of the ``minutes`` up to and including ``end``, oldest first."""

    end: dt.datetime  # the database clock's current minute
    minutes: int
    samples: list[OutboxSample]


def recent(using: str = "default", *, minutes: int = 60) -> Window:
    """The samples of database ``using`` taken in the last ``minutes`` minutes (this
    one included) by the database clock: a range of the primary key."""
    end = current_minute(using)
    start = end - (minutes - 1) * MINUTE
    rows = OutboxSample.objects.using(using).filter(taken_at__gte=start, taken_at__lte=end)
    return Window(end=end, minutes=minutes, samples=list(rows.order_by("taken_at")))
