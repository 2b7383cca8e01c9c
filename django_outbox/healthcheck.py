"""The outbox's health check for django-health-check (4.x): list
``"django_outbox.healthcheck.OutboxHealthCheck"`` in ``HealthCheckView``'s ``checks``,
or ``("django_outbox.healthcheck.OutboxHealthCheck", {"using": "other"})``."""

from __future__ import annotations

import dataclasses

from django.db import DatabaseError, connections

try:
    from health_check.base import HealthCheck
    from health_check.exceptions import ServiceUnavailable
except ImportError as exc:  # pragma: no cover - said by a test in a venv without it
    raise ImportError(
        "django_outbox.healthcheck needs django-health-check: "
        "pip install 'django-transactional-outbox[health]'"
    ) from exc

from .ops.health import check_health


@dataclasses.dataclass
class OutboxHealthCheck(HealthCheck):
    """Unavailable when :func:`~django_outbox.ops.health.check_health` finds a problem
    (the oldest due row too old, no live relay) or the database cannot be read."""

    using: str = "default"
    max_due_age: float | None = None
    require_relay: bool = True

    def run(self) -> None:
        try:
            outcome = check_health(
                self.using, max_due_age=self.max_due_age, require_relay=self.require_relay
            )
        except DatabaseError as exc:
            raise ServiceUnavailable(f"database {self.using!r} cannot be read") from exc
        finally:
            connections[self.using].close()  # the check's executor thread's own connection
        if not outcome.healthy:
            raise ServiceUnavailable("; ".join(outcome.problems))
