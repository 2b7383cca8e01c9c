"""Settings of the example shop.

With no environment set, it needs no server: SQLite in .demo/db.sqlite3 and kombu's
``filesystem://`` transport in .demo/broker. Set ``DATABASE_URL`` (e.g.
``postgres://postgres@127.0.0.1:55432/outbox``) and ``OUTBOX_BROKER_URL`` (e.g.
``amqp://guest:guest@127.0.0.1:55672//`` or ``redis://127.0.0.1:56379/0``) to switch
to PostgreSQL and RabbitMQ or Redis; every other ``OUTBOX`` setting can be set the same
way (``OUTBOX_BATCH_SIZE=100``, ``OUTBOX_ROUTES='{"orders": {"queue": "orders"}}'``: see
``django_outbox.conf.from_env``).
"""

from __future__ import annotations

from pathlib import Path

import environ

from django_outbox.conf import from_env

BASE_DIR = Path(__file__).resolve().parent.parent
DEMO_DIR = Path(environ.Env().str("OUTBOX_DEMO_DIR", default=str(BASE_DIR / ".demo")))
BROKER_DIR = DEMO_DIR / "broker"
BROKER_DIR.mkdir(parents=True, exist_ok=True)

env = environ.Env(DEBUG=(bool, True))

SECRET_KEY = env("SECRET_KEY", default="example-only-not-secret")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["127.0.0.1", "localhost"])
USE_TZ = True
TIME_ZONE = "UTC"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_outbox",
    "example_project.shop",
    "example_project.billing",
]

DATABASES = {"default": env.db("DATABASE_URL", default=f"sqlite:///{DEMO_DIR / 'db.sqlite3'}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Write-ahead log without an fsync per commit: the consumer commits once per message.
    DATABASES["default"].setdefault("OPTIONS", {})["init_command"] = (
        "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;"
    )

OUTBOX = {
    "BROKER_URL": "filesystem://",
    # Only the filesystem transport reads these: one folder serves as outbox and inbox,
    # and its exchange bindings go beside them (kombu's default is ./control).
    "BROKER_TRANSPORT_OPTIONS": {
        "data_folder_in": str(BROKER_DIR),
        "data_folder_out": str(BROKER_DIR),
        "control_folder": str(BROKER_DIR / "control"),
    },
    # Any setting from an OUTBOX_<NAME> variable: OUTBOX_BROKER_URL, OUTBOX_BATCH_SIZE, ...
    **from_env(env),
}

# The demo runs a single relay on SQLite, which is safe; W001 warns about running several.
SILENCED_SYSTEM_CHECKS = ["django_outbox.W001"]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example_project.urls"
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
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "django_outbox": {
            "handlers": ["console"],
            "level": env("OUTBOX_LOG_LEVEL", default="WARNING"),
        }
    },
}
