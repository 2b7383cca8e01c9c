"""The outbox changelist: its columns, its filters, a row's page, and the figures
above the list (:mod:`.summary`); its actions are :mod:`.actions`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db import models
from django.http import HttpRequest, HttpResponse
from django.utils.safestring import SafeString
from django.utils.timesince import timesince
from django.utils.translation import gettext_lazy as _

from ..models import OutboxMessage, OutboxQuerySet, OutboxStatus
from .actions import OutboxActions
from .base import DeliveryAdmin, badge, pretty_json
from .summary import STATUS_COLOURS, changelist_context
from .window import RecentValuesFilter


class StatusFilter(admin.ChoicesFieldListFilter):
    """The status filter, its rows read through indexes on any table size: by their
    state alone PostgreSQL would count and page them by a scan of the table (see
    ``OutboxQuerySet.in_states``)."""

    def queryset(self, request: HttpRequest, queryset: models.QuerySet[Any]) -> Any:
        chosen = self.used_parameters.get(self.lookup_kwarg)
        if not chosen or self.lookup_kwarg_isnull in self.used_parameters:
            return super().queryset(request, queryset)
        states = [chosen] if isinstance(chosen, str) else list(cast(Iterable[str], chosen))
        unknown = set(states) - set(OutboxStatus.values)
        if unknown:  # as Django's own filters answer a bad value: the list with ?e=1
            raise IncorrectLookupParameters(f"no status {sorted(unknown)}")
        return cast(OutboxQuerySet, queryset).in_states(*states)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(OutboxActions, DeliveryAdmin):
    """The outbox's rows, newest first, with a summary of every state, the blocked
    ordered keys and the last hour's charts above them (:mod:`.summary`), and the
    actions of :mod:`.actions`."""

    list_display = (
        "event_type",
        "destination",
        "status_badge",
        "sequence",
        "attempts",
        "age",
        "available_at",
        "error_excerpt",
    )
    list_filter = (
        ("status", StatusFilter),
        ("event_type", RecentValuesFilter),
        ("destination", RecentValuesFilter),
        "created_at",  # through outbox_created_idx
    )
    # A UUID term is an event id (see ReadOnlyAdmin); quote it to search keys instead.
    search_fields = ("=ordering_key",)
    exact_search_fields = ("ordering_key",)  # through outbox_ordering_key_idx
    search_help_text = _("An event id or an ordering key (exact).")
    sortable_by = ("age",)
    actions = ("requeue", "abandon", "requeue_head", "skip_head")
    fieldsets = (
        (
            None,
            {"fields": ("event_id", "event_type", "destination", "ordering_key", "sequence")},
        ),
        (
            _("Delivery"),
            {
                "fields": (
                    "status_badge",
                    "attempts",
                    "created_at",
                    "available_at",
                    "published_at",
                    "abandoned_at",
                    "skipped_at",
                    "last_error_text",
                )
            },
        ),
        (_("Lease"), {"fields": ("locked_until", "locked_by", "lease_token")}),
        (_("Message"), {"fields": ("payload_json", "headers_json")}),
    )
    readonly_fields = ("status_badge", "last_error_text", "payload_json", "headers_json")

    @admin.display(description=_("status"))
    def status_badge(self, obj: OutboxMessage) -> SafeString:
        colour = STATUS_COLOURS[OutboxStatus(obj.status)]
        return badge("outbox-status", colour, obj.get_status_display())

    @admin.display(description=_("age"), ordering="-id")
    def age(self, obj: OutboxMessage) -> str:
        return timesince(obj.created_at, depth=1)

    @admin.display(description=_("payload"))
    def payload_json(self, obj: OutboxMessage) -> SafeString:
        return pretty_json(obj.payload)

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The list, with the figures of :mod:`.summary` above it."""
        using = self.get_queryset(request).db
        figures = changelist_context(using, self.has_requeue_permission(request))
        return super().changelist_view(request, {**(extra_context or {}), **figures})
