"""The recent window: the newest rows of a table, where the admin's filters and prefix
searches look when no index leads with their column (docs/admin.md, "The recent
window"), and the filters that read it."""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.db import models
from django.http import HttpRequest

logger = logging.getLogger(__name__)

#: The recent window: filter choices, the value filters of columns no index leads, and
#: prefix searches read only the newest this many rows of a table (by the admin's
#: ``window_field``), so that none reads the whole table.
RECENT_ROWS = 10_000


class Windowed(Protocol):
    """An admin with a recent window (:class:`~django_outbox.admin.base.ReadOnlyAdmin`)."""

    #: The column whose newest values make the window: indexed.
    window_field: str

    @property
    def model(self) -> type[models.Model]: ...

    def get_queryset(self, request: HttpRequest) -> models.QuerySet[Any]: ...


def recent(model_admin: Windowed, request: HttpRequest) -> models.Q:
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
        self.owner = cast(Windowed, model_admin)
        super().__init__(field, request, params, model, model_admin, field_path)

    def queryset(self, request: HttpRequest, queryset: models.QuerySet[Any]) -> Any:
        refuse_nul(self.used_parameters)
        chosen = cast(models.QuerySet[Any], super().queryset(request, queryset))
        return chosen.filter(recent(self.owner, request)) if self.used_parameters else chosen


def refuse_nul(parameters: dict[str, Any]) -> None:
    """Refuse a filter value holding a NUL character, which no PostgreSQL text column can
    hold (the query would fail: a server error), as Django's search box refuses one in
    a term: the list again, unfiltered, with ``?e=1``; one INFO line names the filter."""
    for name, value in parameters.items():
        values = [value] if isinstance(value, str) else value
        if any("\x00" in str(item) for item in values):
            logger.info(
                "admin filter %s refused: its value holds a NUL character, which no "
                "stored text can",
                name,
                extra={"action": "outbox.admin_filter_refused", "parameter": name},
            )
            raise IncorrectLookupParameters(f"a NUL character in filter {name!r}")


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
