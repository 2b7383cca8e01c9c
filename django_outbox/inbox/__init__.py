"""The inbox: a consumer's record of the events it handled, so a handler runs once.

:mod:`.records` holds :func:`process_once` and :func:`inbox_handler`, the parked
failures and an ordered route's positions. It may import the models, the database
layer (:mod:`django_outbox.db`), the settings and the leaves; the consumer, the Celery
task base and the tasks runner build on it, never the other way round.
"""

from .records import (
    inbox_handler,
    positions_of,
    process_once,
    record_failure,
    start_positions,
)

__all__ = [
    "inbox_handler",
    "positions_of",
    "process_once",
    "record_failure",
    "start_positions",
]
