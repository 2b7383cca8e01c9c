"""Triggers for the "Secrets" and "Missing optional packages" sections of
docs/hostile-input.md."""

from __future__ import annotations

import sys
from unittest import mock

from django.test import override_settings

from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay

from ..support import AMQP_URL, REDIS_URL, stage_events
from . import case, error_line
from .settings import check_lines, only

PASSWORD = "s3cr#t?/@pw"  # pasted into the URL as it is, not percent-encoded
AMQP_HOST = AMQP_URL.split("@", 1)[1]


def _check(url: object) -> str:
    return only(check_lines(BROKER_URL=url))


def _relay_start(url: str) -> str:
    with override_settings(OUTBOX={"BROKER_URL": url}):
        try:
            Relay().close()
        except OutboxConfigurationError as exc:
            return error_line(exc)
    raise AssertionError("the relay started")


def _without(package: str) -> mock._patch[dict[str, object]]:
    """``import package`` fails as if it were not installed. The test venv has redis
    (the Redis tests need it), so its absence is simulated; the subprocess test in
    tests/integration/test_secrets.py blocks it the same way at interpreter start-up."""
    return mock.patch.dict(sys.modules, {package: None})


@case("broker-url-unquoted-password")
def unquoted_password(request: object) -> str:
    return _check(f"amqp://guest:{PASSWORD}@{AMQP_HOST}")


@case("broker-url-not-a-url")
def not_a_url(request: object) -> str:
    return _check(f"amqp//guest:{PASSWORD}@{AMQP_HOST}")


@case("broker-url-no-host")
def no_host(request: object) -> str:
    return _check("amqp://guest:s3cret")


@case("broker-url-wrong-type")
def wrong_type(request: object) -> str:
    return _check([f"amqp://guest:{PASSWORD}@{AMQP_HOST}"])


@case("relay-malformed-broker-url")
def relay_malformed(request: object) -> str:
    return _relay_start(f"amqp://guest:{PASSWORD}@{AMQP_HOST}")


@case("broker-wrong-password")
def wrong_password(request: object) -> str:
    stage_events(1, "orders")
    with override_settings(OUTBOX={"BROKER_URL": f"amqp://guest:wrong-pw@{AMQP_HOST}"}):
        with Relay() as relay:
            relay.run_once()
    return OutboxMessage.objects.get().last_error


@case("missing-redis")
def missing_redis(request: object) -> str:
    with _without("redis"):
        return _check(REDIS_URL)


@case("missing-redis-relay")
def missing_redis_relay(request: object) -> str:
    with _without("redis"):
        return _relay_start(REDIS_URL)


@case("missing-transport-package")
def missing_boto3(request: object) -> str:
    """boto3 is really missing from the test venv."""
    return _check("sqs://AKIA:s3cret@")


@case("missing-package-kombu-names")
def missing_pgmq(request: object) -> str:
    """pgmq is really missing from the test venv."""
    return _check("pgmq://u:s3cret@localhost/db")
