"""Keeping broker and database passwords out of every text a user sees.

:func:`mask_url` turns a broker URL, even a malformed one, into
``amqp://user:***@host:5672/vhost``; :func:`url_problem` says why a URL cannot be
parsed without quoting it; :func:`scrub` takes known secrets (and any URL's
password) out of an arbitrary text, such as a driver's error message;
:class:`SecretFilter` does that to the log records of a logger;
:func:`describe` writes an exception as text even when its ``__str__`` raises.

Nothing here reads settings: :meth:`~django_outbox.conf.OutboxSettings.redact`
supplies the secrets of the project's configuration.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

MASK = "***"

_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://(.*)", re.DOTALL)
#: A transport named without "://" (kombu accepts ``memory`` for ``memory://``).
_ALIAS = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*")
#: A URL inside a longer text: a scheme, "://" and everything up to white space or a quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")
#: Query parameters whose values are secrets.
_SECRET_PARAMETER = re.compile(r"pass|secret|token|key|auth|credential", re.IGNORECASE)
#: Where a URL parser splits a password that was not percent-encoded; the pieces
#: of a password show up in its error messages.
_DELIMITERS = re.compile(r"[#?/@:;]")
#: Secrets (and pieces of them) shorter than this are not scrubbed: they would
#: mask ordinary words of the text and hide nothing worth hiding.
MIN_SECRET_LENGTH = 4


def _split(url: str) -> tuple[str, str | None, str, str] | None:
    """``(scheme, userinfo or None, host[:port], rest)`` of one URL, the userinfo
    being everything up to the last "@" (so a password with an unquoted "@", "/",
    "?" or "#" stays in it); None when the text has no ``scheme://``."""
    match = _SCHEME.fullmatch(url)
    if match is None:
        return None
    scheme, remainder = match.groups()
    userinfo, at, after = remainder.rpartition("@")
    end = min((i for i in map(after.find, "/?#") if i != -1), default=len(after))
    return scheme, userinfo if at else None, after[:end], after[end:]


#: A Kafka bootstrap list (which has no place for a password: E010), and the punctuation
#: that follows it in a sentence, which would otherwise read as a password after a ":".
_KAFKA_LIST = re.compile(
    r"kafka://(?:(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5},?)+[),.:]*", re.IGNORECASE
)


def _mask_one(url: str) -> str:
    if _KAFKA_LIST.fullmatch(url):
        return url
    parts = _split(url)
    if parts is None:
        if _ALIAS.fullmatch(url):
            return url
        return MASK + "@" + url.rpartition("@")[2] if "@" in url else MASK
    scheme, userinfo, hostport, rest = parts
    host, colon, port = hostport.rpartition(":")
    if colon and not port.isdigit() and not hostport.endswith("]"):
        # "scheme://user:password" with no "@": the password sits where the port
        # goes, and whatever follows may be more of it.
        return f"{scheme}://{host}:{MASK}"
    credentials = ""
    if userinfo is not None:
        user, colon, _password = userinfo.partition(":")
        credentials = f"{user}:{MASK}@" if colon else f"{user}@"
    return f"{scheme}://{credentials}{hostport}{_mask_query(rest)}"


def _mask_query(rest: str) -> str:
    """``/vhost?query#fragment`` with the values of secret-looking parameters masked."""
    path, question, query = rest.partition("?")
    if not question:
        return rest
    query, hash_, fragment = query.partition("#")
    pairs = [
        (name, MASK if _SECRET_PARAMETER.search(name) else value)
        for name, value in parse_qsl(query, keep_blank_values=True)
    ]
    return f"{path}?{urlencode(pairs, safe='*/:')}{hash_}{fragment}"


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``, safe to show whatever it holds.

    Works on malformed URLs too (a password with an unquoted "#", "?", "/" or "@"),
    and on kombu's failover lists (``amqp://a;amqp://b``). Where a URL is too broken
    to tell the password from the host, more is masked, never less.
    """
    return ";".join(_mask_one(part) for part in url.split(";"))


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot be parsed as ``transport://user:password@host:port/vhost``
    (a phrase that never quotes the URL), or None when it can. A failover list
    (``amqp://a//;amqp://b//``) must name one transport in every address."""
    if (reason := _failover_problem(url.split(";"))) is not None:
        return reason
    for part in url.split(";"):
        parts = _split(part)
        if parts is None:
            if not _ALIAS.fullmatch(part):
                return "it is not of the form transport://user:password@host:port/vhost"
            continue
        _scheme, userinfo, hostport, _rest = parts
        if userinfo is not None and any(c in userinfo for c in "/?#@"):
            return 'its user name or password holds an unquoted "@", "/", "?" or "#"'
        port = hostport.rpartition(":")[2] if ":" in hostport.rpartition("]")[2] else ""
        if port and not (port.isdigit() and int(port) < 65536):
            return 'its port is not a number (a password with an unquoted ";", or no "@"?)'
        try:
            urlsplit(part).port  # noqa: B018 (parsing is the point: it raises on what it cannot read)
        except ValueError:
            return "Python's URL parser cannot read it (an unquoted reserved character?)"
    return None


def _failover_problem(parts: list[str]) -> str | None:
    """Why the addresses of a failover list cannot make one broker, or None."""
    if len(parts) < 2:
        return None
    if any(not part or part != part.strip() for part in parts):
        return 'its failover list has an empty address or white space around a ";"'
    schemes = sorted({match[1].lower() for match in map(_SCHEME.fullmatch, parts) if match})
    if len(schemes) > 1:
        return f"its failover list mixes transports ({', '.join(schemes)}); a list names one broker"
    return None


def url_passwords(url: str) -> list[str]:
    """The passwords written in ``url`` (each as written and percent-decoded), for
    :func:`scrub`. Where the URL is too malformed to tell, everything that might be
    one: a port that is not a number, or all that comes before an "@"."""
    found = []
    for part in url.split(";"):
        parts = _split(part)
        if parts is None:
            if not _ALIAS.fullmatch(part):
                found.append(part.rpartition("@")[0] or part)
            continue
        userinfo, hostport = parts[1], parts[2]
        password = (userinfo or "").partition(":")[2]
        found += [password, unquote(password)] if password else []
        port = hostport.rpartition(":")[2] if ":" in hostport else ""
        if port and not port.isdigit():
            found.append(port)
    return found


def option_secrets(options: object) -> list[str]:
    """The secrets held in transport options (``BROKER_TRANSPORT_OPTIONS`` and the like),
    for :func:`scrub`: every text under a secret-looking key (``password``,
    ``secret_access_key``, ``sentinel_kwargs["password"]`` ...), and the passwords of every
    URL among the values, however deep in dicts and lists."""
    found: list[str] = []
    stack: list[tuple[str, object]] = [("", options)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack += [(str(k), v) for k, v in value.items()]
        elif isinstance(value, list | tuple):
            stack += [(key, v) for v in value]
        elif isinstance(value, str):
            if _SECRET_PARAMETER.search(key):
                found.append(value)
            elif "://" in value:
                found += url_passwords(value)
    return found


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL's password masked, and every one of ``secrets`` and of
    the passwords of the URLs in ``text`` (and each piece of them a URL parser might
    have split off and quoted) replaced by ``***``."""
    urls = _URL_IN_TEXT.findall(text)
    pieces = set()
    for secret in [*secrets, *(password for url in urls for password in url_passwords(url))]:
        pieces.add(secret)
        pieces.update(_DELIMITERS.split(secret))
    # The secrets go first: a password with a space or a quote ends the URL it is in,
    # and masking that URL first would leave the rest of it for no secret to match.
    for piece in sorted(pieces, key=len, reverse=True):  # the longest first
        if len(piece) >= MIN_SECRET_LENGTH and not piece.isdigit():
            text = text.replace(piece, MASK)
    return _URL_IN_TEXT.sub(lambda match: mask_url(match.group(0)), text)


#: What stands for the message of an exception (or a log argument) whose ``__str__``
#: raises: the words Python's own tracebacks use.
UNPRINTABLE = "<exception str() failed>"


def printable(value: object) -> str:
    """``str(value)``, or :data:`UNPRINTABLE` when its ``__str__`` raises (a library's
    bug must not turn a failure being reported into another one)."""
    try:
        return str(value)
    except Exception:
        return UNPRINTABLE


def describe(exc: BaseException) -> str:
    """``ClassName: message`` of ``exc``, whatever its ``__str__`` does."""
    return f"{type(exc).__name__}: {printable(exc)}"


class SecretFilter(logging.Filter):
    """Scrubs the message and the traceback of every record of the logger it is
    added to (``logger.addFilter(SecretFilter(outbox_settings.redact))``): a driver's
    error text then cannot carry a password into the logs."""

    def __init__(self, redact: Callable[[str], str]) -> None:
        super().__init__()
        self._redact = redact

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = self._redact(_message(record)), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = self._redact(logging.Formatter().formatException(record.exc_info))
        return True


def _message(record: logging.LogRecord) -> str:
    """The record's message, an argument whose ``__str__`` raises written as
    :data:`UNPRINTABLE` (logging does not guard a filter: the caller would get the error)."""
    try:
        return record.getMessage()
    except Exception:
        args = record.args
        texts: object = (
            {key: printable(value) for key, value in args.items()}
            if isinstance(args, dict)
            else tuple(map(printable, args or ()))
        )
        try:
            return printable(record.msg) % texts
        except Exception:  # the format itself does not fit its arguments
            return f"{printable(record.msg)} {texts}"
