"""Triggers for the CloudEvents rows of docs/hostile-input.md: CloudEvents the consumer
refuses (real messages on the test RabbitMQ, consumed by ``InboxConsumer`` in this
process), and the envelope on a Celery route."""

from __future__ import annotations

import base64
import json
import uuid
from typing import Any

from django.conf import settings
from django.test import override_settings

from . import case
from .consumer import event, rejected
from .settings import check_lines, only


def binary(**changes: Any) -> dict[str, Any]:
    """A CloudEvent in RabbitMQ's binary mode, ``changes`` applied to its headers (a
    value None drops that header)."""
    headers = {
        "ce-specversion": "1.0",
        "ce-id": str(uuid.uuid4()),
        "ce-source": "urn:billing",
        "ce-type": "invoice.paid",
        **changes,
    }
    return {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "headers": {name: value for name, value in headers.items() if value is not None},
    }


def structured(body: bytes) -> str:
    return rejected(body, content_type="application/cloudevents+json", content_encoding="utf-8")


def document(**members: Any) -> bytes:
    event = {"specversion": "1.0", "id": str(uuid.uuid4()), "source": "urn:billing"}
    return json.dumps({**event, "type": "invoice.paid", **members}).encode()


@case("cloudevent-no-id")
def no_id(request: object) -> str:
    return rejected(b'{"n": 1}', **binary(**{"ce-id": None}))


@case("cloudevent-specversion")
def specversion(request: object) -> str:
    return rejected(b'{"n": 1}', **binary(**{"ce-specversion": "0.3"}))


@case("cloudevent-not-json")
def not_json(request: object) -> str:
    return structured(b'{"specversion": "1.0", "id": ')


@case("cloudevent-data-base64")
def data_base64(request: object) -> str:
    return structured(document(data_base64=base64.b64encode(b"\x00\x01").decode()))


@case("cloudevent-too-large")
def too_large(request: object) -> str:
    with override_settings(OUTBOX={**settings.OUTBOX, "MAX_PAYLOAD_BYTES": 1024}):
        return structured(document(data={"blob": "x" * 4096}))


@case("consumer-nested-json")
def nested_json(request: object) -> str:
    """In either envelope: Python's JSON decoder raises RecursionError (not ValueError)."""
    message = event(b"[" * 100_000)
    return rejected(message.pop("body"), **message)


@case("cloudevent-celery-route")
def celery_route(request: object) -> str:
    routes = {"billing": {"celery_task": "billing.charge", "envelope": "cloudevents"}}
    return only(check_lines(BROKER_URL="memory://", ROUTES=routes))
