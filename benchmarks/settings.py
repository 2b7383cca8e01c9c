"""Django settings of the benchmark processes (the runner and the workers it starts).

``OUTBOX_BENCH_DATABASE_URL`` is the benchmark's own database, created afresh by the
runner; ``OUTBOX_BROKER_URL`` the RabbitMQ the relay publishes to by default.
"""

from __future__ import annotations

import environ

env = environ.Env()

SECRET_KEY = "benchmarks-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
DEBUG = False
INSTALLED_APPS = ["django_outbox", "benchmarks"]
DATABASES = {
    "default": {
        **env.db(
            "OUTBOX_BENCH_DATABASE_URL", default="postgres://postgres@127.0.0.1:55432/outbox_bench"
        ),
        # A relay is a daemon: it keeps its connection between idle spells.
        "CONN_MAX_AGE": None,
    }
}
#: The ordered route of the ordering scenarios (its queue is deleted after each drain).
ORDERED = "bench-ordered"
#: The ordered route is in every process's settings but the relays of the scenarios that
#: publish no ordered event (``OUTBOX_BENCH_ORDERED=0``): those claim as the relay of a
#: project that orders no route does (``Relay`` picks its claim statement by them).
_ORDERS = env.bool("OUTBOX_BENCH_ORDERED", default=True)
OUTBOX = {
    "BROKER_URL": env("OUTBOX_BROKER_URL", default="amqp://guest:guest@127.0.0.1:55672//"),
    "ROUTES": {ORDERED: {"queue": ORDERED, "ordered": True}} if _ORDERS else {},
}
#: The relays of a drain that keeps no PUBLISHED row (``OUTBOX_BENCH_KEEP_PUBLISHED=0``)
#: delete each row at its confirm.
if not env.bool("OUTBOX_BENCH_KEEP_PUBLISHED", default=True):
    OUTBOX["PUBLISHED_RETENTION"] = 0
#: The relays of a signed drain (``OUTBOX_BENCH_SIGNING_KEY`` set) sign every message.
if signing_key := env.str("OUTBOX_BENCH_SIGNING_KEY", default=""):
    OUTBOX["SIGNING_KEYS"] = [signing_key]
#: The envelope of every route of a CloudEvents drain (``OUTBOX_BENCH_ENVELOPE``).
OUTBOX["DEFAULT_ENVELOPE"] = env.str("OUTBOX_BENCH_ENVELOPE", default="outbox")
#: The destination of a transactional Kafka drain (``OUTBOX_BENCH_TRANSACTIONAL``): its
#: route publishes each batch in a Kafka transaction (docs/kafka.md).
if transactional := env.str("OUTBOX_BENCH_TRANSACTIONAL", default=""):
    OUTBOX["ROUTES"] = {
        **OUTBOX["ROUTES"],
        transactional: {"topic": transactional, "transactional": True},
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_outbox": {"handlers": ["console"], "level": "WARNING"}},
}
