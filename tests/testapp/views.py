"""Views of the test app: a request that stages an event, for tests/integration/test_tracing.py;
an async view that enqueues a Django task, for tests/integration/test_tasks.py."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, JsonResponse

from django_outbox import stage


def place_order(request: HttpRequest) -> JsonResponse:
    """Stage one ``order.placed`` event to the destination the query string names."""
    with transaction.atomic():
        row = stage("order.placed", {"total": 10}, destination=request.GET["destination"])
    return JsonResponse({"event_id": str(row.event_id)})


async def enqueue_add(request: HttpRequest) -> JsonResponse:
    """Enqueue the task ``add`` (Django 6) on the queue the query string names, as an
    async view written for Django's own task backends does: no transaction."""
    from tests.testapp import djtasks

    task = djtasks.add.using(queue_name=request.GET["queue"])
    result = await task.aenqueue(int(request.GET["a"]), int(request.GET["b"]))
    return JsonResponse({"result_id": result.id, "status": result.status})
