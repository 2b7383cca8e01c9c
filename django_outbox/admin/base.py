"""What every admin of the package shares: read-only pages (no add, no change, delete
for superusers only), counts that never read a whole table, search through an index
or the recent window, and the columns of a delivery's error and headers."""

from __future__ import annotations

import json
import logging
import uuid
from functools import cached_property
from typing import Any, cast

from django.contrib import admin
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.paginator import EmptyPage, Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.http import HttpRequest
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator, unescape_string_literal
from django.utils.translation import gettext_lazy as _

from ..db import RowCount, count_rows
from ..models import InboxFailure, OutboxMessage
from .window import distinct_leading, recent

ERROR_EXCERPT_CHARS = 80
#: How deep the admin's pages go: a page is an OFFSET, which reads every row before it.
PAGE_DEPTH_ROWS = 10_000

logger = logging.getLogger(__name__)


def pretty_json(value: object) -> SafeString:
    """``value`` as indented JSON in a ``<pre>``, escaped by ``format_html``."""
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, cls=DjangoJSONEncoder)
    return format_html('<pre class="outbox-json">{}</pre>', text)


def badge(css_class: str, colour: str, label: object) -> SafeString:
    """``label`` in a rounded badge of ``colour`` (white text on it stays readable in
    light and dark themes)."""
    return format_html(
        '<span class="{}" style="background:{};color:#fff;padding:1px 6px;'
        'border-radius:8px;white-space:nowrap">{}</span>',
        css_class,
        colour,
        label,
    )


class EstimatingPaginator(Paginator):
    """A paginator whose count never reads the whole table: exact up to
    ``django_outbox.db.EXACT_COUNT_LIMIT`` rows, PostgreSQL's estimate beyond; and
    whose pages stop at :data:`PAGE_DEPTH_ROWS` rows deep, since a page is an OFFSET
    that reads every row before it. A deeper page is refused as Django refuses a page
    out of range (the list with ``?e=1``), logged once; sort the other way, filter or
    search to reach the rows beyond."""

    @cached_property
    def row_count(self) -> RowCount:
        # The admin always pages a queryset.
        return count_rows(cast(models.QuerySet[Any], self.object_list))

    @cached_property
    def count(self) -> int:
        return self.row_count.value

    @cached_property
    def num_pages(self) -> int:
        return min(Paginator.num_pages.func(self), self.deepest_page)  # type: ignore[attr-defined]

    @property
    def deepest_page(self) -> int:
        """The last page whose rows lie within :data:`PAGE_DEPTH_ROWS`."""
        return max(1, PAGE_DEPTH_ROWS // self.per_page)

    @property
    def pages_stop(self) -> bool:
        """Whether rows lie beyond the last page (the pages stopped at the bound)."""
        return self.count > self.num_pages * self.per_page

    def validate_number(self, number: Any) -> int:
        try:
            return super().validate_number(number)
        except EmptyPage:
            if self.pages_stop:
                logger.info(
                    "admin page %s refused: pages stop at %d rows deep, page %d; sort the "
                    "other way, filter or search to reach older rows",
                    number,
                    PAGE_DEPTH_ROWS,
                    self.num_pages,
                    extra={"action": "outbox.admin_page_refused"},
                )
            raise


class SortableOnlyChangeList(ChangeList):
    """Django's changelist, whose sort in the URL (``?o=``) keeps only the columns its
    admin's ``sortable_by`` names: Django applies any column's otherwise (``sortable_by``
    only hides the headers' links), and a sort no index serves reads the whole table.
    A column dropped so is logged once."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> Any:
        order = self.params.get(ORDER_VAR)
        if order:
            kept = [part for part in order.split(".") if self._sortable(part)]
            if len(kept) < len(order.split(".")):
                logger.info(
                    "admin sort %s=%s ignored: this list sorts by %s only",
                    ORDER_VAR,
                    order,
                    ", ".join(self.sortable_by or ()) or "its default order",
                    extra={"action": "outbox.admin_sort_ignored"},
                )
            if kept:
                self.params[ORDER_VAR] = ".".join(kept)
            else:
                del self.params[ORDER_VAR]
        return super().get_queryset(request, exclude_parameters)

    def _sortable(self, part: str) -> bool:
        """Whether ``part`` of ``?o=`` (``[-]index``) is a column ``sortable_by`` names."""
        try:
            column = self.list_display[int(part.rpartition("-")[2])]
        except (IndexError, ValueError):
            return False
        return column in (self.sortable_by or ())


class ReadOnlyAdmin(admin.ModelAdmin):
    """No add, no change, delete for superusers only (see :mod:`django_outbox.admin`),
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

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return SortableOnlyChangeList

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
