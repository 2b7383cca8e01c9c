"""What keeps the relay or a consumer from using a broker, found without connecting:
a malformed URL (E010), an unknown kombu transport (E007), a missing driver (E011),
routes naming a broker that is not configured (E015), Celery routes without the celery
package (E016). Every text shows a URL masked, never its password.

:meth:`~django_outbox.conf.OutboxSettings.require_broker` raises these texts;
:mod:`django_outbox.ops.checks` reports them.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping

from .brokers import (
    CELERY_EXTRA,
    DRIVERS,
    KAFKA_SCHEME,
    NATS_DRIVER,
    NATS_SCHEMES,
    Broker,
    broker_scheme,
    kafka_url_problem,
    nats_servers,
)
from .passwords import passwords
from .problems import CHECK_IDS, Problem
from .redact import mask_url, url_problem
from .routes import DEFAULT_BROKER, Route, did_you_mean


def unknown_alias(alias: str, brokers: Mapping[str, Broker], user: str = "") -> Problem:
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
        unknown_alias(route.broker, brokers, f"Route {name!r} names broker {route.broker!r}: ")
        for name, route in routes.items()
        if not route.is_celery and route.broker not in brokers
    ]
    if default_route and DEFAULT_BROKER not in brokers:
        user = "The default route (DEFAULT_ROUTE is True) publishes to broker 'default': "
        found.append(unknown_alias(DEFAULT_BROKER, brokers, user))
    celery_routes = sorted(name for name, route in routes.items() if route.is_celery)
    if celery_routes and (problem := celery_problem(celery_routes)) is not None:
        found.append(problem)
    return found


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
    if broker_scheme(url) == KAFKA_SCHEME:
        return _kafka_problem(url, named)
    if broker_scheme(url) in NATS_SCHEMES:  # a comma-separated list of host:port
        reason = next(filter(None, map(url_problem, nats_servers(url))), None)
    else:
        reason = url_problem(url)
    if reason is not None:
        return Problem(
            CHECK_IDS["malformed_broker"],
            f"The broker URL {mask_url(url)}{named} is malformed: {reason}.",
            _malformed_hint(reason),
        )
    from kombu.transport import TRANSPORT_ALIASES

    scheme = url.partition("://")[0].partition("+")[0]  # kombu reads sqla+postgresql:// so
    if scheme.lower() in NATS_SCHEMES:
        return _missing_nats(url, named)
    if scheme not in TRANSPORT_ALIASES and "." not in scheme:
        return Problem(
            CHECK_IDS["bad_broker"],
            f"The broker URL{named} names an unknown kombu transport {scheme!r}.",
            "Use a kombu URL such as amqp://, redis://, memory:// or filesystem://.",
        )
    return _missing_driver(url, scheme, named)


def _kafka_problem(url: str, named: str) -> Problem | None:
    """E010 for a malformed ``kafka://`` URL, E011 naming the extra without confluent-kafka."""
    if kafka_url_problem(url) is not None:
        return Problem(
            CHECK_IDS["malformed_broker"],
            f"The broker URL {mask_url(url)}{named} is malformed: it is not of the form "
            "kafka://host:port[,host:port...].",
            "List the bootstrap brokers as kafka://host1:9092,host2:9092; credentials go in "
            'OPTIONS as librdkafka properties ("sasl.username", "sasl.password").',
        )
    module, install = DRIVERS[KAFKA_SCHEME]
    try:
        importlib.import_module(module)
    except ImportError:
        return Problem(
            CHECK_IDS["missing_driver"],
            f"The broker URL {mask_url(url)}{named} is a Kafka cluster, which needs the Python "
            f"package {module!r} (confluent-kafka), not installed: pip install {install}",
            "Install it where the relay runs, or use another broker.",
        )
    return None


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


def _missing_nats(url: str, named: str) -> Problem | None:
    """E011 if nats-py, the client of a ``nats://`` broker (not a kombu transport), is
    not installed."""
    module, install = NATS_DRIVER
    if importlib.util.find_spec(module) is not None:
        return None
    return Problem(
        CHECK_IDS["missing_driver"],
        f"The broker URL {mask_url(url)}{named} is NATS JetStream, whose client nats-py "
        f"is not installed: pip install {install}",
        "Install it where the relay runs, or use another broker.",
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
                f"cannot be loaded: {passwords.redact(f'{type(exc).__name__}: {exc}')}",
                "Install the package the error names, where the relay and the consumers run.",
            )
        return Problem(
            CHECK_IDS["missing_driver"],
            f"The broker URL {mask_url(url)}{named} needs the Python package {module!r}, "
            f"which is not installed: pip install {install}",
            "Install it where the relay and the consumers run, or use another transport.",
        )
    return None
