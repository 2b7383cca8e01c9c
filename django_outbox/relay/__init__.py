"""The relay: claims due rows and publishes them, batch after batch.

:mod:`.loop` is the :class:`Relay` (its loop, a batch's publish and the outages it
rides out), :mod:`.pipeline` claims the next batches while one publishes,
:mod:`.wakeup` waits for work (LISTEN/NOTIFY or the poll interval), :mod:`.retention`
deletes finished rows past their retention, and :mod:`.failures` counts why rows were
not published for the relay's log. It may import the row's life (:mod:`django_outbox.state`,
:mod:`django_outbox.db`), the workers' shared parts (:mod:`django_outbox.workers`), the
transports, the settings and the leaves; nothing that operates it (``ops``, the admin,
the commands) and nothing of the consuming side.
"""

from .loop import BatchStats, Relay, RunStats

__all__ = ["BatchStats", "Relay", "RunStats"]
