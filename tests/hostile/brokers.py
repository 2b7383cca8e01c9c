"""Triggers for the "Brokers" section of docs/hostile-input.md: OUTBOX["BROKERS"], the
routes that name its aliases, and Celery routes without the celery package."""

from __future__ import annotations

from django.test import override_settings

from django_outbox.exceptions import OutboxConfigurationError
from django_outbox.relay import Relay

from ..support import AMQP_URL, REDIS_URL
from . import case, error_line
from .secrets import PASSWORD, _without
from .settings import check_lines, only

AMQP_HOST = AMQP_URL.split("@", 1)[1]
CELERY_ROUTES = {"emails": {"celery_task": "shop.tasks.send_receipt"}}


@case("brokers-not-a-dict")
def not_a_dict(request: object) -> str:
    return only(check_lines(BROKERS=[f"amqp://guest:{PASSWORD}@{AMQP_HOST}"]))


@case("broker-without-url")
def without_url(request: object) -> str:
    return only(check_lines(BROKERS={"events": {"OPTIONS": {"password": PASSWORD}}}))


@case("broker-unknown-key")
def unknown_key(request: object) -> str:
    return only(check_lines(BROKERS={"events": {"URL": "memory://", "OPTION": {}}}))


@case("broker-malformed-url")
def malformed_url(request: object) -> str:
    url = f"amqp://guest:{PASSWORD}@{AMQP_HOST}"
    return only(check_lines(BROKER_URL="memory://", BROKERS={"events": {"URL": url}}))


@case("broker-missing-redis")
def missing_redis(request: object) -> str:
    with _without("redis"):
        return only(check_lines(BROKER_URL="memory://", BROKERS={"events": {"URL": REDIS_URL}}))


@case("broker-set-twice")
def set_twice(request: object) -> str:
    return only(check_lines(BROKER_URL="memory://", BROKERS={"default": {"URL": "memory://"}}))


@case("route-unknown-broker")
def unknown_alias(request: object) -> str:
    return only(
        check_lines(
            BROKER_URL="memory://", ROUTES={"orders": {"broker": "events", "queue": "orders"}}
        )
    )


@case("celery-not-installed")
def celery_missing(request: object) -> str:
    # TASKS off: on Django 6 the tasks backend of the test settings would say it too.
    with _without("celery"), override_settings(TASKS={}):
        return only(check_lines(BROKER_URL="memory://", ROUTES=CELERY_ROUTES))


@case("celery-not-installed-relay")
def celery_missing_relay(request: object) -> str:
    with (
        _without("celery"),
        override_settings(OUTBOX={"BROKER_URL": "memory://", "ROUTES": CELERY_ROUTES}),
    ):
        try:
            Relay().close()
        except OutboxConfigurationError as exc:
            return error_line(exc)
    raise AssertionError("the relay started")
