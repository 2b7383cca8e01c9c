"""Signals sent by django_outbox.

``event_committed``
    Sent once per ``stage()``/``stage_many()`` call, after the outermost
    transaction that staged the events committed (through
    ``transaction.on_commit``); never when it rolled back. Keyword arguments:
    ``messages`` (list of the staged ``OutboxMessage`` rows) and ``using`` (the
    database alias). Receivers run after the commit, so an exception in one is
    logged and does not reach the caller of the business code.

``event_published``, ``event_failed``, ``event_abandoned``
    Sent by the relay once per batch, after the transaction that recorded the
    outcome committed, to receivers in the relay process. Keyword arguments:
    ``messages`` (list of :class:`~django_outbox.envelope.ClaimedMessage`),
    ``using``; the failure signals also get ``errors``, the error text of each
    message, in the same order. A failed row will be retried; an abandoned one
    waits for an operator.
"""

from __future__ import annotations

from django.dispatch import Signal

event_committed = Signal()
event_published = Signal()
event_failed = Signal()
event_abandoned = Signal()
