"""The Django admin for the outbox and the inbox: read-mostly, fast on big tables.

Events are facts: no admin adds or edits a row. The one change an operator
makes is to an outbox row's fate, through the ``requeue`` and ``abandon``
actions, and for the blocked head of an ordered key "requeue head" and "skip
head" (listed above the rows with their buttons); all delegate to
:mod:`django_outbox.store` and need the ``django_outbox.requeue_outboxmessage``
permission (not just view or change). Delete is left to superusers only:
deleting a PENDING row loses a committed event without a trace, which is what
the outbox exists to prevent; retention deletes finished rows and ``abandon``
stops a row from being sent. A superuser can still delete one row from its page
(to purge a payload that must not be kept, say); the bulk ``delete_selected``
action is removed, because its confirmation page would list every selected row.

Pages stay fast with millions of rows: every statement reads through an index or
a bound (tests/integration/test_admin_plans.py proves it by the plans of every
page on 200,000 rows): no full ``COUNT(*)`` (see
:func:`django_outbox.db.count_rows`), filter choices and value filters read from
the recent window (:func:`recent`), sorting only by id (the one index that
serves every filter), ids and ordering keys searched by exact match on their
indexes, and no action on more than ``ACTION_ROW_LIMIT`` rows.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable
from functools import cached_property
from typing import Any, cast

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.core.paginator import Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.functional import SimpleLazyObject
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import Truncator, unescape_string_literal
from django.utils.timesince import timesince
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from . import samples, store
from .charts import BarChart, Layer, render
from .conf import outbox_settings
from .db import RowCount, count_rows, write_first
from .exceptions import SkipRefused
from .heartbeat import WorkerState, clock_of, state_of, with_database_clock
from .models import (
    InboxFailure,
    InboxMessage,
    OutboxMessage,
    OutboxQuerySet,
    OutboxStatus,
    TaskResultRecord,
    WorkerHeartbeat,
)
from .status import blocked_keys, summary

logger = logging.getLogger(__name__)

#: Badge colours per state: white text on these stays readable in light and dark themes.
STATUS_COLOURS = {
    OutboxStatus.PENDING: "#5b6770",
    OutboxStatus.PROCESSING: "#1f6fb2",
    OutboxStatus.PUBLISHED: "#2e7d32",
    OutboxStatus.FAILED: "#c25e00",
    OutboxStatus.ABANDONED: "#b3261e",
}
ERROR_EXCERPT_CHARS = 80


def pretty_json(value: object) -> SafeString:
    """``value`` as indented JSON in a ``<pre>``, escaped by ``format_html``."""
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, cls=DjangoJSONEncoder)
    return format_html('<pre class="outbox-json">{}</pre>', text)


class EstimatingPaginator(Paginator):
    """A paginator whose count never reads the whole table: exact up to
    ``django_outbox.db.EXACT_COUNT_LIMIT`` rows, PostgreSQL's estimate beyond.
    Past the estimate's last page there is nothing to click; filter or search
    to reach rows the estimate leaves out."""

    @cached_property
    def row_count(self) -> RowCount:
        # The admin always pages a queryset.
        return count_rows(cast(models.QuerySet[Any], self.object_list))

    @cached_property
    def count(self) -> int:
        return self.row_count.value


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


#: The recent window: filter choices, the value filters of columns no index leads, and
#: prefix searches read only the newest this many rows of a table (by the admin's
#: ``window_field``), so that none reads the whole table.
RECENT_ROWS = 10_000
#: The most rows one action changes, or lists on its confirmation page; past it the
#: action refuses with a message that names the management command for bulk changes.
#: Below Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000), which a confirmation form
#: posting one field per row must stay under.
ACTION_ROW_LIMIT = 500


def recent(model_admin: ReadOnlyAdmin, request: HttpRequest) -> models.Q:
    """The newest ``RECENT_ROWS`` rows of ``model_admin``'s table (all, if fewer), as a
    range of its ``window_field``: one walk of that column's index to the window's
    start (or one probe for the oldest row), read once per request."""
    field = model_admin.window_field
    starts = request.__dict__.setdefault("_outbox_recent", {})
    if model_admin.model not in starts:
        values = model_admin.get_queryset(request).values_list(field, flat=True)
        window = values.order_by(f"-{field}")[RECENT_ROWS - 1 : RECENT_ROWS]
        starts[model_admin.model] = next(iter(window), None) or values.order_by(field).first()
    start = starts[model_admin.model]
    return models.Q() if start is None else models.Q(**{f"{field}__gte": start})


def distinct_leading(rows: models.QuerySet[Any], field: str) -> list[Any]:
    """The distinct values of ``field``, the first column of an index, one index probe
    each (a skip scan: PostgreSQL 15 has none of its own), at most ``RECENT_ROWS``."""
    ordered = rows.order_by(field).values_list(field, flat=True)
    values: list[Any] = []
    value = ordered.first()
    while value is not None and len(values) < RECENT_ROWS:
        values.append(value)
        value = ordered.filter(**{f"{field}__gt": value}).first()
    return values


class InRecentWindow(admin.FieldListFilter):
    """Once a value is chosen, the rows are those of the recent window (:func:`recent`):
    no index leads with the column, or (an inbox's consumer) a common value's rows are
    counted by reading the table, so a value's rows are found only there."""

    def __init__(
        self,
        field: models.Field[Any, Any],
        request: HttpRequest,
        params: dict[str, list[str]],
        model: type[models.Model],
        model_admin: admin.ModelAdmin[Any],
        field_path: str,
    ) -> None:
        self.owner = cast(ReadOnlyAdmin, model_admin)
        super().__init__(field, request, params, model, model_admin, field_path)

    def queryset(self, request: HttpRequest, queryset: models.QuerySet[Any]) -> Any:
        chosen = cast(models.QuerySet[Any], super().queryset(request, queryset))
        return chosen.filter(recent(self.owner, request)) if self.used_parameters else chosen


class RecentValuesFilter(InRecentWindow, admin.AllValuesFieldListFilter):
    """The values found in the recent window (and the one selected), rather than
    ``SELECT DISTINCT`` over the whole table, and the rows of the recent window with the
    chosen one. A value seen only in older rows can be put in the URL
    (``?event_type=...``): it lists nothing."""

    def __init__(
        self, field: models.Field[Any, Any], request: HttpRequest, *args: Any, **kwargs: Any
    ) -> None:  # the rest as Django's FieldListFilter takes them
        super().__init__(field, request, *args, **kwargs)
        rows = self.owner.get_queryset(request).filter(recent(self.owner, request))
        values = rows.order_by().values_list(field.name, flat=True).distinct()
        # A list, not the stubs' QuerySet: choices() only iterates it.
        self.lookup_choices = sorted({*values, *(self.lookup_val or ())})  # type: ignore[assignment]


class RecentChoicesFilter(InRecentWindow, admin.ChoicesFieldListFilter):
    """A choices field's filter (a task's state: no index holds it) whose rows are those
    of the recent window."""


class ReadOnlyAdmin(admin.ModelAdmin):
    """No add, no change, delete for superusers only (see the module docstring),
    newest rows first, no full counts, no facet counts.

    Search reads through an index or the recent window, never the whole table: a term
    that is a UUID finds the row with that id (``uuid_field``, exactly, on its index;
    when that index leads with ``uuid_scope``, one probe per value of it); any other
    term (a quoted UUID too) is matched exactly against ``exact_search_fields`` (each
    the first column of an index) and as the start of ``recent_prefix_fields`` among
    the recent window's rows. ``search_fields`` only names them for Django's search
    box."""

    paginator = EstimatingPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts are COUNT(*)s over the whole table
    ordering = ("-id",)
    #: The column whose newest values make the recent window (:func:`recent`): indexed.
    window_field = "id"
    #: The column a UUID search term is looked up in.
    uuid_field = "event_id"
    #: The column before ``uuid_field`` in the index that holds it, if any.
    uuid_scope: str | None = None
    exact_search_fields: tuple[str, ...] = ()
    recent_prefix_fields: tuple[str, ...] = ()

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Without a row the question comes from the changelist's bulk "delete
        # selected" action, which is refused even to superusers.
        return obj is not None and bool(request.user.is_superuser)

    def get_search_results(
        self, request: HttpRequest, queryset: models.QuerySet[Any], search_term: str
    ) -> tuple[models.QuerySet[Any], bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            found = uuid.UUID(term)
        except ValueError:
            return queryset.filter(self._text_search(request, _unquoted(term))), False
        if self.uuid_scope is None:
            return queryset.filter(**{self.uuid_field: found}), False
        scopes = distinct_leading(self.get_queryset(request), self.uuid_scope)
        return queryset.filter(**{f"{self.uuid_scope}__in": scopes, self.uuid_field: found}), False

    def _text_search(self, request: HttpRequest, term: str) -> models.Q:
        found = models.Q(pk__in=[])
        for field in self.exact_search_fields:
            found |= models.Q(**{field: term})
        for field in self.recent_prefix_fields:
            found |= models.Q(**{f"{field}__startswith": term}) & recent(self, request)
        return found


def _unquoted(term: str) -> str:
    """``term`` without the quotes around it (a quoted UUID is searched as text)."""
    if len(term) > 1 and term[0] == term[-1] and term[0] in "\"'":
        return unescape_string_literal(term)
    return term


class DeliveryAdmin(ReadOnlyAdmin):
    """Columns shared by the rows that record a delivery's error and headers."""

    @admin.display(description=_("last error"))
    def error_excerpt(self, obj: OutboxMessage | InboxFailure) -> str:
        return Truncator(obj.last_error).chars(ERROR_EXCERPT_CHARS)

    @admin.display(description=_("last error"))
    def last_error_text(self, obj: OutboxMessage | InboxFailure) -> SafeString:
        return format_html('<pre class="outbox-error">{}</pre>', obj.last_error)

    @admin.display(description=_("headers"))
    def headers_json(self, obj: OutboxMessage | InboxFailure) -> SafeString:
        return pretty_json(obj.headers)


@admin.register(OutboxMessage)
class OutboxMessageAdmin(DeliveryAdmin):
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
        return format_html(
            '<span class="outbox-status" style="background:{};color:#fff;padding:1px 6px;'
            'border-radius:8px;white-space:nowrap">{}</span>',
            STATUS_COLOURS[OutboxStatus(obj.status)],
            obj.get_status_display(),
        )

    @admin.display(description=_("age"), ordering="-id")
    def age(self, obj: OutboxMessage) -> str:
        return timesince(obj.created_at, depth=1)

    @admin.display(description=_("payload"))
    def payload_json(self, obj: OutboxMessage) -> SafeString:
        return pretty_json(obj.payload)

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        """Every action: ``django_outbox.requeue_outboxmessage`` (Meta.permissions)."""
        return bool(request.user.has_perm(f"{self.opts.app_label}.requeue_outboxmessage"))

    @admin.action(
        description=_("Requeue selected failed/abandoned messages"), permissions=["requeue"]
    )
    def requeue(self, request: HttpRequest, queryset: OutboxQuerySet) -> None:
        if self._too_many(request, queryset, "outbox_requeue --status failed|abandoned"):
            return
        changed, refused = self._change_fate(request, queryset, store.requeue, "requeued")
        self._report(
            request,
            ngettext(
                "%(count)d message requeued: pending again, attempts reset.",
                "%(count)d messages requeued: pending again, attempts reset.",
                changed,
            )
            % {"count": changed},
            ngettext(
                "%(count)d selected message was not requeued: "
                "only failed or abandoned messages can be.",
                "%(count)d selected messages were not requeued: "
                "only failed or abandoned messages can be.",
                refused,
            )
            % {"count": refused},
            changed,
            refused,
        )

    @admin.action(
        description=_("Abandon selected pending/failed messages"), permissions=["requeue"]
    )
    def abandon(self, request: HttpRequest, queryset: OutboxQuerySet) -> None:
        if self._too_many(request, queryset, None):
            return
        changed, refused = self._change_fate(request, queryset, store.abandon, "abandoned")
        self._report(
            request,
            ngettext(
                "%(count)d message abandoned: the relay will not send it.",
                "%(count)d messages abandoned: the relay will not send them.",
                changed,
            )
            % {"count": changed},
            ngettext(
                "%(count)d selected message was not abandoned: only pending or failed "
                "messages (or processing ones whose lease expired) can be.",
                "%(count)d selected messages were not abandoned: only pending or failed "
                "messages (or processing ones whose lease expired) can be.",
                refused,
            )
            % {"count": refused},
            changed,
            refused,
        )

    @admin.action(
        description=_("Requeue head: publish the blocked head of an ordered key again"),
        permissions=["requeue"],
    )
    def requeue_head(self, request: HttpRequest, queryset: OutboxQuerySet) -> None:
        if self._too_many(request, queryset, "outbox_requeue --id"):
            return
        changed = self._change_heads(request, queryset, store.requeue_heads, "head_requeued")
        if changed is not None:
            message = ngettext(
                "%(count)d head requeued: pending again, attempts reset; its key follows.",
                "%(count)d heads requeued: pending again, attempts reset; their keys follow.",
                changed,
            )
            self.message_user(request, message % {"count": changed}, messages.SUCCESS)

    @admin.action(
        description=_("Skip head: publish a skip marker in place of the blocked head"),
        permissions=["requeue"],
    )
    def skip_head(self, request: HttpRequest, queryset: OutboxQuerySet) -> TemplateResponse | None:
        """Skipping cannot be undone: a confirmation page lists the rows first."""
        if self._too_many(request, queryset, "outbox_skip --id"):
            return None
        if request.POST.get("post") != "yes":
            return TemplateResponse(
                request,
                "admin/django_outbox/outboxmessage/skip_head_confirmation.html",
                {
                    **self.admin_site.each_context(request),
                    "title": _("Skip these heads?"),
                    "opts": self.opts,
                    "rows": queryset.order_by("id"),
                    "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
                },
            )
        changed = self._change_heads(request, queryset, store.skip, "skipped")
        if changed is not None:
            message = ngettext(
                "%(count)d head skipped: a skip marker is published in its place; "
                "its key moves on.",
                "%(count)d heads skipped: a skip marker is published in place of each; "
                "their keys move on.",
                changed,
            )
            self.message_user(request, message % {"count": changed}, messages.SUCCESS)
        return None

    def _too_many(
        self, request: HttpRequest, queryset: OutboxQuerySet, command: str | None
    ) -> bool:
        """Refuse a selection of more than ``ACTION_ROW_LIMIT`` rows (counted no further)
        with one line naming ``command``, the management command for bulk changes."""
        if queryset.order_by()[: ACTION_ROW_LIMIT + 1].count() <= ACTION_ROW_LIMIT:
            return False
        if command is None:
            message = gettext(
                "More than %(limit)d messages selected: an action changes at most "
                "%(limit)d. Filter the list to fewer."
            )
        else:
            message = gettext(
                "More than %(limit)d messages selected: an action changes at most "
                "%(limit)d. Filter the list to fewer, or run manage.py %(command)s."
            )
        self.message_user(
            request, message % {"limit": ACTION_ROW_LIMIT, "command": command}, messages.ERROR
        )
        return True

    def _change_heads(
        self,
        request: HttpRequest,
        queryset: OutboxQuerySet,
        verb: Callable[[str, list[int]], int],
        outcome: str,
    ) -> int | None:
        """Apply ``verb`` (all or nothing) to the selected heads; on a refusal, show
        it (it names each refused row and why) and return None."""
        ids = sorted(queryset.values_list("id", flat=True))
        try:
            changed = verb(queryset.db, ids)
        except SkipRefused as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return None
        logger.info(
            "admin: %d heads of ordered keys %s: %s",
            changed,
            outcome.removeprefix("head_"),
            ids,
            extra={"action": f"outbox.admin_{outcome}", "ids": ids, "user_id": request.user.pk},
        )
        return changed

    def _report(
        self, request: HttpRequest, done: str, not_done: str, changed: int, refused: int
    ) -> None:
        """One success message for the changed rows, one warning for the refused ones."""
        if changed:
            self.message_user(request, done, messages.SUCCESS)
        if refused:
            self.message_user(request, not_done, messages.WARNING)

    def _change_fate(
        self,
        request: HttpRequest,
        queryset: OutboxQuerySet,
        verb: Callable[[str, OutboxQuerySet], int],
        outcome: str,
    ) -> tuple[int, int]:
        """Apply ``verb`` to the selected rows; return (changed, refused by their state)."""
        with transaction.atomic(using=queryset.db):
            write_first(queryset.db)  # it counts, then changes
            selected = queryset.count()
            changed = verb(queryset.db, queryset)
        refused = selected - changed
        logger.info(
            "admin: %s %d outbox rows, %d refused by their state",
            outcome,
            changed,
            refused,
            extra={
                "action": f"outbox.admin_{outcome}",
                "changed": changed,
                "refused": refused,
                "user_id": request.user.pk,
            },
        )
        return changed, refused

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The list, with a summary of every state above it (computed only when the
        page renders, not for an action's POST that redirects)."""
        using = self.get_queryset(request).db
        can_act = self.has_requeue_permission(request)
        extra_context = {
            **(extra_context or {}),
            "outbox_summary": SimpleLazyObject(lambda: self._summary_context(using)),
            "outbox_blocked": SimpleLazyObject(lambda: self._blocked_context(using, can_act)),
            "outbox_charts": SimpleLazyObject(lambda: self._charts(using)),
        }
        return super().changelist_view(request, extra_context)

    @staticmethod
    def _summary_context(using: str) -> dict[str, Any]:
        report = summary(using)
        age = report.oldest_due_age
        return {
            "states": [
                (status.value, status.label, report.counts[status.value]) for status in OutboxStatus
            ],
            "oldest_due": None if age is None else timesince(timezone.now() - age, depth=2),
            "scheduled": report.scheduled,  # PENDING, not due yet: not in its count above
        }

    @staticmethod
    def _charts(using: str) -> list[SafeString]:
        """The last hour's backlog and publish rate as two SVG charts, from the samples
        relays take once a minute (:mod:`django_outbox.samples`); none without samples.
        A sample counts what was published in the minute *before* it, so the rate's bars
        stand at that minute and its chart ends with the last whole minute. With
        ``PUBLISHED_RETENTION`` 0 no published row is kept to count: a note says so in
        place of the rate."""
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

    @staticmethod
    def _blocked_context(using: str, can_act: bool) -> dict[str, Any]:
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


@admin.register(TaskResultRecord)
class TaskResultAdmin(ReadOnlyAdmin):
    """The results of Django tasks enqueued through the outbox (docs/tasks.md)."""

    list_display = ("id", "task_path", "status", "queue_name", "enqueued_at", "finished_at")
    list_filter = (("status", RecentChoicesFilter), ("queue_name", RecentValuesFilter))
    search_fields = ("^task_path",)
    recent_prefix_fields = ("task_path",)
    search_help_text = _(
        "A task id (exact) or the start of a task's path (among the newest 10,000 results)."
    )
    sortable_by = ()
    ordering = ("-enqueued_at",)
    window_field = "enqueued_at"  # through outbox_task_enqueued_idx
    uuid_field = "id"
    fields = (
        "id",
        "task_path",
        "status",
        "backend",
        "queue_name",
        "priority",
        "run_after",
        "enqueued_at",
        "started_at",
        "last_attempted_at",
        "finished_at",
        "worker_ids",
        "arguments_json",
        "return_value_json",
        "errors_text",
    )
    readonly_fields = ("arguments_json", "return_value_json", "errors_text")

    @admin.display(description=_("arguments"))
    def arguments_json(self, obj: TaskResultRecord) -> SafeString:
        return pretty_json({"args": obj.args, "kwargs": obj.kwargs})

    @admin.display(description=_("return value"))
    def return_value_json(self, obj: TaskResultRecord) -> SafeString:
        return pretty_json(obj.return_value)

    @admin.display(description=_("errors"))
    def errors_text(self, obj: TaskResultRecord) -> SafeString:
        """Each error's exception class and traceback, oldest first."""
        return format_html_join(
            "",
            '<pre class="outbox-error">{}\n{}</pre>',
            ((e.get("exception_class_path", ""), e.get("traceback", "")) for e in obj.errors),
        )


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
        return format_html(
            '<span class="outbox-worker-state" style="background:{};color:#fff;padding:1px 6px;'
            'border-radius:8px;white-space:nowrap">{}</span>',
            WORKER_STATE_COLOURS[state],
            state,
        )

    @admin.display(description=_("last beat"))
    def beat_age(self, obj: WorkerHeartbeat) -> str:
        return _("%(age)s ago") % {"age": timesince(obj.beat_at, clock_of(obj), depth=1)}

    @admin.display(description=_("counts"))
    def counts_json(self, obj: WorkerHeartbeat) -> SafeString:
        return pretty_json(obj.counts)
