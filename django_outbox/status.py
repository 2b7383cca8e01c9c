"""What ``outbox_status`` reports: counts per state, backlog age, failing attempts, busy keys."""

from __future__ import annotations

import dataclasses
import datetime as dt

from django.db.models import Count, Min
from django.utils import timezone

from .models import OutboxMessage, OutboxStatus

TOP_KEYS = 10


@dataclasses.dataclass(frozen=True)
class StatusReport:
    counts: dict[str, int]  # every state, zero included
    oldest_due_age: dt.timedelta | None  # how long the oldest due row has waited
    failing_attempts: dict[int, int]  # attempts -> FAILED rows
    top_keys: list[tuple[str, int]]  # ordering keys with most rows waiting (pending + failed)


def report(using: str = "default", *, top: int = TOP_KEYS) -> StatusReport:
    rows = OutboxMessage.objects.using(using)
    counts = {status.value: 0 for status in OutboxStatus}
    counts.update(
        rows.order_by().values_list("status").annotate(n=Count("id")).values_list("status", "n")
    )
    oldest = rows.due().aggregate(oldest=Min("available_at"))["oldest"]
    return StatusReport(
        counts=counts,
        oldest_due_age=None if oldest is None else max(timezone.now() - oldest, dt.timedelta(0)),
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
