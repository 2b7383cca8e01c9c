"""Triggers for the "Ordered routes" section of docs/hostile-input.md (issue 14)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from django_outbox import stage
from django_outbox.models import OutboxMessage
from tests.support import REDIS_URL, unique_destination

from . import case, error_line
from .settings import check_lines, only


def _routes_check(**route: Any) -> str:
    return only(check_lines(BROKER_URL="memory://", ROUTES={"orders": route}))


@case("ordered-celery-route")
def ordered_celery_route(request: object) -> str:
    return _routes_check(celery_task="billing.charge", ordered=True)


@case("partitions-not-ordered")
def partitions_not_ordered(request: object) -> str:
    return _routes_check(queue="orders", partitions=4)


@case("partitions-without-queue")
def partitions_without_queue(request: object) -> str:
    return _routes_check(ordered=True, partitions=4)


@case("partitions-default-exchange")
def partitions_default_exchange(request: object) -> str:
    return _routes_check(queue="orders", exchange="", ordered=True, partitions=4)


@case("partitions-check-not-rabbitmq")
def partitions_check_not_rabbitmq(request: object) -> str:
    route = {"queue": "orders", "ordered": True, "partitions": 4}
    return only(check_lines(BROKER_URL=REDIS_URL, ROUTES={"orders": route}))


def _consume(queue: str, *options: str, outbox: dict[str, Any]) -> str:
    """The CommandError ``run_outbox_consumer --queue queue`` stops with."""
    try:
        with override_settings(OUTBOX=outbox):
            call_command(
                "run_outbox_consumer",
                f"--queue={queue}",
                "--handler=tests.testapp.handlers.record",
                "--consumer=billing",
                "--idle-timeout=1",
                *options,
            )
    except CommandError as exc:
        return error_line(exc)
    raise AssertionError("run_outbox_consumer accepted the options")


def _partitioned(queue: str, url: str) -> dict[str, Any]:
    route = {"queue": queue, "ordered": True, "partitions": 4}
    return {**settings.OUTBOX, "BROKER_URL": url, "ROUTES": {queue: route}}


@case("partitions-on-redis")
def partitions_on_redis(request: object) -> str:
    queue = unique_destination("h")
    return _consume(queue, outbox=_partitioned(queue, REDIS_URL))


@case("consumer-partitions-out-of-range")
def consumer_partitions_out_of_range(request: object) -> str:
    return _consume(
        "orders", "--partitions=0-5", outbox=_partitioned("orders", settings.OUTBOX["BROKER_URL"])
    )


@case("consumer-partitions-not-partitioned")
def consumer_partitions_not_partitioned(request: object) -> str:
    return _consume("orders", "--partitions=0", outbox={**settings.OUTBOX, "ROUTES": {}})


def _skip(*abandon: int) -> str:
    """Stage three events of one key on an ordered route, abandon the rows at the
    places ``abandon`` (0: the head), and skip the second event."""
    destination = unique_destination("h")
    routes = {destination: {"queue": destination, "ordered": True}}
    with override_settings(OUTBOX={**settings.OUTBOX, "ROUTES": routes}):
        with transaction.atomic():
            ids = [
                stage("order.paid", {"n": n}, destination=destination, key="order-7").id
                for n in range(3)
            ]
        OutboxMessage.objects.filter(id__in=[ids[n] for n in abandon]).update(
            status=OutboxMessage.Status.ABANDONED, abandoned_at=timezone.now()
        )
        try:
            call_command("outbox_skip", "--id", str(ids[1]))
        except CommandError as exc:
            return error_line(exc)
    raise AssertionError("outbox_skip skipped a row that is not its key's head")


@case("skip-pending")
def skip_pending(request: object) -> str:
    return _skip(0)


@case("skip-not-head")
def skip_not_head(request: object) -> str:
    return _skip(0, 1)
