"""The admin of the relays and consumers: each process's heartbeat row, live, stale,
dead or stopped by the age of its last beat (docs/health.md)."""

from __future__ import annotations

from django.contrib import admin
from django.db import models
from django.http import HttpRequest
from django.utils.safestring import SafeString
from django.utils.timesince import timesince
from django.utils.translation import gettext_lazy as _

from ..models import WorkerHeartbeat
from ..workers.heartbeat import WorkerState, clock_of, state_of, with_database_clock
from .base import ReadOnlyAdmin, badge, pretty_json

#: The badge colour of each heartbeat state in the admin.
WORKER_STATE_COLOURS = {
    WorkerState.LIVE: "#2e7d32",
    WorkerState.STALE: "#ef6c00",
    WorkerState.DEAD: "#c62828",
    WorkerState.STOPPED: "#757575",
}


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(ReadOnlyAdmin):
    """The relays and consumers that ran on this database, each live, stale, dead or
    stopped by the age of its last heartbeat (docs/health.md). A superuser may delete
    the row of a process that is gone for good."""

    list_display = ("worker", "kind", "state_badge", "name", "beat_age", "last_batch_at")
    list_filter = ("kind",)
    search_fields = ("^worker", "^name")
    recent_prefix_fields = ("worker", "name")
    search_help_text = _("The start of a worker (host:pid) or of a consumer's name.")
    sortable_by = ()
    ordering = ("-beat_at",)
    window_field = "beat_at"  # through outbox_heartbeat_beat_idx
    uuid_field = "process"
    fields = (
        "kind",
        "worker",
        "name",
        "database",
        "state_badge",
        "started_at",
        "beat_at",
        "interval",
        "last_batch_at",
        "stopped_at",
        "counts_json",
    )
    readonly_fields = ("state_badge", "counts_json")

    def get_queryset(self, request: HttpRequest) -> models.QuerySet[WorkerHeartbeat]:
        return with_database_clock(super().get_queryset(request))  # ages by the beats' clock

    @admin.display(description=_("state"))
    def state_badge(self, obj: WorkerHeartbeat) -> SafeString:
        state = state_of(obj)
        return badge("outbox-worker-state", WORKER_STATE_COLOURS[state], state)

    @admin.display(description=_("last beat"))
    def beat_age(self, obj: WorkerHeartbeat) -> str:
        return _("%(age)s ago") % {"age": timesince(obj.beat_at, clock_of(obj), depth=1)}

    @admin.display(description=_("counts"))
    def counts_json(self, obj: WorkerHeartbeat) -> SafeString:
        return pretty_json(obj.counts)
