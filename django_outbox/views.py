"""A health endpoint an orchestrator can probe: ``include("django_outbox.urls")``."""

from __future__ import annotations

import logging

from django.db import DatabaseError
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from .conf import outbox_settings
from .conf.redact import SecretFilter
from .ops.health import check_health

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))  # the driver's error and traceback


@never_cache
@require_GET
def health(request: HttpRequest, using: str = "default") -> JsonResponse:
    """200 with the outcome of :func:`~django_outbox.ops.health.check_health` as JSON when
    the outbox of ``using`` is healthy, 503 when it is not or its database cannot be
    read. Nothing of the request is read: a probe cannot change what is checked."""
    try:
        outcome = check_health(using)
    except DatabaseError:
        logger.warning(
            "health check: database %r cannot be read",
            using,
            exc_info=True,
            extra={"action": "outbox.health_unreadable"},
        )
        problem = f"database {using!r} cannot be read"
        return JsonResponse(
            {"healthy": False, "database": using, "problems": [problem]}, status=503
        )
    return JsonResponse(outcome.as_dict(), status=200 if outcome.healthy else 503)
