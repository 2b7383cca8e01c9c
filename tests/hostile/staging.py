"""Triggers for the "Staging" section of docs/hostile-input.md."""

from __future__ import annotations

import datetime as dt

from django.db import transaction
from django.test import override_settings

from django_outbox import StagingError, publish_on_success, stage

from . import case, error_line


def _staged(event_type: str = "order.placed", payload: object = None, **kwargs: object) -> str:
    """Stage inside a transaction that is rolled back; the refusal's line."""
    kwargs.setdefault("destination", "orders")
    try:
        with transaction.atomic():
            stage(event_type, {"id": 1} if payload is None else payload, **kwargs)  # type: ignore[arg-type]
            transaction.set_rollback(True)
    except StagingError as exc:
        return error_line(exc)
    raise AssertionError("stage() accepted the event")


@case("not-in-transaction")
def not_in_transaction(request: object) -> str:
    try:
        stage("order.placed", {"id": 1}, destination="orders")
    except StagingError as exc:
        return error_line(exc)
    raise AssertionError("stage() ran outside a transaction")


@case("payload-not-json")
def payload_not_json(request: object) -> str:
    return _staged(payload={"ids": {1, 2}})


@case("payload-nan")
def payload_nan(request: object) -> str:
    return _staged(payload={"total": float("nan")})


@case("bad-destination")
def bad_destination(request: object) -> str:
    return _staged(destination="no such place")


@case("unknown-destination")
def unknown_destination(request: object) -> str:
    with override_settings(OUTBOX={"BROKER_URL": "memory://", "DEFAULT_ROUTE": False}):
        return _staged(destination="nowhere")


@case("reserved-header")
def reserved_header(request: object) -> str:
    return _staged(headers={"event_id": "mine"})


@case("compression-header")
def compression_header(request: object) -> str:
    return _staged(headers={"compression": "application/x-gzip"})


@case("broker-header")
def broker_header(request: object) -> str:
    return _staged(headers={"x-delivery-count": 40})


@case("keyless-ordered-event")
def keyless_ordered_event(request: object) -> str:
    routes = {"orders": {"exchange": "shop", "queue": "orders", "ordered": True}}
    with override_settings(OUTBOX={"BROKER_URL": "memory://", "ROUTES": routes}):
        return _staged()


@case("keyless-default-ordered")
def keyless_default_ordered(request: object) -> str:
    with override_settings(OUTBOX={"BROKER_URL": "memory://", "DEFAULT_ORDERED": True}):
        return _staged()


@case("naive-available-at")
def naive_available_at(request: object) -> str:
    return _staged(available_at=dt.datetime(2030, 1, 1))  # naive on purpose: the case


@case("publish-mapper-signature")
def publish_mapper_signature(request: object) -> str:
    @publish_on_success("order.placed", destination="orders", payload=lambda order: {})
    def place_order(customer: str, total: int) -> int:
        return 1

    try:
        place_order("ada", 20)
    except TypeError as exc:
        return error_line(exc)
    raise AssertionError("publish_on_success called the payload")
