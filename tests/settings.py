"""Settings for the test suite: real PostgreSQL and RabbitMQ started by scripts/services.

Every URL can be overridden from the environment (django-environ):
``DATABASE_URL``, ``OTHER_DATABASE_URL``, ``OUTBOX_BROKER_URL``, ``OUTBOX_REDIS_URL``.
"""

from __future__ import annotations

import environ

env = environ.Env()

SECRET_KEY = "tests-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
DEBUG = False

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.admin",
    "django.contrib.staticfiles",  # the live server serves the admin's CSS to the browser test
    "django_outbox",
    "tests.testapp",
]

_default_db = env.db("DATABASE_URL", default="postgres://postgres@127.0.0.1:55432/outbox")
_other_db = env.db("OTHER_DATABASE_URL", default="postgres://postgres@127.0.0.1:55432/outbox_other")
# The tests' sessions commit without waiting for the WAL to reach the disk: a
# transactional test's teardown TRUNCATEs every table, and most of the layer's time went
# into those flushes. Visibility, locks and SKIP LOCKED are the same; only a crash of the
# server could lose the last commits, and the tests stop PostgreSQL cleanly (pg_ctl's
# fast shutdown writes the WAL out). The benchmark and the chaos suite keep the default, and
# so does a URL that names its own options (the failover test's processes: a commit there
# must have reached the synchronous standby).
for _db in (_default_db, _other_db):
    _db.setdefault("OPTIONS", {}).setdefault("options", "-c synchronous_commit=off")
# "lite" (in-memory SQLite) shows the SQLite-only system check and runs the test helpers
# on SQLite (tests/integration/test_testing.py).
DATABASES = {
    "default": _default_db,
    "other": _other_db,
    # No dependency on "default": a selection of "lite" tests alone can set it up.
    "lite": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": ":memory:",
        "TEST": {"DEPENDENCIES": []},
    },
}

OUTBOX = {
    "BROKER_URL": env("OUTBOX_BROKER_URL", default="amqp://guest:guest@127.0.0.1:55672//"),
    # Relay subprocesses started by tests get their knobs from here (JSON).
    **env.json("OUTBOX_OVERRIDES", default={}),
}
REDIS_URL = env("OUTBOX_REDIS_URL", default="redis://127.0.0.1:56379/0")
# Django's default hasher takes about 0.6 s per user the admin tests create.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "tests.urls"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "django_outbox": {"handlers": ["console"], "level": "INFO"},
        # Django's receivers of task_started and task_finished log there (Django 6).
        "django.tasks": {"handlers": ["console"], "level": "INFO"},
    },
}
# Django 6's tasks framework (django.tasks; Django 5.2 ignores the setting): the outbox's
# backend, any queue name (each test sends to a queue of its own).
TASKS = {"default": {"BACKEND": "django_outbox.tasks.OutboxTaskBackend", "QUEUES": []}}

# The project's Celery app, made current as a project's package makes its own
# (mysite/__init__.py imports mysite/celery.py): the relay sends Celery routes and Django
# tasks through the current app (docs/tasks.md). Tests that need another make it current.
from celery import Celery  # type: ignore[import-untyped]  # noqa: E402

CELERY_APP = Celery("outbox-tests-settings", broker=OUTBOX["BROKER_URL"], set_as_current=True)
CELERY_APP.conf.broker_transport_options = {"confirm_publish": True}  # as docs/tasks.md says
