"""The outbox changelist's actions: requeue and abandon the selected rows, requeue or
skip the blocked head of an ordered key. Each delegates the change to
:mod:`django_outbox.state.store`, needs the ``django_outbox.requeue_outboxmessage``
permission, takes at most ``ACTION_ROW_LIMIT`` rows and is logged (logger
``django_outbox.admin``, docs/runbook.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.http import HttpRequest
from django.template.response import TemplateResponse
from django.utils.translation import gettext, ngettext, ngettext_lazy
from django.utils.translation import gettext_lazy as _

from ..exceptions import SkipRefused
from ..models import OutboxQuerySet
from ..state import store

logger = logging.getLogger("django_outbox.admin")

#: The most rows one action changes, or lists on its confirmation page; past it the
#: action refuses with a message that names the management command for bulk changes.
#: Below Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1,000), which a confirmation form
#: posting one field per row must stay under.
ACTION_ROW_LIMIT = 500

#: What requeue and abandon say of the rows they changed and of the selected rows their
#: state refused, by outcome (the number: ``count``).
_REPORTS = {
    "requeued": (
        ngettext_lazy(
            "%(count)d message requeued: pending again, attempts reset.",
            "%(count)d messages requeued: pending again, attempts reset.",
            "count",
        ),
        ngettext_lazy(
            "%(count)d selected message was not requeued: "
            "only failed or abandoned messages can be.",
            "%(count)d selected messages were not requeued: "
            "only failed or abandoned messages can be.",
            "count",
        ),
    ),
    "abandoned": (
        ngettext_lazy(
            "%(count)d message abandoned: the relay will not send it.",
            "%(count)d messages abandoned: the relay will not send them.",
            "count",
        ),
        ngettext_lazy(
            "%(count)d selected message was not abandoned: only pending or failed "
            "messages (or processing ones whose lease expired) can be.",
            "%(count)d selected messages were not abandoned: only pending or failed "
            "messages (or processing ones whose lease expired) can be.",
            "count",
        ),
    ),
}


class OutboxActions(admin.ModelAdmin):
    """The actions of :class:`~django_outbox.admin.OutboxMessageAdmin`, named in its
    ``actions``."""

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        """Every action: ``django_outbox.requeue_outboxmessage`` (Meta.permissions)."""
        return bool(request.user.has_perm(f"{self.opts.app_label}.requeue_outboxmessage"))

    @admin.action(
        description=_("Requeue selected failed/abandoned messages"), permissions=["requeue"]
    )
    def requeue(self, request: HttpRequest, queryset: OutboxQuerySet) -> None:
        command = "outbox_requeue --status failed|abandoned"
        self._act(request, queryset, store.requeue, "requeued", command)

    @admin.action(
        description=_("Abandon selected pending/failed messages"), permissions=["requeue"]
    )
    def abandon(self, request: HttpRequest, queryset: OutboxQuerySet) -> None:
        self._act(request, queryset, store.abandon, "abandoned", None)

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

    def _act(
        self,
        request: HttpRequest,
        queryset: OutboxQuerySet,
        verb: Callable[[str, OutboxQuerySet], int],
        outcome: str,
        command: str | None,
    ) -> None:
        """Apply ``verb`` to the selected rows, unless there are too many (see
        :meth:`_too_many`); one success message for the changed rows, one warning for
        the rows their state refused (:data:`_REPORTS`)."""
        if self._too_many(request, queryset, command):
            return
        changed, refused = self._change_fate(request, queryset, verb, outcome)
        done, not_done = _REPORTS[outcome]
        if changed:
            self.message_user(request, done % {"count": changed}, messages.SUCCESS)
        if refused:
            self.message_user(request, not_done % {"count": refused}, messages.WARNING)

    def _change_fate(
        self,
        request: HttpRequest,
        queryset: OutboxQuerySet,
        verb: Callable[[str, OutboxQuerySet], int],
        outcome: str,
    ) -> tuple[int, int]:
        """Apply ``verb`` to the selected rows; return (changed, refused by their state)."""
        changed, refused = store.change_counted(queryset.db, queryset, verb)
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
