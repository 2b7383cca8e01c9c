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
#: The task queue of the Django tasks (:mod:`chaos.djtasks`), and the Celery queue the
#: task worker consumes.
TASK_QUEUE = "chaos.tasks"
#: Why this run has no Django tasks (None: it has them): ``django.tasks`` is Django 6.0+.
TASKS_UNAVAILABLE = (
    None
    if importlib.util.find_spec("django.tasks") is not None
    else f"Django {django.get_version()} has no django.tasks (Django 6.0+)"
)
