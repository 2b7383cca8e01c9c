"""The admin of Django tasks' results: each task enqueued through the outbox, its
state, arguments, return value and errors (docs/tasks.md)."""

from __future__ import annotations

from django.contrib import admin
from django.utils.html import format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from ..models import TaskResultRecord
from .base import ReadOnlyAdmin, pretty_json
from .window import RecentChoicesFilter, RecentValuesFilter


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
