"""What ``outbox_status`` reports (counts per state, backlog age, failing attempts, busy
keys) and the cheaper summary the admin shows above its list."""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db.models import Count, Min
from django.utils import timezone

from .db import RowCount, count_rows
from .models import OutboxMessage, OutboxQuerySet, OutboxStatus

TOP_KEYS = 10


@dataclasses.dataclass(frozen=True)
class StatusReport:
    counts: dict[str, int]  # every state, zero included
    oldest_due_age: dt.timedelta | None  # how long the oldest due row has waited
    failing_attempts: dict[int, int]  # attempts -> FAILED rows
    top_keys: list[tuple[str, int]]  # ordering keys with most rows waiting (pending + failed)


@dataclasses.dataclass(frozen=True)
class Summary:
    counts: dict[str, RowCount]  # every state, zero included; large counts are estimates
    oldest_due_age: dt.timedelta | None  # how long the oldest due row has waited


def oldest_due_age(rows: OutboxQuerySet) -> dt.timedelta | None:
    """How long the oldest due row has waited; one probe of ``outbox_due_idx``."""
    oldest = rows.due().aggregate(oldest=Min("available_at"))["oldest"]
    return None if oldest is None else max(timezone.now() - oldest, dt.timedelta(0))


def summary(using: str = "default") -> Summary:
    """Counts per state and the backlog age, cheap on any table size: each state is
    counted through its partial index, and only up to ``EXACT_COUNT_LIMIT``
    rows, past which the planner's estimate stands in (see ``count_rows``)."""
    rows = OutboxMessage.objects.using(using)
    return Summary(
        counts={status.value: count_rows(rows.filter(status=status)) for status in OutboxStatus},
        oldest_due_age=oldest_due_age(rows),
    )


def report(using: str = "default", *, top: int = TOP_KEYS) -> StatusReport:
    rows = OutboxMessage.objects.using(using)
    counts = {status.value: 0 for status in OutboxStatus}
    counts.update(
        rows.order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n")
    )
    return StatusReport(
        counts=counts,
        oldest_due_age=oldest_due_age(rows),
        failing_attempts=dict(
            rows.failed()
            .order_by("attempts")
            .values_list("attempts")
            .annotate(n=Count("id"))
            .values_list("attempts", "n")
        ),
        top_keys=list(
            rows.filter(status__in=(OutboxStatus.PENDING, OutboxStatus.FAILED))
            .exclude(ordering_key="")
            .order_by()
            .values_list("ordering_key")
            .annotate(n=Count("id"))
            .order_by("-n", "ordering_key")
            .values_list("ordering_key", "n")[:top]
        ),
    )
