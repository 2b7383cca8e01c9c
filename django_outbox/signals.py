"""Signals sent by django_outbox.

``event_committed``
    Sent once per ``stage()``/``stage_many()`` call, after the outermost
    transaction that staged the events committed (through
    ``transaction.on_commit``); never when it rolled back. Keyword arguments:
    ``messages`` (list of the staged ``OutboxMessage`` rows) and ``using`` (the
    database alias). Receivers run after the commit, so an exception in one is
    logged and does not reach the caller of the business code.
"""

from __future__ import annotations

from django.dispatch import Signal

event_committed = Signal()
