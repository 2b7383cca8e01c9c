"""The chaos consumer's handler (``run_outbox_consumer --handler chaos.handlers.record``)."""

from __future__ import annotations

import os
import time

from django_outbox import ReceivedEvent

from .models import Handled

#: Seconds the handler holds its transaction open after writing, so that a kill
#: lands mid-handler often enough to be aimed at.
HOLD = 0.001


def record(event: ReceivedEvent) -> None:
    """One ``Handled`` row per run, in the inbox's transaction."""
    Handled.objects.create(event_id=event.event_id, pid=os.getpid())
    time.sleep(HOLD)
