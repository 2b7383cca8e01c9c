"""Where an event goes: the ``OUTBOX["ROUTES"]`` table and the default route.

This module only parses and describes routes; :mod:`django_outbox.conf` decides
which route a destination takes (``outbox_settings.route_for()``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

#: A destination (and so a default queue name) is 1-255 characters: letters,
#: digits and ``. _ - : /``, starting with a letter or digit.
DESTINATION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,254}")

EXCHANGE_TYPES = ("direct", "topic", "fanout", "headers")
BROKER_KEYS = frozenset({"exchange", "exchange_type", "routing_key", "queue"})
CELERY_KEYS = frozenset({"celery_task"})


def is_valid_destination(value: object) -> bool:
    return isinstance(value, str) and DESTINATION_RE.fullmatch(value) is not None


@dataclasses.dataclass(frozen=True)
class Route:
    """How one destination is published.

    Either a broker route (``exchange`` of ``exchange_type``, ``routing_key``,
    and an optional durable ``queue`` declared and bound to it), or a Celery
    route (``celery_task``: the task name given to ``send_task``).
    """

    destination: str
    exchange: str = ""
    exchange_type: str = "topic"
    routing_key: str = ""
    queue: str | None = None
    celery_task: str | None = None

    @property
    def is_celery(self) -> bool:
        return self.celery_task is not None

    @classmethod
    def default(cls, destination: str, exchange: str) -> Route:
        """The route of a destination not named in ``ROUTES``: nothing is dropped
        before a consumer exists, because the queue is declared with the exchange."""
        return cls(destination, exchange, "topic", destination, destination)


def parse_routes(value: object, default_exchange: str) -> dict[str, Route]:
    """Turn the ``ROUTES`` setting into :class:`Route` objects.

    Raises ``ValueError`` with a one-line reason naming the offending route.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"must be a dict of destination -> route dict; got {type(value).__name__}")
    return {name: _parse_route(name, spec, default_exchange) for name, spec in value.items()}


def _parse_route(name: object, spec: object, default_exchange: str) -> Route:
    if not is_valid_destination(name):
        raise ValueError(
            f"route name {name!r} is not a valid destination "
            f"(1-255 characters of letters, digits and ._:/-)"
        )
    assert isinstance(name, str)
    if not isinstance(spec, Mapping):
        raise ValueError(f"route {name!r} must be a dict; got {type(spec).__name__}")
    keys = set(spec)
    unknown = keys - BROKER_KEYS - CELERY_KEYS
    if unknown:
        raise ValueError(f"route {name!r} has unknown keys {sorted(unknown)}")
    if keys & CELERY_KEYS and keys & BROKER_KEYS:
        raise ValueError(
            f"route {name!r} mixes celery_task with {sorted(keys & BROKER_KEYS)}; "
            "use one or the other"
        )
    for key, val in spec.items():
        if not isinstance(val, str) and not (key == "queue" and val is None):
            raise ValueError(
                f"route {name!r} key {key!r} must be a string; got {type(val).__name__}"
            )
    if "celery_task" in spec:
        if not spec["celery_task"]:
            raise ValueError(f"route {name!r} has an empty celery_task")
        return Route(name, celery_task=spec["celery_task"])
    exchange_type = spec.get("exchange_type", "topic")
    if exchange_type not in EXCHANGE_TYPES and not exchange_type.startswith("x-"):
        raise ValueError(
            f"route {name!r} exchange_type must be one of {', '.join(EXCHANGE_TYPES)} "
            f"or a plugin type starting with x-; got {exchange_type!r}"
        )
    return Route(
        name,
        exchange=spec.get("exchange", default_exchange),
        exchange_type=exchange_type,
        routing_key=spec.get("routing_key", name),
        queue=spec.get("queue") or None,
    )
