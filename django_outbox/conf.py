"""The ``OUTBOX`` settings dict: defaults, types, and the one place it is read.

Everything else reads configuration through :data:`outbox_settings`::

    from django_outbox.conf import outbox_settings
    outbox_settings.BATCH_SIZE

Values are read at call time (never at import time), parsed once, and cached
until Django sends ``setting_changed`` for ``OUTBOX`` or ``CELERY_BROKER_URL``,
so ``override_settings`` works in tests. An invalid value raises
:class:`~django_outbox.exceptions.OutboxConfigurationError` when read; the same
validation backs the system checks (``django_outbox.E001`` ...), so a bad
setting is reported at start-up rather than in the middle of a relay run.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib
import importlib.util
import json
import reprlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import environ
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed

from .exceptions import OutboxConfigurationError
from .redact import mask_url, option_secrets, scrub, url_passwords, url_problem
from .routes import (
    DEFAULT_BROKER,
    ENVELOPES,
    Route,
    did_you_mean,
    is_valid_destination,
    parse_routes,
)
from .signing import MIN_KEY_BYTES, Keyring, parse_keys


class _Invalid(ValueError):
    """Raised by a parser with what the value should have been."""


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _Invalid("must be a positive integer")
    return value


#: The longest duration a setting takes: what a ``timedelta`` holds (about 2.7 million years).
_MAX_SECONDS = dt.timedelta.max.total_seconds()


def _seconds(value: object) -> float:
    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (0 < value < _MAX_SECONDS)
    ):
        raise _Invalid("must be a positive number of seconds or a timedelta")
    return float(value)


def _is_zero(value: object) -> bool:
    """0 or 0.0 (a number, not False): what turns a feature off, or keeps nothing."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == 0


def _seconds_or_zero(value: object) -> float:
    """A number of seconds that may be 0 (a feature turned off)."""
    if _is_zero(value):
        return 0.0
    try:
        return _seconds(value)
    except _Invalid:
        raise _Invalid("must be 0 or a positive number of seconds") from None


def _duration(value: object) -> dt.timedelta:
    """A positive duration; one under a microsecond, which a timedelta cannot hold, is
    refused rather than read as 0 (a retention of 0 would delete rows at once)."""
    duration = dt.timedelta(seconds=_seconds(value))
    if not duration:
        raise _Invalid("must be a positive number of seconds or a timedelta")
    return duration


def _duration_or_zero(value: object) -> dt.timedelta:
    """A duration that may be 0 (nothing kept), else as :func:`_duration`."""
    seconds = value.total_seconds() if isinstance(value, dt.timedelta) else value
    if _is_zero(seconds):
        return dt.timedelta(0)
    try:
        return _duration(seconds)
    except _Invalid:
        raise _Invalid("must be 0, a positive number of seconds or a timedelta") from None


def _fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise _Invalid("must be a number between 0 and 1")
    return float(value)


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid("must be True or False")
    return value


def _optional_str(value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise _Invalid("must be a non-empty string or None")
    return value


def _exchange_name(value: object) -> str:
    if not isinstance(value, str) or not is_valid_destination(value):
        raise _Invalid("must be an exchange name of letters, digits and ._:/-")
    return value


def _envelope(value: object) -> str:
    if value not in ENVELOPES or not isinstance(value, str):
        raise _Invalid(f"must be one of {', '.join(map(repr, ENVELOPES))}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Invalid("must be a non-empty string")
    return value


def _dict(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _Invalid("must be a dict with string keys")
    return dict(value)


def _signing_keys(value: object) -> Keyring:
    try:
        return parse_keys(value)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None


#: The keys of one broker of ``OUTBOX["BROKERS"]``.
BROKER_KEYS = ("URL", "OPTIONS")


def _broker_table(value: object) -> dict[str, dict[str, Any]]:
    """``OUTBOX["BROKERS"]``: alias -> ``{"URL": kombu URL, "OPTIONS": transport options}``.
    The reasons name the alias and the key, never a value (a URL or an option may hold
    a password)."""
    if not isinstance(value, Mapping):
        raise _Invalid(
            'must be a dict of alias -> {"URL": ..., "OPTIONS": {...}}; '
            f"got {type(value).__name__}"
        )
    table = {}
    for alias, spec in value.items():
        if not isinstance(alias, str) or not alias:
            raise _Invalid(f"has an alias that is not a non-empty string: {type(alias).__name__}")
        where = f'["{alias}"]'
        if not isinstance(spec, Mapping):
            raise _Invalid(
                f'{where} must be a dict with "URL" and optional "OPTIONS"; '
                f"got {type(spec).__name__}"
            )
        if unknown := sorted(str(key) for key in spec if key not in BROKER_KEYS):
            raise _Invalid(f"{where} has unknown keys {unknown}; a broker takes URL and OPTIONS")
        if "URL" not in spec:
            raise _Invalid(f'{where} has no "URL"')
        if not isinstance(spec["URL"], str) or not spec["URL"]:
            raise _Invalid(f'{where}["URL"] must be a non-empty string')
        try:
            options = _dict(spec.get("OPTIONS", {}))
        except _Invalid as exc:
            kind = type(spec["OPTIONS"]).__name__
            raise _Invalid(f'{where}["OPTIONS"] {exc}; got {kind}') from None
        table[alias] = {"URL": spec["URL"], "OPTIONS": options}
    return table


@dataclasses.dataclass(frozen=True)
class Broker:
    """One broker the relay publishes to: its alias, kombu URL and transport options,
    and ``setting``, where it is configured (for error texts)."""

    alias: str
    url: str
    options: Mapping[str, Any]
    setting: str

    @property
    def scheme(self) -> str:
        """The URL's transport, lowercased (``"amqp"``, ``"redis"``, ``"memory"`` ...)."""
        return broker_scheme(self.url)

    @property
    def options_setting(self) -> str:
        """The setting that holds this broker's transport options."""
        if self.setting.startswith('OUTBOX["BROKERS"]'):
            return f'{self.setting}["OPTIONS"]'
        return 'OUTBOX["BROKER_TRANSPORT_OPTIONS"]'

    @property
    def named(self) -> str:
        """How error texts name it: '' for the short form (BROKER_URL,
        CELERY_BROKER_URL), else ' of OUTBOX["BROKERS"]["alias"]'."""
        return f" of {self.setting}" if self.setting.startswith('OUTBOX["BROKERS"]') else ""


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    parse: Callable[[Any], Any] | None  # None: parsed by OutboxSettings._parse itself
    doc: str


#: Every knob of ``settings.OUTBOX``, in documentation order.
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "BROKER_URL",
            None,
            _optional_str,
            "kombu URL the relay publishes to; when None, settings.CELERY_BROKER_URL is used.",
        ),
        Setting(
            "BROKER_TRANSPORT_OPTIONS",
            {},
            _dict,
            "transport_options passed to kombu.Connection (e.g. data_folder_in/out for "
            'filesystem://): the short form of OUTBOX["BROKERS"]["default"]["OPTIONS"].',
        ),
        Setting(
            "BROKERS",
            {},
            _broker_table,
            'alias -> {"URL": kombu URL, "OPTIONS": transport options}; routes name an alias '
            '("broker"), "default" when they do not. BROKER_URL is the short form of '
            '{"default": {"URL": ...}}.',
        ),
        Setting(
            "ROUTES",
            {},
            None,  # parsed by parse_routes with DEFAULT_EXCHANGE, see _parse()
            "destination -> {exchange, exchange_type, routing_key, queue, queue_arguments, "
            "exchange_arguments, queue_type, dead_letter_exchange, broker, ordered, partitions, "
            "envelope} "
            "or {celery_task}.",
        ),
        Setting(
            "DEFAULT_EXCHANGE",
            "outbox",
            _exchange_name,
            "durable topic exchange of the default route and of routes that name no exchange.",
        ),
        Setting(
            "DEFAULT_ROUTE",
            True,
            _bool,
            "publish destinations missing from ROUTES by the default route; False makes them "
            "an error at stage time.",
        ),
        Setting(
            "DEFAULT_ORDERED",
            False,
            _bool,
            'make the default route ordered (strict per-key order, as "ordered": True on a '
            "route; see docs/ordering.md).",
        ),
        Setting("BATCH_SIZE", 500, _positive_int, "rows the relay claims per batch."),
        Setting(
            "MAX_BATCH_BYTES",
            16 * 1024 * 1024,
            _positive_int,
            "bytes of payload JSON the relay claims per batch, at most (a batch always takes "
            "its first row, however large).",
        ),
        Setting(
            "MAX_PAYLOAD_BYTES",
            1024 * 1024,
            _positive_int,
            "largest payload (and largest headers) stage() accepts, in bytes of UTF-8 JSON.",
        ),
        Setting(
            "LEASE_SECONDS",
            60,
            _seconds,
            "how long a claim holds before another relay may take the row over; a RabbitMQ "
            "batch waits for its confirms at most a third of it (30 s at most).",
        ),
        Setting(
            "MAX_ATTEMPTS",
            10,
            _positive_int,
            "publish attempts before a row is ABANDONED.",
        ),
        Setting(
            "RETRY_BASE_DELAY", 1, _seconds, "first retry delay in seconds; doubled per attempt."
        ),
        Setting("RETRY_MAX_DELAY", 3600, _seconds, "cap on the retry delay, in seconds."),
        Setting(
            "RETRY_JITTER",
            0.2,
            _fraction,
            "random fraction (0-1) taken off each retry delay so failed rows do not retry in step.",
        ),
        Setting(
            "PUBLISHED_RETENTION",
            dt.timedelta(days=7),
            _duration_or_zero,
            "how long PUBLISHED rows are kept (timedelta or seconds); 0: a row is deleted "
            "when the broker confirms it, and no PUBLISHED row is kept.",
        ),
        Setting(
            "ABANDONED_RETENTION",
            dt.timedelta(days=30),
            _duration,
            "how long ABANDONED rows are kept after they were abandoned (timedelta or seconds).",
        ),
        Setting(
            "INBOX_RETENTION",
            dt.timedelta(days=7),
            _duration,
            "how long inbox marks (and failure records of handled events) are kept; must exceed "
            "the longest time a message can be redelivered after it was handled.",
        ),
        Setting(
            "TASK_RESULT_RETENTION",
            dt.timedelta(days=7),
            _duration,
            "how long the results of finished Django tasks (SUCCESSFUL or FAILED, by their "
            "finished time) are kept for get_result() and the admin (timedelta or seconds).",
        ),
        Setting(
            "CLEANUP_INTERVAL",
            300,
            _seconds,
            "seconds between the retention cleanups a running relay makes.",
        ),
        Setting(
            "POLL_INTERVAL",
            1,
            _seconds,
            "seconds the relay sleeps when idle and no NOTIFY wakes it.",
        ),
        Setting(
            "HEARTBEAT_INTERVAL",
            10,
            _seconds,
            "seconds between the heartbeats a running relay or consumer writes (its row in "
            "the relays and consumers table); live within 3 intervals, stale within 30.",
        ),
        Setting(
            "HEALTH_MAX_DUE_AGE",
            300,
            _seconds,
            "seconds the oldest due row may wait before outbox_health and the health view "
            "report the outbox unhealthy.",
        ),
        Setting(
            "METRICS_BACKLOG_INTERVAL",
            5,
            _seconds_or_zero,
            "seconds a relay's /metrics serves the backlog gauges it last read before it reads "
            "them from the database again; 0: on every scrape.",
        ),
        Setting(
            "SIGNING_KEYS",
            (),
            _signing_keys,
            "HMAC-SHA256 keys (str or bytes, 32 bytes at least): the relay signs each message "
            "with the first, a consumer that verifies accepts any (see docs/hostile-input.md).",
        ),
        Setting(
            "VERIFY_SIGNATURES",
            False,
            _bool,
            "run_outbox_consumer parks every message not signed by one of SIGNING_KEYS "
            "(also --verify-signatures).",
        ),
        Setting(
            "DEFAULT_ENVELOPE",
            "outbox",
            _envelope,
            'the wire format of broker routes that name no "envelope": "outbox", '
            '"cloudevents" or "cloudevents-structured" (see docs/cloudevents.md).',
        ),
        Setting(
            "CLOUDEVENTS_SOURCE",
            "/django-outbox",
            _text,
            "the CloudEvents source attribute of every event the relay publishes in a "
            "CloudEvents envelope: a URI reference naming your service (see docs/cloudevents.md).",
        ),
        Setting(
            "START_JITTER",
            1,
            _seconds_or_zero,
            "a running relay (not a drain) waits a random 0 to START_JITTER seconds before its "
            "first claim, so relays started together do not claim and poll in step; 0: none.",
        ),
    )
}

CHECK_IDS = {
    "not_a_dict": "django_outbox.E001",
    "unknown_key": "django_outbox.E002",
    "bad_value": "django_outbox.E003",
    "bad_routes": "django_outbox.E004",
    "delay_order": "django_outbox.E005",
    "no_broker": "django_outbox.E006",
    "bad_broker": "django_outbox.E007",
    "celery_no_confirms": "django_outbox.W004",
    # Route shapes (routes.shape_problems), checked by checks.check_routes:
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
    # Partition queues of an ordered route (routes.shape_problems):
    "partitions_not_rabbitmq": "django_outbox.E017",
    # A quorum queue or a dead-letter exchange on a broker without queue arguments
    # (routes.shape_problems):
    "queue_type_not_rabbitmq": "django_outbox.E018",
    # The Django tasks backend (taskbackend.OutboxTaskBackend.check):
    "bad_tasks": "django_outbox.E019",
    "tasks_no_skip_locked": "django_outbox.W006",
    "tasks_no_celery_app": "django_outbox.W007",
    # Imported, not installed (apps.check_installed; staging raises the same text):
    "missing_app": "django_outbox.E050",
    # Signed envelopes (signing):
    "bad_signing_keys": "django_outbox.E035",
    "verify_without_keys": "django_outbox.E036",
}


def sets_tasks() -> bool:
    """Whether the project sets Django's ``TASKS`` (Django 6.0+): then the checks of its
    task backends must run, whether or not anything imported ``django.tasks``."""
    overridden: bool = settings.is_overridden("TASKS")  # type: ignore[misc]
    return overridden and importlib.util.find_spec("django.tasks") is not None


#: The package a kombu transport needs, by URL scheme: (module to import, what to install).
DRIVERS = {
    **dict.fromkeys(
        ("redis", "rediss", "sentinel"), ("redis", '"django-transactional-outbox[redis]"')
    ),
    **dict.fromkeys(("sqs", "SQS"), ("boto3", '"kombu[sqs]"')),
    "mongodb": ("pymongo", '"kombu[mongodb]"'),
    **dict.fromkeys(("kafka", "confluentkafka"), ("confluent_kafka", '"kombu[confluentkafka]"')),
    "zookeeper": ("kazoo", '"kombu[zookeeper]"'),
    **dict.fromkeys(("sqlalchemy", "sqla"), ("sqlalchemy", '"kombu[sqlalchemy]"')),
    "consul": ("consul", '"kombu[consul]"'),
    "etcd": ("etcd", '"kombu[etcd]"'),
    "azurestoragequeues": ("azure.storage.queue", '"kombu[azurestoragequeues]"'),
    "azureservicebus": ("azure.servicebus", '"kombu[azureservicebus]"'),
    "gcpubsub": ("google.cloud.pubsub_v1", '"kombu[gcpubsub]"'),
    "librabbitmq": ("librabbitmq", '"kombu[librabbitmq]"'),
    "pyro": ("Pyro4", '"kombu[pyro]"'),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with ``settings.OUTBOX``; becomes a ``checks.Error``."""

    id: str
    msg: str
    hint: str


#: How many routes of destinations not in ``ROUTES`` (the default route, Django task
#: queues) ``route_for`` keeps built; past it, it starts again.
MAX_UNNAMED_ROUTES = 1024


class OutboxSettings:
    """Attribute access to the parsed ``OUTBOX`` settings, e.g. ``outbox_settings.BATCH_SIZE``."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}
        self._secrets: list[str] | None = None
        # Held by a reload and by a read that parses: a read that raced a reload
        # cannot leave the old value behind it. Reentrant: a setting's parse reads others.
        self._lock = threading.RLock()

    def reload(self) -> None:
        with self._lock:
            for name in SETTINGS:  # those read since the last reload are on the instance
                self.__dict__.pop(name, None)
            self._cache.clear()
            self._secrets = None

    @property
    def user_settings(self) -> Any:
        return getattr(settings, "OUTBOX", {})

    def __getattr__(self, name: str) -> Any:
        """A setting's first read after a reload: parse it, and keep it as an attribute
        of the instance, so that the next reads (staging reads the routes per event)
        are plain attribute reads until the next reload."""
        if name not in SETTINGS:
            raise AttributeError(f"OUTBOX has no setting {name!r}")
        with self._lock:
            if name not in self._cache:
                result = self._parse(name)
                if isinstance(result, Problem):
                    raise OutboxConfigurationError(f"{result.msg} {result.hint}")
                self._cache[name] = self.__dict__[name] = result
            return self._cache[name]

    def _raw(self, name: str) -> Any:
        user = self.user_settings
        if not isinstance(user, Mapping):
            user = {}
        return user.get(name, SETTINGS[name].default)

    def _parse(self, name: str) -> Any:
        raw = self._raw(name)
        if name == "ROUTES":
            exchange = self._parse("DEFAULT_EXCHANGE")
            if isinstance(exchange, Problem):  # reported on its own; still check the routes
                exchange = SETTINGS["DEFAULT_EXCHANGE"].default
            try:
                return parse_routes(raw, exchange)
            except ValueError as exc:
                return Problem(
                    CHECK_IDS["bad_routes"],
                    f'OUTBOX["ROUTES"] is invalid: {exc}.',
                    "See the ROUTES entry of the settings reference in docs/reference/settings.md.",
                )
        parse = SETTINGS[name].parse
        assert parse is not None
        try:
            return parse(raw)
        except _Invalid as exc:
            if name == "SIGNING_KEYS":  # the value is not shown: it holds keys
                return Problem(
                    CHECK_IDS["bad_signing_keys"],
                    f'OUTBOX["SIGNING_KEYS"] {exc}.',
                    'Write OUTBOX["SIGNING_KEYS"] = [env("OUTBOX_SIGNING_KEY")], a key made '
                    "with secrets.token_urlsafe(32); see docs/hostile-input.md.",
                )
            if name == "BROKERS":  # the value is not shown: it may hold passwords
                return Problem(
                    CHECK_IDS["bad_brokers"],
                    f'OUTBOX["BROKERS"]{"" if str(exc).startswith("[") else " "}{exc}.',
                    'Write OUTBOX["BROKERS"] = {"default": {"URL": "amqp://...", "OPTIONS": '
                    "{}}}; see docs/reference/settings.md.",
                )
            return Problem(
                CHECK_IDS["bad_value"],
                f'OUTBOX["{name}"] {exc}; got {scrub(repr(raw))}.',
                f"Default: {SETTINGS[name].default!r}. {SETTINGS[name].doc}",
            )

    @property
    def broker_url(self) -> str | None:
        """The URL of the "default" broker: ``OUTBOX["BROKERS"]["default"]``, else
        ``OUTBOX["BROKER_URL"]``, else ``settings.CELERY_BROKER_URL``, else None."""
        default = self.brokers.get(DEFAULT_BROKER)
        return default.url if default is not None else None

    @property
    def brokers(self) -> dict[str, Broker]:
        """Every broker by alias: ``OUTBOX["BROKERS"]``, and, when it has no "default",
        the short form (``BROKER_URL``, else ``CELERY_BROKER_URL``, with
        ``BROKER_TRANSPORT_OPTIONS``) as "default". Raises
        :class:`OutboxConfigurationError` when both forms set the "default" broker."""
        if "brokers" not in self._cache:
            problem = self._both_forms()
            if problem is not None:
                raise OutboxConfigurationError(f"{problem.id}: {problem.msg} {problem.hint}")
            self._cache["brokers"] = self._brokers()
        brokers: dict[str, Broker] = self._cache["brokers"]
        return brokers

    def _brokers(self) -> dict[str, Broker]:
        found = {
            alias: Broker(alias, spec["URL"], spec["OPTIONS"], f'OUTBOX["BROKERS"]["{alias}"]')
            for alias, spec in self.BROKERS.items()
        }
        if DEFAULT_BROKER not in found:
            url, setting = self.BROKER_URL, 'OUTBOX["BROKER_URL"]'
            if not url:
                url, setting = getattr(settings, "CELERY_BROKER_URL", None), "CELERY_BROKER_URL"
            if url:
                options = self.BROKER_TRANSPORT_OPTIONS
                found[DEFAULT_BROKER] = Broker(DEFAULT_BROKER, url, options, setting)
        return found

    def _both_forms(self) -> Problem | None:
        """E014 when the short form and ``OUTBOX["BROKERS"]["default"]`` are both set."""
        user = self.user_settings if isinstance(self.user_settings, Mapping) else {}
        table = user.get("BROKERS")
        if not isinstance(table, Mapping) or DEFAULT_BROKER not in table:
            return None
        short = [name for name in ("BROKER_URL", "BROKER_TRANSPORT_OPTIONS") if user.get(name)]
        if not short:
            return None
        return Problem(
            CHECK_IDS["broker_twice"],
            f'OUTBOX["BROKERS"]["default"] and OUTBOX["{short[0]}"] both set the default broker.',
            f'Keep one: {short[0]} is the short form of OUTBOX["BROKERS"]["default"].',
        )

    def require_broker(self, alias: str = DEFAULT_BROKER) -> Broker:
        """The broker ``alias`` if the relay or a consumer can connect to it; else
        :class:`OutboxConfigurationError` with the text of the system check that
        reports it (E006, E007, E010, E011, E014 or E015)."""
        broker = self.brokers.get(alias)
        problem: Problem | None
        if broker is None:
            problem = _NO_BROKER if not self.brokers else _unknown_alias(alias, self.brokers)
        else:
            problem = broker_problem(broker.url, broker)
        if problem is not None:
            raise OutboxConfigurationError(f"{problem.id}: {problem.msg} {problem.hint}")
        assert broker is not None
        return broker

    def broker_aliases(self) -> set[str]:
        """The brokers the routes publish to: those they name, and "default" for the
        default route (when DEFAULT_ROUTE is on)."""
        aliases = {route.broker for route in self.ROUTES.values() if not route.is_celery}
        return aliases | ({DEFAULT_BROKER} if self.DEFAULT_ROUTE else set())

    def route_for(self, destination: str) -> Route | None:
        """The route of ``destination``; None when it is unknown and DEFAULT_ROUTE is off.
        A Django task queue's destination (``django.tasks:<queue>``) has its own route."""
        named = self.ROUTES.get(destination)
        if named is not None:
            return named
        built: dict[str, Route | None] = self._cache.setdefault("unnamed_routes", {})
        try:
            return built[destination]  # built once per reload (staging asks per event)
        except KeyError:
            pass
        route = Route.for_tasks(destination)
        if route is None and self.DEFAULT_ROUTE:
            route = Route.default(destination, self.DEFAULT_EXCHANGE, ordered=self.DEFAULT_ORDERED)
        if len(built) >= MAX_UNNAMED_ROUTES:
            built.clear()
        built[destination] = route
        return route

    def route_for_queue(self, queue: str) -> Route:
        """The route that declares ``queue`` (or has it as a partition queue), so a
        consumer declares the same exchange, queue and binding as the relay; for a
        queue no route names,
        the default route of a destination called ``queue`` (or, with
        DEFAULT_ROUTE off, the bare queue)."""
        for route in self.ROUTES.values():
            if queue == route.queue or queue in route.partition_queues:
                return route
        if self.DEFAULT_ROUTE:
            return Route.default(queue, self.DEFAULT_EXCHANGE, ordered=self.DEFAULT_ORDERED)
        return Route(queue, exchange="", routing_key=queue, queue=queue)

    def problems(self) -> list[Problem]:
        """Everything wrong with the settings, for the system checks."""
        user = self.user_settings
        if not isinstance(user, Mapping):
            return [
                Problem(
                    CHECK_IDS["not_a_dict"],
                    f"settings.OUTBOX must be a dict; got {type(user).__name__}.",
                    'Write OUTBOX = {"BROKER_URL": "amqp://..."} in your settings.',
                )
            ]
        found = [
            Problem(
                CHECK_IDS["unknown_key"],
                f'OUTBOX["{key}"] is not a setting of django_outbox{did_you_mean(key, SETTINGS)}.',
                f"Known settings: {', '.join(SETTINGS)}.",
            )
            for key in user
            if key not in SETTINGS
        ]
        parsed = {name: self._parse(name) for name in SETTINGS}
        found += [p for p in parsed.values() if isinstance(p, Problem)]
        base, cap = parsed["RETRY_BASE_DELAY"], parsed["RETRY_MAX_DELAY"]
        if isinstance(base, float) and isinstance(cap, float) and cap < base:
            found.append(
                Problem(
                    CHECK_IDS["delay_order"],
                    f'OUTBOX["RETRY_MAX_DELAY"] ({cap:g}s) is below RETRY_BASE_DELAY ({base:g}s).',
                    "Raise RETRY_MAX_DELAY or lower RETRY_BASE_DELAY.",
                )
            )
        if parsed["VERIFY_SIGNATURES"] is True and not parsed["SIGNING_KEYS"]:
            found.append(
                Problem(
                    CHECK_IDS["verify_without_keys"],
                    'OUTBOX["VERIFY_SIGNATURES"] is on, but OUTBOX["SIGNING_KEYS"] is empty: '
                    "a consumer would park every message.",
                    'Give OUTBOX["SIGNING_KEYS"] the keys the relays sign with.',
                )
            )
        return found + self._broker_problems(parsed)

    def _broker_problems(self, parsed: dict[str, Any]) -> list[Problem]:
        """The brokers' problems: both forms of "default" (E014), none at all (E006),
        each broker's URL (E007, E010, E011), and the routes' aliases (E015, E016)."""
        if any(
            isinstance(parsed[name], Problem)
            for name in ("BROKER_URL", "BROKERS", "BROKER_TRANSPORT_OPTIONS")
        ):
            return []
        both = self._both_forms()
        if both is not None:
            return [both]
        brokers = self._brokers()
        if not brokers:
            return [_NO_BROKER]
        found = [
            problem
            for broker in brokers.values()
            if (problem := broker_problem(broker.url, broker)) is not None
        ]
        routes, default_route = parsed["ROUTES"], parsed["DEFAULT_ROUTE"]
        if isinstance(routes, dict) and isinstance(default_route, bool):
            found += route_problems(routes, brokers, default_route=default_route)
        return found

    def require_broker_url(self, url: str | None = None) -> str:
        """``url`` (by default the "default" broker's URL) if the relay or a consumer
        can connect with it; else :class:`OutboxConfigurationError` with the text
        of the system check that reports it (E006, E007, E010 or E011)."""
        if not url:
            return self.require_broker().url
        problem = broker_problem(url)
        if problem is not None:
            raise OutboxConfigurationError(f"{problem.id}: {problem.msg} {problem.hint}")
        return url

    def secrets(self) -> list[str]:
        """The passwords of the broker URLs, the transport options and the databases, and
        the signing keys, for :meth:`redact`; read once (redact runs for every log record
        of the relay and the consumer)."""
        if self._secrets is None:
            self._secrets = self._read_secrets()
        return self._secrets

    def _read_secrets(self) -> list[str]:
        urls = [self._raw("BROKER_URL"), *(getattr(settings, name, None) for name in CELERY_URLS)]
        options = [self._raw("BROKER_TRANSPORT_OPTIONS"), getattr(settings, CELERY_OPTIONS, None)]
        table = self._raw("BROKERS")
        for spec in table.values() if isinstance(table, Mapping) else ():
            if isinstance(spec, Mapping):
                urls.append(spec.get("URL"))
                options.append(spec.get("OPTIONS"))
        found = [secret for url in urls if isinstance(url, str) for secret in url_passwords(url)]
        found += option_secrets(options)
        keys = self._raw("SIGNING_KEYS")
        for key in keys if isinstance(keys, list | tuple) else ():
            if isinstance(key, str) and len(key) >= MIN_KEY_BYTES:
                found.append(key)
        for database in settings.DATABASES.values():
            password = database.get("PASSWORD")
            if isinstance(password, str) and password:
                found.append(password)
        return found

    def redact(self, text: str) -> str:
        """``text`` (a driver's error message, a log line) without any URL's password
        or any password of the project's configuration."""
        return scrub(text, self.secrets())


def broker_scheme(url: str) -> str:
    """The transport a broker URL names, lowercased: ``"amqp"`` for ``AMQP://host//``."""
    return url.partition("://")[0].lower()


#: Celery's settings that hold URLs with passwords.
CELERY_URLS = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
#: Celery's transport options, which may hold a password (``sentinel_kwargs`` ...).
CELERY_OPTIONS = "CELERY_BROKER_TRANSPORT_OPTIONS"

MISSING_APP = Problem(
    CHECK_IDS["missing_app"],
    '"django_outbox" is not in INSTALLED_APPS: without it there is no outbox table to '
    "stage events in, no relay and no system check of OUTBOX.",
    'Add "django_outbox" to INSTALLED_APPS in your settings, then run manage.py migrate.',
)

_NO_BROKER = Problem(
    CHECK_IDS["no_broker"],
    "No broker URL: the outbox relay has nowhere to publish.",
    'Set OUTBOX["BROKER_URL"] (a kombu URL such as amqp://guest:guest@localhost//) '
    "or CELERY_BROKER_URL.",
)


def _unknown_alias(alias: str, brokers: Mapping[str, Broker], user: str = "") -> Problem:
    """E015: ``user`` (a route, the default route) names a broker ``brokers`` lacks."""
    names = [repr(name) for name in sorted(brokers)]
    if len(names) == 1:
        known = f"the only broker configured is {names[0]}"
    else:
        known = f"the brokers configured are {', '.join(names[:-1])} and {names[-1]}"
    return Problem(
        CHECK_IDS["unknown_broker"],
        f'{user}No broker {alias!r} in OUTBOX["BROKERS"]{did_you_mean(alias, brokers)}; {known}.',
        f'Add OUTBOX["BROKERS"][{alias!r}] = {{"URL": ...}}, or name one of the brokers.',
    )


def route_problems(
    routes: Mapping[str, Route], brokers: Mapping[str, Broker], *, default_route: bool
) -> list[Problem]:
    """Routes naming a broker alias that ``brokers`` lacks (E015; the default route
    takes "default"), and Celery routes without the celery package (E016)."""
    found = [
        _unknown_alias(route.broker, brokers, f"Route {name!r} names broker {route.broker!r}: ")
        for name, route in routes.items()
        if not route.is_celery and route.broker not in brokers
    ]
    if default_route and DEFAULT_BROKER not in brokers:
        user = "The default route (DEFAULT_ROUTE is True) publishes to broker 'default': "
        found.append(_unknown_alias(DEFAULT_BROKER, brokers, user))
    celery_routes = sorted(name for name, route in routes.items() if route.is_celery)
    if celery_routes and (problem := celery_problem(celery_routes)) is not None:
        found.append(problem)
    return found


#: What to install for the Celery routes.
CELERY_EXTRA = '"django-transactional-outbox[celery]"'


def celery_problem(celery_routes: list[str]) -> Problem | None:
    """E016 when routes send Celery tasks and the celery package is not installed."""
    if importlib.util.find_spec("celery") is not None:
        return None
    return Problem(
        CHECK_IDS["missing_celery"],
        f"Routes {celery_routes} send Celery tasks (celery_task), which requires the celery "
        f"package: pip install {CELERY_EXTRA}",
        "Install it where the relay runs, or route these destinations to a broker.",
    )


def broker_problem(url: str, broker: Broker | None = None) -> Problem | None:
    """What keeps the relay from connecting with ``url``: a malformed URL (E010), an
    unknown transport (E007), a transport whose package is missing (E011). Every
    text shows the URL masked, never its password; ``broker`` names the alias of
    ``OUTBOX["BROKERS"]`` it comes from."""
    named = broker.named if broker is not None else ""
    reason = url_problem(url)
    if reason is not None:
        return Problem(
            CHECK_IDS["malformed_broker"],
            f"The broker URL {mask_url(url)}{named} is malformed: {reason}.",
            _malformed_hint(reason),
        )
    from kombu.transport import TRANSPORT_ALIASES

    scheme = url.partition("://")[0].partition("+")[0]  # kombu reads sqla+postgresql:// so
    if scheme not in TRANSPORT_ALIASES and "." not in scheme:
        return Problem(
            CHECK_IDS["bad_broker"],
            f"The broker URL{named} names an unknown kombu transport {scheme!r}.",
            "Use a kombu URL such as amqp://, redis://, memory:// or filesystem://.",
        )
    return _missing_driver(url, scheme, named)


#: E010's hint for each kind of malformed URL (by the start of redact.url_problem's reason);
#: the others are a password or user name that needs percent-encoding.
_MALFORMED_HINTS = {
    "it is not of the form": "Write the URL as transport://user:password@host:port/vhost, such "
    'as amqp://guest:guest@localhost:5672// (the transport is followed by "://").',
    "its failover list": 'List the addresses of one broker separated by ";" with no spaces, '
    "all of one transport: amqp://u:p@host1//;amqp://u:p@host2//.",
}
_QUOTE_HINT = (
    'Percent-encode the user name and password: "@" as %40, ":" as %3A, "/" as %2F, '
    '"?" as %3F, "#" as %23 (urllib.parse.quote(password, safe="")).'
)


def _malformed_hint(reason: str) -> str:
    """The fix of a malformed broker URL, for the reason :func:`url_problem` gave."""
    return next(
        (hint for start, hint in _MALFORMED_HINTS.items() if reason.startswith(start)),
        _QUOTE_HINT,
    )


def _missing_driver(url: str, scheme: str, named: str = "") -> Problem | None:
    """E011 if the kombu transport of ``url`` cannot be loaded: the package to install
    for the transports of :data:`DRIVERS`, kombu's own import error for the others."""
    import kombu

    module, install = DRIVERS.get(scheme, (None, None))
    try:
        if module is not None:
            importlib.import_module(module)
        # Building the transport (no connection yet) is where kombu's transports
        # raise ImportError for a missing driver.
        kombu.Connection(url).transport  # noqa: B018
    except Exception as exc:  # ImportError, or whatever a transport raises without its driver
        if module is None:
            return Problem(
                CHECK_IDS["missing_driver"],
                f"The broker URL {mask_url(url)}{named} names kombu transport {scheme!r}, which "
                f"cannot be loaded: {outbox_settings.redact(f'{type(exc).__name__}: {exc}')}",
                "Install the package the error names, where the relay and the consumers run.",
            )
        return Problem(
            CHECK_IDS["missing_driver"],
            f"The broker URL {mask_url(url)}{named} needs the Python package {module!r}, "
            f"which is not installed: pip install {install}",
            "Install it where the relay and the consumers run, or use another transport.",
        )
    return None


outbox_settings = OutboxSettings()


_TRUE, _FALSE = {"1", "true", "yes", "on", "y"}, {"0", "false", "no", "off", "n"}


def _env_bool(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE | _FALSE:
        raise ValueError(text)
    return word in _TRUE


#: How :func:`from_env` casts the variable of each parser's settings, and what the
#: variable must hold. Strict casts, not django-environ's: its float cast drops the
#: characters that are not digits ("30s" becomes 30.0, "1e6" 16.0) and its bool cast
#: takes any unknown word for False.
_ENV_CASTS: dict[Callable[[Any], Any] | None, tuple[Callable[[str], Any], str]] = {
    _positive_int: (int, "a positive integer"),
    _seconds: (float, "a positive number of seconds"),
    _duration: (float, "a positive number of seconds"),
    _seconds_or_zero: (float, "0 or a positive number of seconds"),
    _duration_or_zero: (float, "0 or a positive number of seconds"),
    _fraction: (float, "a number between 0 and 1"),
    _bool: (_env_bool, "true or false (also 1/0, yes/no, on/off)"),
    _optional_str: (str, "a kombu URL such as amqp://user:password@host//"),  # BROKER_URL
    _exchange_name: (str, "an exchange name of letters, digits and ._:/-"),
    _dict: (json.loads, "a JSON object"),
    _broker_table: (json.loads, 'a JSON object of brokers: {"alias": {"URL": ...}}'),
    _signing_keys: (json.loads, 'a JSON list of keys: ["...", "..."]'),
    _envelope: (str, "outbox, cloudevents or cloudevents-structured"),
    _text: (str, "a non-empty string"),
    None: (json.loads, "a JSON object of routes"),  # ROUTES
}


def from_env(
    env: environ.Env | Mapping[str, str] | None = None, prefix: str = "OUTBOX_"
) -> dict[str, Any]:
    """The ``OUTBOX`` settings dict from environment variables, for a 12-factor settings
    module: ``OUTBOX = from_env()``.

    Each setting ``NAME`` of :data:`SETTINGS` is read from ``{prefix}NAME`` and cast to
    its type: integers, floats (seconds for the durations), booleans, strings, and JSON
    for ``ROUTES`` and ``BROKER_TRANSPORT_OPTIONS``. Only the variables that are set (to
    a non-empty value) appear in the dict, so the defaults stay those of this module.
    ``env`` is a ``django-environ`` ``Env`` (default: ``environ.Env()`` over
    ``os.environ``) or a plain mapping of variables. A value that cannot be cast, or
    that the setting refuses, raises :class:`OutboxConfigurationError` naming the
    variable and what it must hold; it never shows a broker URL's password, nor a JSON
    value (it may hold one).
    """
    if isinstance(env, environ.Env):
        reader = env
    else:
        reader = environ.Env()
        if env is not None:
            reader.ENVIRON = env  # a plain mapping of variables
    found: dict[str, Any] = {}
    for setting in SETTINGS.values():
        variable = prefix + setting.name
        if reader.ENVIRON.get(variable):
            found[setting.name] = _from_variable(reader, variable, setting)
    return found


def _from_variable(env: environ.Env, variable: str, setting: Setting) -> Any:
    """The value of ``variable``, cast and checked for ``setting``."""
    cast, expected = _ENV_CASTS[setting.parse]
    try:
        text = env.str(variable).strip()  # django-environ: "$OTHER" reads variable OTHER
    except ImproperlyConfigured:  # the variable it names is not set
        other = env.ENVIRON[variable].strip().lstrip("$")
        raise OutboxConfigurationError(
            f'{variable} (OUTBOX["{setting.name}"]) is "${other}", which django-environ reads '
            f"as the variable {other}, and {other} is not set"
        ) from None
    try:
        value = cast(text)
        if setting.parse is None:
            parse_routes(_dict(value), SETTINGS["DEFAULT_EXCHANGE"].default)
        else:
            setting.parse(value)
        if setting.parse is _optional_str and (reason := url_problem(value)):
            raise _Invalid(reason)
    except ValueError as exc:  # _Invalid, a failed cast (json's errors too), bad routes
        raise OutboxConfigurationError(_env_error(variable, setting, expected, text, exc)) from None
    return value


def _env_error(variable: str, setting: Setting, expected: str, text: str, exc: ValueError) -> str:
    """The one-line refusal of ``variable``: what it must hold, and what it holds when
    that is safe to show."""
    message = f'{variable} (OUTBOX["{setting.name}"]) must be {expected}'
    if setting.parse is _optional_str:  # BROKER_URL: shown masked
        return f"{message}; got {mask_url(text)}: {exc}"
    if _ENV_CASTS[setting.parse][0] is json.loads:  # may hold a password: not shown
        return f"{message}: {exc}"
    return f"{message}; got {scrub(reprlib.repr(text))}"


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("OUTBOX", "DATABASES", CELERY_OPTIONS, *CELERY_URLS):
        outbox_settings.reload()


setting_changed.connect(_on_setting_changed)
