"""Triggers for the sections "Text PostgreSQL cannot store" and "Payload size" of
docs/hostile-input.md."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from django_outbox import StagingError, stage

from . import case, error_line
from .settings import check_lines, only


def _refusal(event_type: str = "order.placed", payload: object = None, **kwargs: Any) -> str:
    """Stage on PostgreSQL inside a transaction that goes on after the refusal and is
    then rolled back; the refusal's line."""
    with transaction.atomic():
        try:
            payload = {"id": 1} if payload is None else payload
            stage(event_type, payload, destination="orders", **kwargs)
        except StagingError as exc:
            line = error_line(exc)
        else:
            raise AssertionError("stage() accepted the event")
        stage("order.placed", {"id": 2}, destination="orders")  # the transaction is usable
        transaction.set_rollback(True)
    return line


@case("payload-nul")
def payload_nul(request: object) -> str:
    return _refusal(payload={"note": "a\x00b"})


@case("payload-surrogate")
def payload_surrogate(request: object) -> str:
    return _refusal(payload={"name": "\ud800"})


@case("header-nul")
def header_nul(request: object) -> str:
    return _refusal(headers={"x-trace\x00": "t-1"})


@case("key-nul")
def key_nul(request: object) -> str:
    return _refusal(key="order-\x001")


@case("event-type-surrogate")
def event_type_surrogate(request: object) -> str:
    return _refusal("order.\udcff")


@case("payload-too-large")
def payload_too_large(request: object) -> str:
    return _refusal(payload={"blob": "x" * 1024 * 1024})


@case("max-payload-bytes-bad-value")
def max_payload_bytes_bad_value(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", MAX_PAYLOAD_BYTES="1 MiB"))


@case("max-batch-bytes-bad-value")
def max_batch_bytes_bad_value(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", MAX_BATCH_BYTES=0))


@case("header-big-number")
def header_big_number(request: object) -> str:
    return _refusal(headers={"x-count": 2**64})


@case("headers-too-large")
def headers_too_large(request: object) -> str:
    return _refusal(headers={"x-big": "x" * 200_000})
