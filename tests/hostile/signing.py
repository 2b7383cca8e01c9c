"""Triggers for the "Signed envelopes" section of docs/hostile-input.md, and its consumer
lines under "Consumers": real messages on the test RabbitMQ, consumed by ``InboxConsumer``
with signatures verified."""

from __future__ import annotations

import json

from django.conf import settings
from django.core.management import CommandError, call_command
from django.test import override_settings

from django_outbox.envelope import ReceivedEvent
from django_outbox.signing import Keyring

from . import case, error_line
from .consumer import consume, event, logged, queue_with, refuse
from .settings import check_lines, only

KEY = "a-signing-key-of-32-bytes-or-more"


@case("signing-key-short")
def signing_key_short(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", SIGNING_KEYS=["s3cret"]))


@case("signing-keys-not-a-list")
def signing_keys_not_a_list(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", SIGNING_KEYS=KEY))


@case("verify-without-keys")
def verify_without_keys(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", VERIFY_SIGNATURES=True))


@case("consumer-verify-without-keys")
def consumer_verify_without_keys(request: object) -> str:
    try:
        call_command(
            "run_outbox_consumer",
            "--queue=orders",
            "--handler=tests.testapp.handlers.record",
            "--consumer=billing",
            "--verify-signatures",
            skip_checks=True,
        )
    except CommandError as exc:
        return error_line(exc)
    raise AssertionError("run_outbox_consumer started without keys")


def parked_unsigned(message: dict[str, object]) -> str:
    """The consumer's line for ``message``, consumed with signatures verified."""
    with override_settings(OUTBOX={**settings.OUTBOX, "SIGNING_KEYS": [KEY]}):
        with queue_with(message.pop("body"), **message) as queue:  # type: ignore[arg-type]
            run = lambda: consume(queue, refuse, verify_signatures=True)  # noqa: E731
            return logged("inbox.unsigned", run)


@case("consumer-unsigned")
def unsigned(request: object) -> str:
    return parked_unsigned(event())


@case("consumer-bad-signature")
def bad_signature(request: object) -> str:
    message = event(b'{"id": 1}')
    headers = message["headers"]
    signed = ReceivedEvent.from_wire({"id": 1}, headers).envelope(json.dumps({"id": 1}).encode())
    headers["outbox_signature"] = Keyring([KEY.encode()]).sign(signed)
    message["body"] = b'{"id": 2}'  # altered on the way
    return parked_unsigned(message)
