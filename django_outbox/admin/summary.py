"""What the outbox changelist shows above its rows: a count of every state and the
oldest due row's age, the blocked ordered keys, and the last hour's backlog and
publish rate as charts. Each is computed only when the page renders, not for an
action's POST that redirects."""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from django.utils.functional import SimpleLazyObject
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.timesince import timesince
from django.utils.translation import gettext

from ..conf import outbox_settings
from ..models import OutboxStatus
from ..ops.charts import BarChart, Layer, render
from ..state.status import blocked_keys, summary
from ..workers import samples

#: Badge colours per state: white text on these stays readable in light and dark themes.
STATUS_COLOURS = {
    OutboxStatus.PENDING: "#5b6770",
    OutboxStatus.PROCESSING: "#1f6fb2",
    OutboxStatus.PUBLISHED: "#2e7d32",
    OutboxStatus.FAILED: "#c25e00",
    OutboxStatus.ABANDONED: "#b3261e",
}


def changelist_context(using: str, can_act: bool) -> dict[str, Any]:
    """The template's figures above the list (change_list.html), each read when the
    template first uses it; ``can_act``: whether to offer the head buttons."""
    return {
        "outbox_summary": SimpleLazyObject(lambda: summary_context(using)),
        "outbox_blocked": SimpleLazyObject(lambda: blocked_context(using, can_act)),
        "outbox_charts": SimpleLazyObject(lambda: charts(using)),
    }


def summary_context(using: str) -> dict[str, Any]:
    """Each state with its label and count, and how long the oldest due row waited."""
    report = summary(using)
    age = report.oldest_due_age
    return {
        "states": [
            (status.value, status.label, report.counts[status.value]) for status in OutboxStatus
        ],
        "oldest_due": None if age is None else timesince(timezone.now() - age, depth=2),
        "scheduled": report.scheduled,  # PENDING, not due yet: not in its count above
    }


def charts(using: str) -> list[SafeString]:
    """The last hour's backlog and publish rate as two SVG charts, from the samples
    relays take once a minute (:mod:`django_outbox.workers.samples`); none without
    samples. A sample counts what was published in the minute *before* it, so the
    rate's bars stand at that minute and its chart ends with the last whole minute.
    With ``PUBLISHED_RETENTION`` 0 no published row is kept to count: a note says so
    in place of the rate."""
    window = samples.recent(using)
    if not window.samples:
        return []
    start = window.end - (window.minutes - 1) * samples.MINUTE
    backlog = BarChart(
        title=gettext("Backlog"),
        layers=(_state_layer(OutboxStatus.PENDING), _state_layer(OutboxStatus.FAILED)),
        start=start,
        minutes=window.minutes,
        values={s.taken_at: (s.pending, s.failed) for s in window.samples},
    )
    if not outbox_settings.PUBLISHED_RETENTION:
        note = gettext(
            "No publish rate: PUBLISHED_RETENTION is 0, so a published message is "
            "deleted at once and none is kept to count."
        )
        return [render(backlog), format_html('<p class="help">{}</p>', note)]
    rate = BarChart(
        title=gettext("Published per minute"),
        layers=(_state_layer(OutboxStatus.PUBLISHED),),
        start=start - samples.MINUTE,
        minutes=window.minutes,
        values={s.taken_at - samples.MINUTE: (s.published,) for s in window.samples},
    )
    return [render(backlog), render(rate)]


def blocked_context(using: str, can_act: bool) -> dict[str, Any]:
    """The blocked keys (their head ABANDONED), longest blocked first, with how
    long; ``can_act``: whether to offer the head buttons."""
    blocked = blocked_keys(using)
    now = timezone.now()
    return {
        "count": blocked.count,
        "keys": [
            (key, "" if key.blocked_for is None else timesince(now - key.blocked_for, now))
            for key in blocked.keys
        ],
        "can_act": can_act,
    }


def _state_layer(status: OutboxStatus) -> Layer:
    return Layer(str(status.label).lower(), STATUS_COLOURS[status])
