"""Django settings of every chaos process: the runner, producers, relays, the consumers,
the task worker.

``CHAOS_DATABASE_URL`` is the suite's own database (created afresh by the runner),
``OUTBOX_BROKER_URL`` its RabbitMQ. ``CHAOS_ROLE`` names the process (``relay-1``,
``consumer`` ...) and leads each log line. With the pid it makes the PostgreSQL
``application_name`` (``relay-1 4242``), so the fault injector sees in
``pg_stat_activity`` what a process is doing, and the outbox triggers know which
process wrote a row.

On Django 6 (``django.tasks``), ``TASKS`` is the outbox's backend, and the ``CELERY_``
settings configure :mod:`chaos.celery_app`: each process's ``OUTBOX_BROKER_URL`` (the
relays', the proxy's), with publisher confirms.
"""

from __future__ import annotations

import os

import environ

from chaos.destinations import (
    CLUSTERED,
    KAFKA,
    KAFKA_ORDERED,
    KAFKA_TRANSACTIONAL,
    NATS,
    NATS_ORDERED,
    NATS_STREAM,
    ORDERED,
    QUEUE,
    REDIS,
    TASK_QUEUE,
    TASKS_UNAVAILABLE,
)

env = environ.Env()

SECRET_KEY = "chaos-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
DEBUG = False
INSTALLED_APPS = ["django_outbox", "chaos"]
#: A URL's query becomes OPTIONS: the pg-failover profiles' two hosts come with
#: ``target_session_attrs=read-write`` and their ``synchronous_commit`` (chaos.failover).
_DATABASE = env.db("CHAOS_DATABASE_URL", default="postgres://postgres@127.0.0.1:55432/outbox_chaos")
DATABASES = {
    "default": {
        **_DATABASE,
        "CONN_MAX_AGE": None,  # daemons keep their connection between idle spells
        "OPTIONS": {
            **_DATABASE.get("OPTIONS", {}),
            "application_name": f"{os.environ.get('CHAOS_ROLE', 'chaos')} {os.getpid()}",
        },
    }
}


#: The ordered destination's route. A process run with CHAOS_ORDERS_NOTHING=1 (one of the
#: relays) has it without "ordered": its settings order no route, so it claims unordered
#: rows alone between whole claims (docs/relay.md), and the faults hit that path too.
ORDERED_ROUTE: dict[str, object] = {"queue": QUEUE, "routing_key": QUEUE, "ordered": True}
#: The NATS destinations' routes (chaos.jetstream: the runner creates their stream), the
#: ordered one under the same rule as ORDERED_ROUTE.
NATS_ROUTE: dict[str, object] = {
    "broker": "nats",
    "stream": NATS_STREAM,
    "replicas": 3,
    "duplicate_window": 600,
}
NATS_ORDERED_ROUTE: dict[str, object] = {**NATS_ROUTE, "ordered": True}
#: The Kafka destinations' routes (the kafka profile: the runner creates their topic).
KAFKA_ROUTE: dict[str, object] = {"broker": "kafka", "topic": env("CHAOS_KAFKA_TOPIC", default="")}
KAFKA_ORDERED_ROUTE: dict[str, object] = {**KAFKA_ROUTE, "ordered": True}
#: The transactional one's, in its own topic: exactly once into it (docs/kafka.md).
KAFKA_TRANSACTIONAL_ROUTE: dict[str, object] = {
    "broker": "kafka",
    "topic": env("CHAOS_KAFKA_TX_TOPIC", default=""),
    "ordered": True,
    "transactional": True,
}
if env.bool("CHAOS_ORDERS_NOTHING", default=False):
    for route in (
        ORDERED_ROUTE,
        NATS_ORDERED_ROUTE,
        KAFKA_ORDERED_ROUTE,
        KAFKA_TRANSACTIONAL_ROUTE,
    ):
        del route["ordered"]
#: Each relay's transactional id is its role's (relay-1 ...): the same across its restarts
#: (the restarted relay fences its zombie and finds its own record), its own among the
#: relays running at once (two sharing one would fence each other). Other processes
#: build no transactional producer.
_ROLE = os.environ.get("CHAOS_ROLE", "chaos")
KAFKA_OPTIONS = {"transactional.id": f"chaos-{_ROLE}"} if _ROLE.startswith("relay") else {}


def _brokers(cluster_url: str, redis_url: str, nats_url: str, kafka_url: str) -> dict[str, object]:
    """The three-node cluster (chaos.cluster) as broker "cluster", and CLUSTERED on a
    quorum queue there; the services' Redis as broker "redis", and REDIS there (the
    redis_oom fault); the NATS JetStream cluster as broker "nats", and NATS and
    NATS_ORDERED there; the Kafka cluster as broker "kafka", and KAFKA, KAFKA_ORDERED and
    KAFKA_TRANSACTIONAL there (when the run names their topics); each only when its URL
    is given."""
    brokers: dict[str, object] = {}
    routes: dict[str, object] = {ORDERED: ORDERED_ROUTE}
    if cluster_url:
        brokers["cluster"] = {"URL": cluster_url}
        route = {"queue": CLUSTERED, "routing_key": CLUSTERED, "queue_type": "quorum"}
        routes[CLUSTERED] = {**route, "broker": "cluster"}
    if redis_url:
        brokers["redis"] = {"URL": redis_url}
        routes[REDIS] = {"queue": REDIS, "routing_key": REDIS, "broker": "redis"}
    if nats_url:
        brokers["nats"] = {"URL": nats_url}
        routes.update({NATS: NATS_ROUTE, NATS_ORDERED: NATS_ORDERED_ROUTE})
    if kafka_url and KAFKA_ROUTE["topic"]:
        brokers["kafka"] = {"URL": kafka_url, "OPTIONS": KAFKA_OPTIONS}
        routes.update({KAFKA: KAFKA_ROUTE, KAFKA_ORDERED: KAFKA_ORDERED_ROUTE})
        routes[KAFKA_TRANSACTIONAL] = KAFKA_TRANSACTIONAL_ROUTE
    return {"BROKERS": brokers, "ROUTES": routes} if brokers else {}


#: The key every chaos relay signs with (a test run's, not a secret).
SIGNING_KEY = "chaos-signing-key-of-32-bytes-or-more"
#: The knobs are the runner's (its profile), passed as JSON: a short lease so that a
#: killed relay's rows come back within seconds, quick retries, and room for many
#: failed attempts, so that a long broker outage cannot exhaust MAX_ATTEMPTS.
OUTBOX = {
    "BROKER_URL": env("OUTBOX_BROKER_URL", default="amqp://guest:guest@127.0.0.1:55672//"),
    "DEFAULT_EXCHANGE": "chaos",
    "ROUTES": {ORDERED: ORDERED_ROUTE},
    **_brokers(
        env("OUTBOX_CLUSTER_URL", default=""),
        env("OUTBOX_REDIS_URL", default=""),
        env("OUTBOX_NATS_URL", default=""),
        env("OUTBOX_KAFKA_URL", default=""),
    ),
    # The relays sign, the consumers park what is not signed: see chaos.producer's forger.
    "SIGNING_KEYS": [SIGNING_KEY],
    "VERIFY_SIGNATURES": True,
    **env.json("CHAOS_OUTBOX", default={}),
}
if TASKS_UNAVAILABLE is None:
    TASKS = {
        "default": {"BACKEND": "django_outbox.tasks.OutboxTaskBackend", "QUEUES": [TASK_QUEUE]}
    }
    CELERY_BROKER_URL = OUTBOX["BROKER_URL"]
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
    CELERY_WORKER_HIJACK_ROOT_LOGGER = False  # LOGGING below, as every chaos process's
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"action": {"()": "chaos.logs.ActionFilter"}},
    "formatters": {
        "line": {
            "format": "%(asctime)s %(role)s pid=%(process)d %(levelname)s [%(action)s] %(message)s"
        }
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "line", "filters": ["action"]}
    },
    # Not propagated: the task worker's Celery puts a handler of its own on the root logger.
    "loggers": {
        name: {"handlers": ["console"], "level": "INFO", "propagate": False}
        for name in ("django_outbox", "django.tasks", "celery")
    },
}
