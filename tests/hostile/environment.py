"""Triggers for the ``from_env()`` rows of the "Settings" section of docs/hostile-input.md."""

from __future__ import annotations

from django_outbox.conf import from_env

from . import case, error_line


def refusal(**variables: str) -> str:
    """The error ``from_env()`` raises for ``variables``."""
    try:
        from_env(variables)
    except Exception as exc:
        return error_line(exc)
    raise AssertionError(f"from_env accepted {variables}")


@case("env-bad-value")
def env_bad_value(request: object) -> str:
    return refusal(OUTBOX_BATCH_SIZE="lots")


@case("env-bad-json")
def env_bad_json(request: object) -> str:
    return refusal(OUTBOX_ROUTES="{orders: {queue: orders}}")


@case("env-broker-url-unquoted-password")
def env_broker_url_unquoted_password(request: object) -> str:
    return refusal(OUTBOX_BROKER_URL="amqp://shop:pa/ss@rabbit:5672//")


@case("env-unset-proxy")
def env_unset_proxy(request: object) -> str:
    return refusal(OUTBOX_BROKER_URL="$RABBIT_URL")


@case("env-infinite-duration")
def env_infinite_duration(request: object) -> str:
    return refusal(OUTBOX_PUBLISHED_RETENTION="inf")
