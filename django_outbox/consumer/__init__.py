"""The consuming side of broker routes: ``run_outbox_consumer``'s library.

:mod:`.loop` is the :class:`InboxConsumer` (what to consume and how) and its run, the
kombu loop (:class:`~.loop.ConsumerRun`), or on a Kafka topic :mod:`.kafka` (a
consumer group's run, each record adapted to the message the parts below read); the run
hands each message to
:mod:`.handling`, which decodes it (:mod:`.decode`), runs an ordered route's events in
their key's turn (:mod:`.ordered`), counts deliveries (:mod:`.deliveries`), parks or
rejects what it does not run (:mod:`.parking`), keeps messages unacked until their time
(:mod:`.held`) and rides out database outages (:mod:`.outages`); :mod:`.context` is
what they share. :mod:`.nats` pulls from a NATS JetStream broker's durable consumer
through the same handling. :mod:`.replay` sends parked messages back to their queue.

The consumer may import the inbox (:mod:`django_outbox.inbox`), the workers' shared
parts, the transports' broker connections and declarations and the NATS transport's
event loop and client options (never the transport classes), the settings and the
leaves; never the relay or what operates it.
"""

from .context import ConsumerStats
from .loop import InboxConsumer

__all__ = ["ConsumerStats", "InboxConsumer"]
