"""The check ids of the ``OUTBOX`` settings and what a problem with them says.

A :class:`Problem` is the text of one system check (:mod:`django_outbox.ops.checks` turns
it into a ``checks.Error``), and of the :class:`~django_outbox.exceptions.OutboxConfigurationError`
raised when the setting is read. Every id is documented in docs/reference/checks.md.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with ``settings.OUTBOX``; becomes a ``checks.Error``."""

    id: str
    msg: str
    hint: str


CHECK_IDS = {
    "not_a_dict": "django_outbox.E001",
    "unknown_key": "django_outbox.E002",
    "bad_value": "django_outbox.E003",
    "bad_routes": "django_outbox.E004",
    "delay_order": "django_outbox.E005",
    "no_broker": "django_outbox.E006",
    "bad_broker": "django_outbox.E007",
    "celery_no_confirms": "django_outbox.W004",
    # Route shapes (routes.shape_problems; W003, E017 and E018, what a broker cannot
    # carry, transports.capabilities.broker_shape_problems), checked by checks.check_routes:
    "direct_key": "django_outbox.E008",
    "default_exchange_key": "django_outbox.E009",
    "no_queue": "django_outbox.W002",
    "redis_fanout": "django_outbox.W003",
    "malformed_broker": "django_outbox.E010",
    "missing_driver": "django_outbox.E011",
    # kombu's filesystem transport (transports.filesystem), checked by checks.check_brokers:
    "filesystem_folder": "django_outbox.E012",
    "filesystem_split": "django_outbox.W005",
    # OUTBOX["BROKERS"] and the routes that name its aliases:
    "bad_brokers": "django_outbox.E013",
    "broker_twice": "django_outbox.E014",
    "unknown_broker": "django_outbox.E015",
    "missing_celery": "django_outbox.E016",
    # Partition queues of an ordered route:
    "partitions_not_rabbitmq": "django_outbox.E017",
    # A quorum queue or a dead-letter exchange on a broker without queue arguments:
    "queue_type_not_rabbitmq": "django_outbox.E018",
    # The Django tasks backend (taskbackend.OutboxTaskBackend.check):
    "bad_tasks": "django_outbox.E019",
    "tasks_no_skip_locked": "django_outbox.W006",
    "tasks_no_celery_app": "django_outbox.W007",
    # A partitioned outbox against its setting (ops.checks.check_partitioning).
    "partitioning_not_applied": "django_outbox.W008",
    "partitioned_without_sizes": "django_outbox.W009",
    # Kafka routes (transports.capabilities.broker_shape_problems):
    "kafka_keys_elsewhere": "django_outbox.E060",
    "queue_on_kafka": "django_outbox.E061",
    # Kafka OPTIONS librdkafka refuses (transports.kafka.KafkaTransport.problems):
    "kafka_options": "django_outbox.E062",
    # Kafka transactions (capabilities.broker_shape_problems, KafkaTransport.problems):
    "transactional_not_kafka": "django_outbox.E063",
    "kafka_transactional_id": "django_outbox.E064",
    "kafka_transaction_timeout": "django_outbox.E065",
    # NATS JetStream routes (transports.capabilities.broker_shape_problems):
    "jetstream_not_nats": "django_outbox.E070",
    "queue_on_nats": "django_outbox.E071",
    # A NATS broker's OPTIONS (transports.nats.NatsTransport.problems, checks.check_brokers):
    "nats_options": "django_outbox.E072",
    # Imported, not installed (apps.check_installed; staging raises the same text):
    "missing_app": "django_outbox.E050",
    # Signed envelopes (signing):
    "bad_signing_keys": "django_outbox.E035",
    "verify_without_keys": "django_outbox.E036",
}


MISSING_APP = Problem(
    CHECK_IDS["missing_app"],
    '"django_outbox" is not in INSTALLED_APPS: without it there is no outbox table to '
    "stage events in, no relay and no system check of OUTBOX.",
    'Add "django_outbox" to INSTALLED_APPS in your settings, then run manage.py migrate.',
)

NO_BROKER = Problem(
    CHECK_IDS["no_broker"],
    "No broker URL: the outbox relay has nowhere to publish.",
    'Set OUTBOX["BROKER_URL"] (a kombu URL such as amqp://guest:guest@localhost//) '
    "or CELERY_BROKER_URL.",
)
