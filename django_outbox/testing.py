"""Helpers for testing code that stages events, the way ``django.core.mail.outbox`` serves e-mail.

``captured_events()``
    A context manager yielding a list that fills with the events committed
    inside the block; events of a rolled-back transaction never appear.
``drain(using="default")``
    Relays every due row in-process through the in-memory transport
    (:class:`~django_outbox.transports.memory.MemoryTransport`, no broker) and
    returns the published events, in publish order; the rows end PUBLISHED (deleted
    with ``PUBLISHED_RETENTION`` 0).

``run_tasks(using="default")``
    (Django 6) Runs the Django tasks enqueued on the outbox task backend, in-process,
    through the runner a Celery worker uses, and returns their results.

``captured_events()`` and ``drain()`` give :class:`OutboxEvent` objects: a
:class:`~django_outbox.ReceivedEvent` (the payload decoded, every wire header, as a
consumer's handler gets it) that also says its ``destination``. The pytest plugin
(``django_outbox.pytest_plugin``) offers the three as the ``outbox`` fixture.

Under Django's ``TestCase`` (and pytest-django's ``django_db`` without
``transaction=True``) the test's transaction never commits, so
``event_committed`` is never sent. An event counts as committed there when the
transaction that staged it has closed into the test's own transaction: its
on-commit callback is still waiting, under no open savepoint but the test's.
In a test that really commits (``TransactionTestCase``, ``transaction=True``)
the ``event_committed`` signal says it.

This module imports no model at import time.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from django.db import connections
from django.utils import timezone

from .envelope import ClaimedMessage, OutboxEvent
from .exceptions import OutboxConfigurationError, OutboxError
from .signals import event_committed
from .staging.stage import _committed

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.tasks import TaskResult

    from .models import OutboxMessage

__all__ = ["Outbox", "OutboxEvent", "captured_events", "drain", "run_tasks"]

#: The worker id :func:`run_tasks` records in a task's ``worker_ids``.
TEST_WORKER = "django_outbox.testing"
#: How many rounds of tasks enqueued by tasks :func:`run_tasks` runs before it gives up.
MAX_TASK_ROUNDS = 100


def _event_from_row(row: OutboxMessage) -> OutboxEvent:
    """The event a staged outbox row becomes once relayed."""
    return OutboxEvent.from_message(
        ClaimedMessage(
            id=row.pk,
            event_id=row.event_id,
            event_type=row.event_type,
            destination=row.destination,
            payload=json.dumps(row.payload, ensure_ascii=False),
            headers=row.headers,
            ordering_key=row.ordering_key,
            attempts=row.attempts,
            created_at=row.created_at,
            sequence=row.sequence,
            skipped=row.skipped_at is not None,
        )
    )


def drain(using: str = "default") -> list[OutboxEvent]:
    """Relay every row of ``using`` that is due, in this process and on this connection,
    through a :class:`~django_outbox.transports.memory.MemoryTransport` of its own that
    keeps every message (Celery routes' too) and sends none anywhere; return the
    published events in publish order.

    The rows end PUBLISHED (or are deleted, with ``PUBLISHED_RETENTION`` 0) and
    ``event_published`` is sent, as with a real relay; rows
    that fail (a destination with no route) are recorded as the relay records them.
    It calls :meth:`Relay.run_once` until nothing is claimed, never :meth:`Relay.run`:
    no LISTEN connection, no database threads, no ``close_old_connections()`` (which
    would close a test's connection). Inside a transaction (``TestCase``) the database
    clock stands still at the transaction's start, before the events were staged: the
    rows due by the wall clock are first made due by the transaction's clock.
    """
    from .conf import outbox_settings
    from .relay.loop import Relay
    from .state import store
    from .transports.memory import MemoryTransport

    if connections[using].in_atomic_block:
        store.backdate_due(using, timezone.now())
    _require_route_brokers()
    published: list[tuple[str | None, OutboxEvent]] = []
    transport = MemoryTransport(store=published)
    # Every broker (configured or named by a route) and the Celery routes: all go to the
    # one store, so no broker's URL or driver package is needed.
    aliases = {"celery", *outbox_settings.broker_aliases(), *outbox_settings.brokers}
    with Relay(using, transports=dict.fromkeys(aliases, transport)) as relay:
        while relay.run_once().claimed:
            pass
    return [event for _, event in published]


def run_tasks(using: str = "default") -> list[TaskResult]:
    """Run the Django tasks enqueued on the outbox task backend and due on ``using``,
    in this process, and return their results (``TaskResult``), in the order they ran.

    It relays every due row as :func:`drain` does, then gives each task message to
    :func:`django_outbox.tasks.runner.run`, the code a Celery worker runs: the task runs
    once, in a transaction with its outcome, and its record ends SUCCESSFUL or FAILED
    (a failure is a result, not an exception here). Tasks those tasks enqueue run too,
    round after round; a task that enqueues itself without end raises
    :class:`~django_outbox.exceptions.OutboxError` after :data:`MAX_TASK_ROUNDS` rounds. The events
    that are not tasks are relayed to the in-memory store and not returned: a test that
    reads them calls :func:`drain` first. Django 6.0+ (``django.tasks``)."""
    from django.tasks import task_backends

    from .conf.routes import TASKS_PREFIX
    from .tasks.runner import run

    ran: list[OutboxEvent] = []
    for _round in range(MAX_TASK_ROUNDS):
        tasks = [e for e in drain(using) if e.destination.startswith(TASKS_PREFIX)]
        if not tasks:
            return [task_backends[e.payload["backend"]].get_result(str(e.event_id)) for e in ran]
        for event in tasks:
            run(event.payload, str(event.event_id), TEST_WORKER)
        ran += tasks
    raise OutboxError(
        f"run_tasks(): the tasks kept enqueuing tasks for {MAX_TASK_ROUNDS} rounds "
        f"({len(ran)} ran): does a task enqueue itself?"
    )


def _require_route_brokers() -> None:
    """:class:`OutboxConfigurationError` (E015's text) for a route naming a broker
    alias that the configured brokers lack, as the relay raises it, so a typo fails the
    test, not production. With no broker configured at all (test settings without one)
    every alias is the in-memory store's."""
    from .conf import CHECK_IDS, outbox_settings, route_problems

    brokers = outbox_settings.brokers
    if not brokers:
        return
    for problem in route_problems(outbox_settings.ROUTES, brokers, default_route=False):
        if problem.id == CHECK_IDS["unknown_broker"]:
            raise OutboxConfigurationError(f"{problem.id}: {problem.msg} {problem.hint}")


class Outbox:
    """What the pytest ``outbox`` fixture gives: :attr:`captured`, the events committed
    on any database since :meth:`start` (read it at any time), and :meth:`drain`."""

    def __init__(self, committed: list[OutboxEvent] | None = None) -> None:
        #: Events ``event_committed`` announced, appended as they commit.
        self._committed = [] if committed is None else committed
        #: The on-commit callbacks each connection already held: not this capture's.
        self._before: dict[str, list[Any]] = {}

    def start(self) -> None:
        """Begin capturing: events committed from now on count."""
        self._before = {c.alias: list(c.run_on_commit) for c in _open_connections()}
        event_committed.connect(self._on_commit, dispatch_uid=id(self))

    def stop(self) -> None:
        """Stop listening for ``event_committed`` (at the end of the fixture or the block)."""
        event_committed.disconnect(dispatch_uid=id(self))

    def _on_commit(self, *, messages: list[OutboxMessage], **kwargs: Any) -> None:
        self._committed += [_event_from_row(row) for row in messages]

    @property
    def captured(self) -> list[OutboxEvent]:
        """The committed events, in commit order: those the database really committed,
        then those a test's transaction holds (a new list at each read)."""
        seen = set()
        found = []
        for event in self._committed + self._held_by_tests():
            if event.event_id not in seen:  # captureOnCommitCallbacks(execute=True) ran it
                seen.add(event.event_id)
                found.append(event)
        return found

    @staticmethod
    def drain(using: str = "default") -> list[OutboxEvent]:
        """The same as :func:`drain`: relay every due row of ``using`` in-process and
        return the published events, in publish order."""
        return drain(using)

    @staticmethod
    def run_tasks(using: str = "default") -> list[TaskResult]:
        """The same as :func:`run_tasks`: run the enqueued Django tasks in-process."""
        return run_tasks(using)

    def _held_by_tests(self) -> list[OutboxEvent]:
        events = []
        for connection in _open_connections():
            before = self._before.get(connection.alias, [])
            for callback in _test_committed(connection):
                if not any(callback is old for old in before):
                    rows = _staged_rows(callback[1])
                    events += [_event_from_row(row) for row in rows]
        return events


@contextlib.contextmanager
def captured_events() -> Iterator[list[OutboxEvent]]:
    """Yield a list of the events committed inside the block.

    Events whose transaction really commits are appended as it commits. Under a
    test's transaction that never commits (``TestCase``), the list is completed when
    the block exits, like ``captureOnCommitCallbacks``: assert after the block.
    Rolled-back events never appear.
    """
    events: list[OutboxEvent] = []
    capture = Outbox(events)
    capture.start()
    try:
        yield events
    finally:
        capture.stop()
        events[:] = capture.captured


def _open_connections() -> list[BaseDatabaseWrapper]:
    return list(connections.all(initialized_only=True))


def _test_committed(connection: BaseDatabaseWrapper) -> list[Any]:
    """The on-commit callbacks of ``connection`` whose transaction has closed into a
    test's (``TestCase``) transaction: the ones it would run if that committed."""
    # Django marks the atomic blocks TestCase opens (a private attribute).
    flags = [getattr(block, "_from_testcase", False) for block in connection.atomic_blocks]
    tests = len(list(itertools.takewhile(bool, flags)))
    if not tests:
        return []
    # savepoint_ids runs parallel to atomic_blocks[1:] (the outermost has no savepoint).
    open_ids = set(connection.savepoint_ids)
    test_ids = set(connection.savepoint_ids[: tests - 1])
    return [
        callback
        for callback in connection.run_on_commit
        if (callback[0] & open_ids) <= test_ids and _staged_rows(callback[1])
    ]


def _staged_rows(func: Any) -> list[OutboxMessage]:
    """The rows a staging on-commit callback signals (``staging._insert`` registers a
    ``partial(_committed, rows, using)``); [] for any other callback."""
    if isinstance(func, functools.partial) and func.func is _committed:
        return list(func.args[0])
    return []
