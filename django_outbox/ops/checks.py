"""System checks: ``django_outbox.E001``-``E007`` (``E006`` with ``check --deploy``),
``E010``, ``E011``, ``E013``-``E016``, ``E035`` and ``E036`` for settings
(``OUTBOX["BROKERS"]`` and the routes' broker aliases, and the signing keys, among them),
``E008``, ``E009``, ``E017``, ``E018``, ``E070``, ``E071``, ``W002`` and ``W003`` for
route shapes, ``W001`` for databases, ``W008`` and ``W009`` for a partitioned outbox,
``W004`` for Celery routes without publisher confirms, and each broker's transport's own
(``E012`` and ``W005`` for the folders of a ``filesystem://`` broker).
``E050`` (imported, not installed) lives in :mod:`django_outbox.apps`, which runs without
the app.

The ids, messages and hints are listed in docs/reference/checks.md.
"""

from __future__ import annotations

from typing import Any

from django.core import checks
from django.db import connections, router

from .. import db
from ..conf import (
    CHECK_IDS,
    KAFKA_SCHEME,
    PARTITIONING_DEFAULTS,
    broker_problem,
    celery_problem,
    outbox_settings,
)
from ..conf.brokers import NATS_SCHEMES
from ..conf.routes import shape_problems
from ..exceptions import OutboxConfigurationError
from ..transports import transport_class
from ..transports.capabilities import broker_shape_problems


@checks.register(checks.Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    return [
        checks.Error(problem.msg, hint=problem.hint, id=problem.id)
        for problem in outbox_settings.problems()
        if problem.id != CHECK_IDS["no_broker"]
    ]


@checks.register(checks.Tags.compatibility, deploy=True)
def check_broker_configured(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E006, no broker at all, is a deployment check (``check --deploy``): a process that
    only stages events (a web worker, ``manage.py test``, ``makemigrations``) never
    connects to a broker; the relay and the consumer refuse to start with E006's text."""
    return [
        checks.Error(problem.msg, hint=problem.hint, id=problem.id)
        for problem in outbox_settings.problems()
        if problem.id == CHECK_IDS["no_broker"]
    ]


@checks.register(checks.Tags.compatibility)
def check_routes(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Routes that can never deliver (errors), or only once others bind a queue (warnings)."""
    try:
        routes = outbox_settings.ROUTES
        brokers = outbox_settings.brokers
    except OutboxConfigurationError:  # reported by check_settings
        return []
    found: list[checks.CheckMessage] = []
    for route in routes.values():
        broker = brokers.get(route.broker)
        scheme = broker.scheme if broker is not None else ""
        # A Kafka route has no exchange nor queue, a JetStream route a subject and a
        # stream: an exchange's shapes are moot there (theirs are the broker's shapes).
        moot = scheme == KAFKA_SCHEME or scheme in NATS_SCHEMES or route.jetstream
        general = [] if moot else shape_problems(route)
        for shape in general + broker_shape_problems(route, scheme):
            check_id = CHECK_IDS[shape.kind]
            level = checks.Error if check_id.startswith("django_outbox.E") else checks.Warning
            found.append(level(shape.msg, hint=shape.hint, id=check_id))
    return found


@checks.register(checks.Tags.database)
def check_databases(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn about databases holding the outbox where several relays cannot share the work.

    Needs no query (feature flags only), but like Django's own database checks
    it runs only when ``check --database`` (or ``migrate``) names databases. An
    in-memory SQLite database (the one Django's test runner makes) is left out: no
    second process, and so no second relay, can open it.
    """
    from ..models import OutboxMessage

    return [
        checks.Warning(
            f"Database {alias!r} ({connections[alias].vendor}) cannot SELECT ... FOR UPDATE "
            "SKIP LOCKED, so relays cannot share its outbox.",
            hint="Run exactly one run_outbox_relay for this database, or use PostgreSQL.",
            id="django_outbox.W001",
        )
        for alias in databases or ()
        if router.allow_migrate_model(alias, OutboxMessage)
        and not db.supports_skip_locked(connections[alias])
        and not db.in_memory(connections[alias])
    ]


@checks.register(checks.Tags.database)
def check_partitioning(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Warn when ``OUTBOX["PARTITIONING"]`` and a database's outbox table disagree:
    sizes set for a table not partitioned yet (W008), or a partitioned table whose
    relays fall back on the default sizes (W009). Reads the catalog of each PostgreSQL
    database named (``check --database``, ``migrate``)."""
    from ..db import partitions
    from ..models import OutboxMessage

    try:
        sizes = outbox_settings.PARTITIONING
    except OutboxConfigurationError:
        return []  # E003 says what is wrong with it
    found: list[checks.CheckMessage] = []
    for alias in databases or ():
        if not router.allow_migrate_model(alias, OutboxMessage):
            continue
        partitioned = partitions.is_partitioned(connections[alias])
        if sizes is not None and not partitioned and connections[alias].vendor == "postgresql":
            found.append(
                checks.Warning(
                    f'OUTBOX["PARTITIONING"] is set, but the outbox table of database '
                    f"{alias!r} is not partitioned: retention deletes its rows one by one.",
                    hint=f"Run manage.py outbox_partition --database {alias} once (it holds "
                    "the table alone while it works; see docs/scaling.md).",
                    id=CHECK_IDS["partitioning_not_applied"],
                )
            )
        elif sizes is None and partitioned:
            found.append(
                checks.Warning(
                    f"The outbox table of database {alias!r} is partitioned, but "
                    'OUTBOX["PARTITIONING"] is not set: the relays make ranges of '
                    f"{PARTITIONING_DEFAULTS['rows']:,} ids.",
                    hint='Set OUTBOX["PARTITIONING"] = {"rows": ...}: the ids of the period '
                    "retention should drop at once (docs/scaling.md).",
                    id=CHECK_IDS["partitioned_without_sizes"],
                )
            )
    return found


@checks.register(checks.Tags.compatibility)
def check_celery_confirms(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Warn when Celery routes publish to RabbitMQ without publisher confirms: the
    relay's other routes always have them, and without them a task the broker drops is
    PUBLISHED all the same. Reads the current Celery app's settings; connects nowhere."""
    try:
        celery_routes = sorted(name for name, r in outbox_settings.ROUTES.items() if r.is_celery)
    except OutboxConfigurationError:
        return []  # E004 says what is wrong with ROUTES
    if not celery_routes or celery_problem(celery_routes) is not None:
        return []  # no Celery routes, or E016 says celery is not installed
    from ..transports.celery import publishes_unconfirmed

    if not publishes_unconfirmed():
        return []
    return [
        checks.Warning(
            f"Celery routes {celery_routes} publish to RabbitMQ without publisher confirms: "
            "a task the broker refuses or loses is marked PUBLISHED all the same.",
            hint='Set CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True} (the Celery '
            "app's broker_transport_options); see docs/consuming.md.",
            id=CHECK_IDS["celery_no_confirms"],
        )
    ]


@checks.register(checks.Tags.compatibility)
def check_brokers(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """What each broker's transport finds wrong without connecting, such as the folders
    of a ``filesystem://`` broker: missing (E012) or two different ones (W005)."""
    try:
        brokers = outbox_settings.brokers
    except OutboxConfigurationError:  # reported by check_settings
        return []
    return [
        (checks.Error if problem.id.startswith("django_outbox.E") else checks.Warning)(
            problem.msg, hint=problem.hint, id=problem.id
        )
        for broker in brokers.values()
        if broker_problem(broker.url, broker) is None  # E007, E010, E011 said that already
        for problem in transport_class(broker.scheme).problems(broker)
    ]
