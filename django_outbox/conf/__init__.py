"""Settings: the one place ``settings.OUTBOX`` is read, parsed and checked.

Everything else reads configuration through :data:`outbox_settings`
(``from django_outbox.conf import outbox_settings``); a project builds ``OUTBOX`` from
environment variables with :func:`from_env`. The modules, from the bottom up:

- ``redact``: broker URLs masked and passwords scrubbed out of any text (reads nothing);
- ``routes``: the ``ROUTES`` table parsed into :class:`~django_outbox.conf.routes.Route`
  values, and the route shapes wrong on any broker (reads nothing; what a broker
  cannot carry is :mod:`django_outbox.transports.capabilities`'s to say);
- ``parsers``: one parser per kind of value;
- ``catalog``: :data:`SETTINGS`, each setting with its default, parser and doc;
- ``problems``: :data:`CHECK_IDS` and :class:`Problem`, the text of one system check;
- ``passwords``: the configuration's passwords, for redaction;
- ``brokers``: :class:`Broker` and what the settings know of each kombu transport;
- ``diagnostics``: what keeps a broker URL or a route from working, without connecting;
- ``settings``: :class:`OutboxSettings` and :data:`outbox_settings`, reloaded on
  ``setting_changed``;
- ``env``: :func:`from_env`.

What it may import (the "conf" contract of ``[tool.importlinter]`` in pyproject.toml):
Django, kombu, django-environ, and of the package only ``exceptions`` and ``signing``;
nothing above it (the models, the store, the transports, the relay) imports into it.
"""

from __future__ import annotations

from .brokers import CELERY_EXTRA, DRIVERS, KAFKA_SCHEME, Broker, broker_scheme, kafka_bootstrap
from .catalog import SETTINGS, Setting
from .diagnostics import broker_problem, celery_problem, route_problems
from .env import from_env
from .parsers import BROKER_KEYS, PARTITIONING_DEFAULTS
from .passwords import CELERY_OPTIONS, CELERY_URLS
from .problems import CHECK_IDS, MISSING_APP, Problem
from .settings import MAX_UNNAMED_ROUTES, OutboxSettings, outbox_settings, sets_tasks

__all__ = [
    "BROKER_KEYS",
    "CELERY_EXTRA",
    "CELERY_OPTIONS",
    "CELERY_URLS",
    "CHECK_IDS",
    "DRIVERS",
    "KAFKA_SCHEME",
    "MAX_UNNAMED_ROUTES",
    "MISSING_APP",
    "PARTITIONING_DEFAULTS",
    "SETTINGS",
    "Broker",
    "OutboxSettings",
    "Problem",
    "Setting",
    "broker_problem",
    "broker_scheme",
    "celery_problem",
    "from_env",
    "kafka_bootstrap",
    "outbox_settings",
    "route_problems",
    "sets_tasks",
]
