"""The settings object: :data:`outbox_settings`, the one reader of ``settings.OUTBOX``.

Everything else reads configuration through it::

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

import importlib.util
import threading
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

from ..exceptions import OutboxConfigurationError
from . import catalog, parsers
from .brokers import KAFKA_SCHEME, Broker, broker_scheme
from .catalog import SETTINGS
from .diagnostics import broker_problem, route_problems, unknown_alias
from .passwords import CELERY_OPTIONS, CELERY_URLS, passwords
from .problems import CHECK_IDS, NO_BROKER, Problem
from .redact import mask_url, scrub
from .routes import DEFAULT_BROKER, Route, did_you_mean, parse_routes

#: How many routes of destinations not in ``ROUTES`` (the default route, Django task
#: queues) ``route_for`` keeps built; past it, it starts again.
MAX_UNNAMED_ROUTES = 1024


class OutboxSettings:
    """Attribute access to the parsed ``OUTBOX`` settings, e.g. ``outbox_settings.BATCH_SIZE``."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] = {}
        # Held by a reload and by a read that parses: a read that raced a reload
        # cannot leave the old value behind it. Reentrant: a setting's parse reads others.
        self._lock = threading.RLock()

    def reload(self) -> None:
        with self._lock:
            for name in SETTINGS:  # those read since the last reload are on the instance
                self.__dict__.pop(name, None)
            self._cache.clear()
            passwords.reset()

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

    def _parse(self, name: str) -> Any:
        raw = catalog.raw(name)
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
        except parsers.Invalid as exc:
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
            problem = NO_BROKER if not self.brokers else unknown_alias(alias, self.brokers)
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
        """The route that declares ``queue`` (or has it as a partition queue, or as its
        Kafka topic), so a
        consumer declares the same exchange, queue and binding as the relay; for a
        queue no route names,
        the default route of a destination called ``queue`` (or, with
        DEFAULT_ROUTE off, the bare queue)."""
        for route in self.ROUTES.values():
            if queue == route.queue or queue in route.partition_queues:
                return route
            if route.is_kafka and queue == route.topic_name:  # a Kafka consumer's topic
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
            return [NO_BROKER]
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
        of the system check that reports it (E006, E007, E010 or E011). Consumers only
        (the relay has :meth:`require_broker`): a Kafka broker is refused, which kombu's
        own ``kafka://`` transport would read as kombu messages (the consumer reads one
        by its alias, the replay by the parked message's route)."""
        if not url:
            url = self.require_broker().url
        elif (problem := broker_problem(url)) is not None:
            raise OutboxConfigurationError(f"{problem.id}: {problem.msg} {problem.hint}")
        if broker_scheme(url) == KAFKA_SCHEME:
            raise OutboxConfigurationError(
                f"{mask_url(url)} is a Kafka cluster, which is not given by URL: name its "
                "alias of OUTBOX['BROKERS'] (run_outbox_consumer --broker ALIAS; "
                "outbox_replay_parked finds it by the parked message's topic)"
            )
        return url

    def secrets(self) -> list[str]:
        """The passwords of the broker URLs, the transport options and the databases, and
        the signing keys, for :meth:`redact`; read once until the next reload."""
        return passwords.get()

    def redact(self, text: str) -> str:
        """``text`` (a driver's error message, a log line) without any URL's password
        or any password of the project's configuration."""
        return passwords.redact(text)


def sets_tasks() -> bool:
    """Whether the project sets Django's ``TASKS`` (Django 6.0+): then the checks of its
    task backends must run, whether or not anything imported ``django.tasks``."""
    overridden: bool = settings.is_overridden("TASKS")  # type: ignore[misc]
    return overridden and importlib.util.find_spec("django.tasks") is not None


outbox_settings = OutboxSettings()


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("OUTBOX", "DATABASES", CELERY_OPTIONS, *CELERY_URLS):
        outbox_settings.reload()


setting_changed.connect(_on_setting_changed)
