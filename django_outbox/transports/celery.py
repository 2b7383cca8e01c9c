"""Routes with ``celery_task``: the event becomes a Celery task message.

Sent with the configured Celery app's ``send_task``: task name from the route,
``kwargs`` = the payload (so it must be a JSON object), task id = event id (the
inbox dedupes on it), and the wire headers. The app's broker and its
``broker_transport_options`` apply (set ``confirm_publish`` there for confirms).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import kombu.exceptions

from ..envelope import ClaimedMessage
from ..routes import Route
from .base import Failure, Outcome, Transport

TRANSIENT = (kombu.exceptions.OperationalError, OSError)
#: Celery's producers come from kombu's process-wide pool, keyed by broker URL, so a
#: connection the broker dropped (a restart) can still be in it: one immediate
#: reconnect-and-retry revives it. Anything longer is the relay's backoff to decide.
RECONNECT_ONCE = {"max_retries": 1, "interval_start": 0, "interval_step": 0, "interval_max": 0}


class CeleryTransport(Transport):
    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        from celery import current_app  # type: ignore[import-untyped]

        assert route.celery_task is not None
        outcomes: list[Outcome] = []
        for message in messages:
            kwargs = json.loads(message.payload)
            if not isinstance(kwargs, dict):
                outcomes.append(
                    Failure(
                        f"route {route.destination!r} sends Celery task {route.celery_task!r}, "
                        f"whose kwargs must be a JSON object; the payload is a "
                        f"{type(kwargs).__name__}",
                        permanent=True,
                    )
                )
                continue
            try:
                current_app.send_task(
                    route.celery_task,
                    kwargs=kwargs,
                    task_id=str(message.event_id),
                    headers=message.wire_headers(),
                    retry=True,
                    retry_policy=RECONNECT_ONCE,
                )
            except TRANSIENT as exc:
                failure = Failure.from_exception(exc)
                return outcomes + [failure] * (len(messages) - len(outcomes))
            except (TypeError, ValueError, kombu.exceptions.EncodeError) as exc:
                outcomes.append(Failure.from_exception(exc, permanent=True))
            else:
                outcomes.append(None)
        return outcomes

    def close(self) -> None:
        """The Celery app owns its connection pool."""

    def check(self) -> None:
        from celery import current_app

        with current_app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)
