"""The inbox's admins: the events each consumer handled (its marks) and the failed
deliveries, counted and, past ``max_deliveries``, parked with their body for a
replay (docs/inbox.md)."""

from __future__ import annotations

import json

from django.contrib import admin
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from ..models import InboxFailure, InboxMessage
from .base import DeliveryAdmin, ReadOnlyAdmin, pretty_json
from .window import RecentValuesFilter


@admin.register(InboxMessage)
class InboxMessageAdmin(ReadOnlyAdmin):
    list_display = ("event_id", "consumer", "processed_at")
    list_filter = (("consumer", RecentValuesFilter),)
    search_fields = ("event_id",)
    uuid_scope = "consumer"  # inbox_consumer_event_uniq leads with it
    search_help_text = _("An event id.")
    sortable_by = ()
    fields = ("event_id", "consumer", "processed_at")


@admin.register(InboxFailure)
class InboxFailureAdmin(DeliveryAdmin):
    list_display = (
        "event_id",
        "consumer",
        "event_type",
        "attempts",
        "last_failed_at",
        "parked_at",
        "error_excerpt",
    )
    list_filter = (("consumer", RecentValuesFilter), ("parked_at", admin.EmptyFieldListFilter))
    search_fields = ("event_id", "^event_type")
    uuid_scope = "consumer"  # inbox_failure_consumer_event_uniq leads with it
    recent_prefix_fields = ("event_type",)
    search_help_text = _(
        "An event id, or the start of an event type (among the newest 10,000 failures)."
    )
    sortable_by = ()
    fields = (
        "event_id",
        "consumer",
        "queue",
        "event_type",
        "attempts",
        "first_failed_at",
        "last_failed_at",
        "parked_at",
        "last_error_text",
        "body_text",
        "headers_json",
    )
    readonly_fields = ("last_error_text", "body_text", "headers_json")

    @admin.display(description=_("body"))
    def body_text(self, obj: InboxFailure) -> SafeString:
        """The body as received: indented when it is JSON, verbatim when it is not."""
        try:
            return pretty_json(json.loads(obj.body))
        except ValueError:
            return format_html('<pre class="outbox-json">{}</pre>', obj.body)
