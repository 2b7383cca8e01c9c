"""The suite's destinations, shared by the runner, its processes and their settings.

Both publish with the routing key ``QUEUE`` to the one queue the consumer reads (and the
tap beside it): ``QUEUE`` itself (``chaos.orders``: keyless, the default route) and
``ORDERED`` (an ordered route whose events carry one of ``ORDERED_KEYS`` keys).
"""

from __future__ import annotations

import importlib.util

import django

QUEUE = "chaos.orders"
ORDERED = "chaos.accounts"
ORDERED_KEYS = 20
#: Keyless, on a quorum queue of the three-node RabbitMQ cluster (broker alias ``cluster``):
#: what the cluster node faults (chaos.cluster) are aimed at.
CLUSTERED = "chaos.cluster"
#: Keyless, on Redis (broker alias ``redis``): the events the runner stages around the
#: ``redis_oom`` fault (chaos.broker). Nobody consumes its queue during a run: the audit
#: reads it at the end, as the single node's tap.
REDIS = "chaos.redis"
#: On the three-node NATS JetStream cluster (broker alias ``nats``), both in the stream
#: ``NATS_STREAM`` (three replicas): ``NATS`` keyless, ``NATS_ORDERED`` an ordered route
#: whose events carry one of ``ORDERED_KEYS`` keys (chaos.jetstream). Nobody consumes the
#: stream during a run: the audit reads it at the end.
NATS = "chaos.nats.orders"
NATS_ORDERED = "chaos.nats.accounts"
NATS_STREAM = "CHAOS_NATS"
#: On the three-node Kafka cluster (broker alias ``kafka``; the ``kafka`` profile only),
#: both in one topic, a plain (not transactional) route: ``KAFKA`` keyless,
#: ``KAFKA_ORDERED`` ordered, over ``ORDERED_KEYS`` keys (chaos.kafka). The topic is named
#: afresh each run (``CHAOS_KAFKA_TOPIC``, set by the runner: its presence turns the Kafka
#: routes on); a consumer of its own reads it during the run, and the audit reads it back
#: at the end.
KAFKA = "chaos.kafka.orders"
KAFKA_ORDERED = "chaos.kafka.accounts"
#: The third, a transactional and ordered route (exactly once into the topic), alone in a
#: topic of its own (``CHAOS_KAFKA_TX_TOPIC``, named afresh with the other), which a
#: consumer of its own reads during the run and the audit reads back at the end: its
#: producer stages half its events keyless, half over ``ORDERED_KEYS`` keys.
KAFKA_TRANSACTIONAL = "chaos.kafka.payments"
#: The task queue of the Django tasks (:mod:`chaos.djtasks`), and the Celery queue the
#: task worker consumes.
TASK_QUEUE = "chaos.tasks"
#: Why this run has no Django tasks (None: it has them): ``django.tasks`` is Django 6.0+.
TASKS_UNAVAILABLE = (
    None
    if importlib.util.find_spec("django.tasks") is not None
    else f"Django {django.get_version()} has no django.tasks (Django 6.0+)"
)
