"""``OUTBOX`` from environment variables: :func:`from_env`, for a 12-factor settings
module (``OUTBOX = from_env()``). Each variable is cast strictly and checked by the
parser of its setting (:mod:`.catalog`), so a bad value fails when the settings module
loads, with the variable's name.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable, Mapping
from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

from ..exceptions import OutboxConfigurationError
from . import parsers
from .catalog import SETTINGS, Setting
from .redact import mask_url, scrub, url_problem
from .routes import parse_routes

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
    parsers.positive_int: (int, "a positive integer"),
    parsers.seconds: (float, "a positive number of seconds"),
    parsers.duration: (float, "a positive number of seconds"),
    parsers.seconds_or_zero: (float, "0 or a positive number of seconds"),
    parsers.duration_or_zero: (float, "0 or a positive number of seconds"),
    parsers.fraction: (float, "a number between 0 and 1"),
    parsers.boolean: (_env_bool, "true or false (also 1/0, yes/no, on/off)"),
    parsers.optional_str: (str, "a kombu URL such as amqp://user:password@host//"),  # BROKER_URL
    parsers.exchange_name: (str, "an exchange name of letters, digits and ._:/-"),
    parsers.string_dict: (json.loads, "a JSON object"),
    parsers.broker_table: (json.loads, 'a JSON object of brokers: {"alias": {"URL": ...}}'),
    parsers.signing_keys: (json.loads, 'a JSON list of keys: ["...", "..."]'),
    parsers.envelope: (str, "outbox, cloudevents or cloudevents-structured"),
    parsers.text: (str, "a non-empty string"),
    parsers.partitioning: (json.loads, 'a JSON object: {"rows": ids per partition, "ahead": 2}'),
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
            parse_routes(parsers.string_dict(value), SETTINGS["DEFAULT_EXCHANGE"].default)
        else:
            setting.parse(value)
        if setting.parse is parsers.optional_str and (reason := url_problem(value)):
            raise parsers.Invalid(reason)
    except ValueError as exc:  # parsers.Invalid, a failed cast (json's errors too), bad routes
        raise OutboxConfigurationError(_env_error(variable, setting, expected, text, exc)) from None
    return value


def _env_error(variable: str, setting: Setting, expected: str, text: str, exc: ValueError) -> str:
    """The one-line refusal of ``variable``: what it must hold, and what it holds when
    that is safe to show."""
    message = f'{variable} (OUTBOX["{setting.name}"]) must be {expected}'
    if setting.parse is parsers.optional_str:  # BROKER_URL: shown masked
        return f"{message}; got {mask_url(text)}: {exc}"
    if _ENV_CASTS[setting.parse][0] is json.loads:  # may hold a password: not shown
        return f"{message}: {exc}"
    return f"{message}; got {scrub(reprlib.repr(text))}"
