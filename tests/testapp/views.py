"""Views of the test app: a request that stages an event, for tests/integration/test_tracing.py."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse

from django_outbox import stage


def place_order(request: HttpRequest) -> JsonResponse:
    """Stage one ``order.placed`` event to the destination the query string names."""
    with transaction.atomic():
        row = stage("order.placed", {"total": 10}, destination=request.GET["destination"])
    return JsonResponse({"event_id": str(row.event_id)})
