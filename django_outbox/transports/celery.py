"""Routes with ``celery_task``: the event becomes a Celery task message.

Sent with the configured Celery app's ``send_task``: task name from the route,
``kwargs`` = the payload (so it must be a JSON object), task id = event id (the
inbox dedupes on it), serializer JSON whatever the app's ``task_serializer``, and
the wire headers. Celery reads its own fields (the task name, the id ...) from
the same headers, so a user header named like one (``routes.CELERY_FIELDS``) is
refused: at stage time, and here for a row staged before its destination became a
Celery route. The app's broker and its ``broker_transport_options`` apply (set
``confirm_publish`` there for confirms; a nack then fails that message alone).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import amqp.exceptions  # type: ignore[import-untyped]
import kombu.exceptions

from .. import tracing
from ..conf.routes import CELERY_FIELDS, TASK_RUNNER, Route, celery_header_clash
from ..envelope import ClaimedMessage
from .amqp_frames import check_content_header
from .base import NACKED, Failure, Outcome, Transport
from .confirms import lease_confirm_timeout
from .connection import transient_failure
from .redis_wire import probe_writes

TRANSIENT = (kombu.exceptions.OperationalError, OSError)
#: Celery's producers come from kombu's process-wide pool, keyed by broker URL, so a
#: connection the broker dropped (a restart) can still be in it: one immediate
#: reconnect-and-retry revives it. Anything longer is the relay's backoff to decide.
RECONNECT_ONCE = {"max_retries": 1, "interval_start": 0, "interval_step": 0, "interval_max": 0}


#: Django task priorities (-100 to 100) fall into this many broker priorities, 0 to 9:
#: RabbitMQ's for a queue declared with ``x-max-priority`` 10 (higher first), Redis's with
#: kombu's ``priority_steps`` (lower first). See docs/tasks.md.
BROKER_PRIORITIES = 10


def broker_priority(priority: object, *, lowest_first: bool) -> int:
    """The broker priority of a Django task's ``priority``: bands of 20 (-100 to -81 is
    the lowest, 80 to 100 the highest), 0 to 9, reversed where the broker takes the
    lowest number first. A value that is not a whole number -100..100 counts as 0."""
    if not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > 100:
        priority = 0
    band = min(BROKER_PRIORITIES - 1, (priority + 100) // 20)
    return BROKER_PRIORITIES - 1 - band if lowest_first else band


class CeleryTransport(Transport):
    def __init__(self) -> None:
        #: Whether the Celery app's broker takes the lowest priority number first
        #: (Redis); read once, when the first Django task is sent.
        self._lowest_first: bool | None = None
        #: The frame_max the app's RabbitMQ negotiated (0: not RabbitMQ); read once,
        #: when the first task is sent.
        self._frame_max: int | None = None

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for message in messages:
            kwargs = json.loads(message.payload)
            refusal = _refusal(route, message, kwargs)
            if refusal is not None:
                outcomes.append(refusal)
                continue
            try:
                options = self._task_options(route, kwargs)
                self._check_frame(route, message, kwargs, options)
                self._send(route, message, kwargs, options)
            except TRANSIENT as exc:
                if _nacked(exc):  # the broker is up and refused this one: go on
                    outcomes.append(Failure(NACKED, kind="nacked"))
                    continue
                failure = transient_failure(exc)  # a stalled broker is down: no attempt
                return outcomes + [failure] * (len(messages) - len(outcomes))
            except (TypeError, ValueError, kombu.exceptions.EncodeError) as exc:  # FrameTooLarge
                outcomes.append(Failure.from_exception(exc, permanent=True))
            else:
                outcomes.append(None)
        return outcomes

    def _check_frame(
        self, route: Route, message: ClaimedMessage, kwargs: dict[str, Any], options: Any
    ) -> None:
        """On RabbitMQ, raise :class:`~.amqp_frames.FrameTooLarge` for a task whose
        content header (Celery's headers and the event's) does not fit in a frame: the
        broker would close the connection (501), failing every task sent with it. The
        check of the relay's own frames (:func:`~.amqp_frames.check_content_header`)."""
        if self._frame_max is None:
            self._frame_max = _frame_max()
        if self._frame_max:
            size = _task_properties_size(route, message, kwargs, options.get("priority"))
            check_content_header(size, self._frame_max)

    def _send(
        self, route: Route, message: ClaimedMessage, kwargs: dict[str, Any], options: Any
    ) -> None:
        """Send ``message`` as ``route``'s task, in its creation context: the spans of
        Celery's own instrumentation, if installed, continue the event's trace."""
        from celery import current_app  # type: ignore[import-untyped]

        assert route.celery_task is not None

        with tracing.continue_trace(message.headers):
            current_app.send_task(
                route.celery_task,
                kwargs=kwargs,
                task_id=str(message.event_id),
                headers=_headers(message),
                serializer="json",
                confirm_timeout=lease_confirm_timeout(),  # confirm_publish: within the lease
                retry=True,
                retry_policy=RECONNECT_ONCE,
                **options,
            )

    def _task_options(self, route: Route, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``send_task``'s queue (a route with a ``queue``: a Django task queue's) and, for
        a Django task, its broker priority, which rides in the payload; none for a plain
        Celery route, which goes to the app's default queue."""
        options: dict[str, Any] = {} if route.queue is None else {"queue": route.queue}
        if route.celery_task == TASK_RUNNER:
            if self._lowest_first is None:
                self._lowest_first = _driver_type() == "redis"
            priority = kwargs.get("priority")
            options["priority"] = broker_priority(priority, lowest_first=self._lowest_first)
        return options

    def close(self) -> None:
        """The Celery app owns its connection pool."""

    def check(self) -> None:
        """Connect to the app's broker; on Redis, have it take a write too
        (:func:`~.redis_wire.probe_writes`): a relay backing off from a Redis that
        refuses writes resumes once it takes them again."""
        from celery import current_app

        with current_app.connection_for_write() as connection:
            connection.ensure_connection(max_retries=1)
            if connection.transport.driver_type == "redis":
                probe_writes(connection.default_channel.client, connection.channel_errors)


def publishes_unconfirmed() -> bool:
    """Whether the current Celery app publishes to RabbitMQ (an AMQP transport, where
    ``confirm_publish`` applies) without publisher confirms. Connects nowhere."""
    from celery import current_app

    if (current_app.conf.broker_transport_options or {}).get("confirm_publish"):
        return False
    return _driver_type() == "amqp"


def _frame_max() -> int:
    """The frame_max the current Celery app's broker negotiated: 0 unless it is
    RabbitMQ (py-amqp). Connects a connection of the app's pool (the one its sends use)."""
    from celery import current_app

    with current_app.pool.acquire(block=True) as connection:
        if connection.transport.driver_type != "amqp":
            return 0
        connection.ensure_connection(max_retries=1)
        return int(connection.connection.frame_max)


def _task_properties_size(
    route: Route, message: ClaimedMessage, kwargs: dict[str, Any], priority: int | None
) -> int:
    """The bytes of the property list py-amqp writes for ``message`` sent as ``route``'s
    task: the task message Celery builds (its own headers, the task id as correlation id,
    its reply-to), the event's headers, and what kombu's producer adds (a priority only
    where one is given: a Django task's). Compared with py-amqp's on real sends of a
    task route and a Django task: equal, or one byte over."""
    from amqp import Message
    from celery import current_app

    app = current_app
    task = app.amqp.as_task_v2(
        str(message.event_id), route.celery_task, args=(), kwargs=kwargs, reply_to=app.thread_oid
    )
    properties = {
        **task.properties,
        "application_headers": {**task.headers, **_headers(message)},  # py-amqp's name
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "delivery_mode": 2,
        "priority": priority,
    }
    return len(Message(b"", **properties)._serialize_properties())


def _driver_type() -> str:
    """The kind of the current Celery app's broker: "amqp", "redis" ... Connects nowhere."""
    from celery import current_app

    with current_app.connection_for_write() as connection:
        return str(connection.transport.driver_type)


def _refusal(route: Route, message: ClaimedMessage, kwargs: object) -> Failure | None:
    """Why ``message`` can never be sent as a task of ``route`` (a permanent failure)."""
    clash = celery_header_clash(route, message.headers)
    if clash is not None:
        return Failure(clash, permanent=True)
    if not isinstance(kwargs, dict):
        return Failure(
            f"route {route.destination!r} sends Celery task {route.celery_task!r}, "
            f"whose kwargs must be a JSON object; the payload is a {type(kwargs).__name__}",
            permanent=True,
        )
    typed = _kombu_typed(kwargs, "$")
    if typed is not None:
        return Failure(
            f"route {route.destination!r} sends Celery task {route.celery_task!r}, whose worker "
            f"would decode the object at {typed} (keys __type__ and __value__) as another type "
            "or refuse it: kombu's JSON reads such objects so",
            permanent=True,
        )
    return None


def _kombu_typed(value: object, path: str) -> str | None:
    """The path of an object in ``value`` that kombu's JSON decoder, which a Celery
    worker reads task bodies with, would not hand over as sent: one whose keys are
    exactly ``__type__`` and ``__value__`` (a datetime, a Decimal ..., or an error).
    Iterative: a payload nested as deep as JSON allows must not exhaust the stack."""
    stack = [(path, value)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            if value.keys() == {"__type__", "__value__"}:
                return path
            stack.extend((f"{path}.{key}", item) for key, item in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{index}]", item) for index, item in enumerate(value))
    return None


def _headers(message: ClaimedMessage) -> dict[str, object]:
    """The wire headers but those Celery owns: the only one is ``correlation_id``, which a
    Celery worker takes from the message property, the task id, that is the event id."""
    return {k: v for k, v in message.wire_headers().items() if k not in CELERY_FIELDS}


def _nacked(exc: BaseException) -> bool:
    """py-amqp raises ``MessageNacked`` on a nack; kombu treats it as a connection error
    (it reconnects and publishes once more) and raises it as ``OperationalError``."""
    return isinstance(exc.__cause__ or exc, amqp.exceptions.MessageNacked)
