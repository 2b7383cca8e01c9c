"""The consuming side of broker routes: ``run_outbox_consumer``'s library.

:mod:`.loop` is the :class:`InboxConsumer` (a queue's messages through a handler, once
each, with backoff, parking and ordered holding), and :mod:`.replay` sends parked
messages back to their queue. It may import the inbox (:mod:`django_outbox.inbox`),
the workers' shared parts, the transports' broker connections, the settings and the
leaves; never the relay or what operates it.
"""

from .loop import ConsumerStats, InboxConsumer

__all__ = ["ConsumerStats", "InboxConsumer"]
