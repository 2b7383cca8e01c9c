"""The consumer's parts for each broker, by the scheme of the broker's URL: the run that
consumes a queue and the replay of its parked messages. kombu's serve every scheme not
named here. Each part is named by import path, as its module builds on :mod:`.loop` or
:mod:`.replay`, which look them up here."""

from __future__ import annotations

import dataclasses

from ..conf.brokers import KAFKA_SCHEME, NATS_SCHEMES, broker_scheme


@dataclasses.dataclass(frozen=True)
class Parts:
    """A broker's run and replay, each an import path."""

    #: The class of one run: made with the :class:`~.loop.InboxConsumer` and its
    #: ``idle_timeout``; its ``run()`` returns the totals.
    run: str
    #: The replay: called with the broker's URL and options, the parked
    #: :class:`~django_outbox.models.InboxFailure` records of its queues and the
    #: seconds a publish may wait for its confirmation.
    replay: str


#: kombu's brokers (RabbitMQ, Redis ...): every scheme :data:`PARTS` does not name.
KOMBU = Parts(
    run="django_outbox.consumer.loop.ConsumerRun",
    replay="django_outbox.consumer.replay_kombu.replay",
)
#: The brokers kombu does not serve.
PARTS = {
    KAFKA_SCHEME: Parts(
        run="django_outbox.consumer.kafka.KafkaRun",
        replay="django_outbox.consumer.replay_kafka.replay",
    ),
    **dict.fromkeys(
        NATS_SCHEMES,
        Parts(
            run="django_outbox.consumer.nats.JetStreamRun",
            replay="django_outbox.consumer.replay_nats.replay",
        ),
    ),
}


def parts(url: str) -> Parts:
    """The run and the replay of the broker at ``url``."""
    return PARTS.get(broker_scheme(url), KOMBU)
