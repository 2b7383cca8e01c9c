"""Staging events in the business transaction: ``stage``, ``stage_many``, ``@publish_on_success``.

An event is a row of ``OutboxMessage`` inserted on the same connection, in the
same transaction, as the business write: it exists if and only if that
transaction commits. Everything that can be wrong with an event (payload that
is not JSON, malformed or unknown destination, bad key or headers) is raised
here, before any SQL, so the caller's transaction rolls back whole.

This module does not import the models at import time, so
``import django_outbox`` works before ``django.setup()``.
"""

from __future__ import annotations

import copy as copy_module
import dataclasses
import datetime as dt
import functools
import inspect
import json
import logging
import re
import reprlib
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from django.apps import apps
from django.core.serializers.json import DjangoJSONEncoder
from django.db import transaction
from django.utils import timezone

from .. import db, tracing
from ..cloudevents import is_attribute_header
from ..conf import MISSING_APP, outbox_settings
from ..conf.redact import SecretFilter
from ..conf.routes import (
    MAX_NAME_BYTES,
    Route,
    celery_header_clash,
    did_you_mean,
    is_valid_destination,
)
from ..envelope import BROKER_HEADERS, COMPRESSION_HEADER, RELAY_HEADERS, is_broker_header
from ..exceptions import (
    InvalidDestination,
    InvalidEvent,
    NotInTransaction,
    OutboxConfigurationError,
    PayloadNotSerializable,
    PayloadTooLarge,
    StagingError,
    UnknownDestination,
)
from ..signals import event_committed

if TYPE_CHECKING:
    from ..models import OutboxMessage

logger = logging.getLogger("django_outbox.staging")
logger.addFilter(SecretFilter(outbox_settings.redact))  # receivers' error texts and tracebacks

P = ParamSpec("P")
R = TypeVar("R")

#: Wire headers the relay writes itself, ``compression``, which makes every kombu
#: consumer try to decompress the body, and the headers brokers set or act on
#: (:data:`~django_outbox.envelope.BROKER_HEADERS`, and the prefixes of
#: :func:`~django_outbox.envelope.is_broker_header`): no user header takes them.
RESERVED_HEADERS = frozenset(
    {
        "event_id",
        "event_type",
        "occurred_at",
        "ordering_key",
        COMPRESSION_HEADER,
        *RELAY_HEADERS,
        *BROKER_HEADERS,
    }
)
EVENT_FIELDS = frozenset(
    {"event_type", "payload", "destination", "key", "headers", "available_at", "dedup_key"}
)
#: What ``stage(on_duplicate=...)`` may say when an unfinished event with the dedup key
#: exists on the destination: keep that one, or replace its payload, headers and time.
ON_DUPLICATE = ("keep", "replace")
_REQUIRED_FIELDS = ("event_type", "payload", "destination")
_MAX_LENGTH = 255
#: Integers in AMQP headers are signed 64-bit; JSON whole numbers past it cannot go there
#: (nor floats, which PostgreSQL's jsonb prints without exponent: 1e20 becomes an integer).
_AMQP_INT_LIMIT = 2**63
#: The most an event's headers may take as an AMQP field table (as py-amqp encodes it,
#: counted from above): they travel in one content-header frame, which must fit the
#: broker's ``frame_max`` (128 KiB on RabbitMQ by default) with the other properties. A
#: larger one made RabbitMQ close the connection, failing every message of the batch.
MAX_HEADERS_BYTES = 65_536
#: Characters PostgreSQL cannot store in text or jsonb: NUL and the surrogates, which are
#: not Unicode characters (Python strings can hold them, UTF-8 cannot encode them).
_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")
#: A NUL in JSON text: ``\u0000`` after an even number of backslashes (``\\u0000`` is
#: an escaped backslash followed by the letters "u0000", which is fine).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def stage(
    event_type: str,
    payload: Any,
    *,
    destination: str,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    using: str = "default",
    available_at: dt.datetime | None = None,
    dedup_key: str | None = None,
    on_duplicate: str = "keep",
) -> OutboxMessage:
    """Stage one event in the current transaction of ``using`` and return its row.

    Must run inside ``transaction.atomic(using=using)``. The payload is encoded
    to JSON now (``DjangoJSONEncoder``: datetime, Decimal and UUID are fine);
    the row stores what will go on the wire.

    With ``dedup_key``, at most one unfinished event per (destination, dedup key):
    the row returned is then the one that stays, and its ``staging_outcome`` says
    ``"staged"``, ``"deduplicated"``, ``"replaced"`` or ``"in_flight"`` (see
    docs/scheduling.md).
    """
    (row,) = _insert(
        [
            _build(
                event_type,
                payload,
                destination=destination,
                key=key,
                headers=headers,
                available_at=available_at,
                dedup_key=dedup_key,
            )
        ],
        using,
        on_duplicate,
    )
    return row


def stage_many(
    events: Iterable[Mapping[str, Any]], *, using: str = "default", on_duplicate: str = "keep"
) -> list[OutboxMessage]:
    """Stage many events with as few INSERTs as the database takes; each event is a
    dict of ``stage()``'s arguments (``event_type``, ``payload``, ``destination``,
    optional ``key``, ``headers``, ``available_at``, ``dedup_key``). All are validated
    before anything is written. Returns a row per event, in order; events of one call
    that share a dedup key on a destination are staged once (``on_duplicate="replace"``
    refuses them: which one wins would be a guess)."""
    rows = [_build_nth(index, event) for index, event in enumerate(events)]
    return _insert(rows, using, on_duplicate) if rows else []


def publish_on_success(
    event_type: str,
    *,
    destination: str,
    payload: Callable[..., Any],
    key: Callable[..., str | None] | None = None,
    using: str = "default",
    dedup_key: str | Callable[..., str | None] | None = None,
    on_duplicate: str = "keep",
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function so that, when it returns, one event is staged in its transaction.

    The call runs in ``transaction.atomic(using=using)`` (a savepoint when an
    outer atomic block is open). ``payload`` and ``key`` are called as
    ``payload(result, *args, **kwargs)``; ``dedup_key`` is a string, or a callable
    called the same way. If the function raises, nothing is staged; if an outer
    block rolls back, the event goes with it.
    """
    _check_event_type(event_type)
    _check_destination_format(destination)
    _check_mappers(payload, key)
    _check_on_duplicate(on_duplicate)
    if dedup_key is not None and not callable(dedup_key):
        _check_dedup_key(dedup_key, event_type)

    def decorator(func: Callable[P, R]) -> Callable[P, R]:
        _check_not_async(func)

        @functools.wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with transaction.atomic(using=using):
                result = func(*args, **kwargs)
                call = _MapperCall(event_type, func.__name__, result, args, kwargs)
                stage(
                    event_type,
                    call("payload", payload),
                    destination=destination,
                    key=None if key is None else call("key", key),
                    using=using,
                    dedup_key=call("dedup_key", dedup_key) if callable(dedup_key) else dedup_key,
                    on_duplicate=on_duplicate,
                )
            return result

        return wrapper

    return decorator


def _check_not_async(func: Callable[..., Any]) -> None:
    if inspect.iscoroutinefunction(func):
        raise TypeError(
            f"publish_on_success cannot wrap the coroutine function {func.__qualname__}: "
            "database transactions are synchronous; decorate a sync function and call it "
            "with asgiref's sync_to_async"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _MapperCall:
    """One call of a ``@publish_on_success`` function, for its ``payload`` and ``key``."""

    event_type: str
    function: str
    result: object
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __call__(self, name: str, mapper: Callable[..., Any]) -> Any:
        """``mapper(result, *args, **kwargs)``; a mapper whose signature cannot take that
        call is refused saying how it is called (a TypeError of its body stays its own)."""
        try:
            return mapper(self.result, *self.args, **self.kwargs)
        except TypeError:
            try:
                inspect.signature(mapper).bind(self.result, *self.args, **self.kwargs)
            except TypeError as refusal:
                raise TypeError(
                    f"@publish_on_success({self.event_type!r}) calls {name}= as "
                    f"{name}(result, *args, **kwargs), with {self.function}'s return value and "
                    f"the arguments it was called with; {getattr(mapper, '__name__', mapper)} "
                    f"cannot take them: {refusal}"
                ) from None
            except ValueError:  # no signature to read (some builtins)
                pass
            raise


def _check_mappers(payload: object, key: object) -> None:
    """``publish_on_success``'s ``payload`` and ``key`` must be callables."""
    if not callable(payload):
        raise TypeError(
            "publish_on_success(payload=...) must be a callable (result, *args, **kwargs) -> dict"
        )
    if key is not None and not callable(key):
        raise TypeError(
            "publish_on_success(key=...) must be None or a callable "
            "(result, *args, **kwargs) -> str"
        )


def _event_kwargs(index: int, event: object) -> dict[str, Any]:
    if not isinstance(event, Mapping):
        raise InvalidEvent(
            f"stage_many(): event #{index} must be a dict; got {type(event).__name__}"
        )
    unknown = set(event) - EVENT_FIELDS
    if unknown:
        raise InvalidEvent(
            f"stage_many(): event #{index} has unknown keys {sorted(map(str, unknown))}; "
            f"allowed: {', '.join(sorted(EVENT_FIELDS))}"
        )
    missing = [name for name in _REQUIRED_FIELDS if name not in event]
    if missing:
        raise InvalidEvent(f"stage_many(): event #{index} lacks {', '.join(missing)}")
    return dict(event)


def _build_nth(index: int, event: object) -> OutboxMessage:
    """Event ``index`` of a ``stage_many()`` call, its refusal saying which one it is."""
    kwargs = _event_kwargs(index, event)
    try:
        return _build(**kwargs)
    except StagingError as exc:
        raise type(exc)(f"stage_many(): event #{index}: {exc}") from None


def _build(
    event_type: str,
    payload: Any,
    *,
    destination: str,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    available_at: dt.datetime | None = None,
    dedup_key: str | None = None,
) -> OutboxMessage:
    _check_event_type(event_type)
    route = _route_of(destination)
    _check_key(key, route, event_type)
    if dedup_key is not None:
        _check_dedup_key(dedup_key, event_type)
        if route.ordered:
            raise InvalidEvent(
                f"event {event_type!r}: dedup_key is refused on ordered routes ({destination!r} "
                "is one): an event left out would leave a gap in its key's sequence"
            )
    fields: dict[str, Any] = {
        "event_type": event_type,
        "destination": destination,
        "payload": to_json(payload, "payload", event_type),
        "headers": _check_header_values(
            to_json(
                tracing.stamp(_check_headers(headers, event_type, route)), "headers", event_type
            ),
            event_type,
        ),
        "ordering_key": key or "",
        "dedup_key": dedup_key,
    }
    if available_at is not None:
        fields["available_at"] = _check_time(available_at, event_type)
    return _outbox_model()(**fields)


def _check_key(key: str | None, route: Route, event_type: str) -> None:
    """:class:`InvalidEvent` for a key that is not a short storable string, or missing
    where ``route`` is ordered, or that makes a routing key the route cannot carry."""
    if key is not None:
        _check_text(key, "key", "key", event_type)
    if key is None and route.ordered:
        destination = route.destination
        which = (
            f"the route of {destination!r} is ordered"
            if destination in outbox_settings.ROUTES
            else f"the default route of {destination!r} is ordered (OUTBOX['DEFAULT_ORDERED'])"
        )
        raise InvalidEvent(
            f"event {event_type!r}: {which}, and its events keep their order per key: "
            "give key= (the aggregate's id, say)"
        )
    _check_routing_key(route, key or "", event_type)


def _route_of(destination: str) -> Route:
    """The route events to ``destination`` take; :class:`UnknownDestination` if none."""
    _check_destination_format(destination)
    route = outbox_settings.route_for(destination)
    if route is None:
        raise UnknownDestination(
            f"destination {destination!r} is not in OUTBOX['ROUTES']"
            f"{did_you_mean(destination, outbox_settings.ROUTES)} and "
            "OUTBOX['DEFAULT_ROUTE'] is False: add a route for it or turn the default route on"
        )
    return route


def _outbox_model() -> type[OutboxMessage]:
    """The outbox model; :class:`OutboxConfigurationError` (E050's text) when the app is
    not in ``INSTALLED_APPS``, instead of Django's ``LookupError``."""
    try:
        return apps.get_model("django_outbox", "OutboxMessage")
    except LookupError:
        raise OutboxConfigurationError(
            f"{MISSING_APP.id}: {MISSING_APP.msg} {MISSING_APP.hint}"
        ) from None


def _require_atomic(using: str, what: str) -> None:
    connection = transaction.get_connection(using)
    if not in_user_atomic(connection):
        raise NotInTransaction(
            f"{what} must run inside transaction.atomic(using={using!r}) together with the "
            "business write it belongs to; wrap both in one atomic block, or use "
            "@publish_on_success, which opens it"
            + (
                " (a TestCase's own transaction does not count)"
                if connection.in_atomic_block
                else ""
            )
        )


def _insert(rows: list[OutboxMessage], using: str, on_duplicate: str) -> list[OutboxMessage]:
    _check_on_duplicate(on_duplicate)
    _require_atomic(using, "stage()")
    first = _first_of_each_dedup_key(rows, on_duplicate)
    kept = sorted(set(first))
    saved = dict(
        zip(
            kept,
            db.insert(
                using,
                [rows[index] for index in kept],
                _ordered({row.destination for row in rows}),
                replace=on_duplicate == "replace",
            ),
            strict=True,
        )
    )
    result = [
        saved[index] if first[index] == index else _deduplicated(saved[first[index]])
        for index in range(len(rows))
    ]
    created = [row for row in saved.values() if row.staging_outcome == "staged"]
    if created:
        transaction.on_commit(functools.partial(_committed, created, using), using=using)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "staged %d event(s) on %s",
            len(created),
            using,
            extra={"action": "outbox.staged", "count": len(created), "using": using},
        )
    return result


def _first_of_each_dedup_key(rows: list[OutboxMessage], on_duplicate: str) -> list[int]:
    """For each row, the index of the first row of the call with its (destination, dedup
    key): its own index when it has no dedup key or is the first. With ``replace``, a
    dedup key given twice in one call is refused."""
    seen: dict[tuple[str, str], int] = {}
    first = []
    for index, row in enumerate(rows):
        if row.dedup_key is None:
            first.append(index)
            continue
        earlier = seen.setdefault((row.destination, row.dedup_key), index)
        if earlier != index and on_duplicate == "replace":
            raise InvalidEvent(
                f"stage_many(): events #{earlier} and #{index} share dedup key "
                f"{row.dedup_key!r} on {row.destination!r}; with on_duplicate='replace' "
                "give each dedup key once a call"
            )
        first.append(earlier)
    return first


def _deduplicated(row: OutboxMessage) -> OutboxMessage:
    """``row`` as a later event of the same call with its dedup key gets it back."""
    copy = copy_module.copy(row)
    copy.staging_outcome = "deduplicated"
    return copy


def _check_on_duplicate(on_duplicate: object) -> None:
    if on_duplicate not in ON_DUPLICATE:
        raise InvalidEvent(
            f"on_duplicate must be one of {', '.join(map(repr, ON_DUPLICATE))}; "
            f"got {on_duplicate!r}"
        )


def _check_dedup_key(dedup_key: object, event_type: str) -> None:
    _check_text(dedup_key, "dedup_key", "dedup key", event_type)


def _check_text(value: object, argument: str, what: str, event_type: str) -> None:
    """:class:`InvalidEvent` unless ``value`` (given as ``argument``) is a non-empty
    string of at most ``_MAX_LENGTH`` characters that PostgreSQL can store."""
    if not (isinstance(value, str) and 0 < len(value) <= _MAX_LENGTH):
        raise InvalidEvent(
            f"event {event_type!r}: {argument} must be None or a non-empty string of at most "
            f"{_MAX_LENGTH} characters; got {_describe_key(value)}"
        )
    if bad := _UNSTORABLE.search(value):
        raise InvalidEvent(_unstorable(bad.group(), f"the {what} of event {event_type!r}"))


def cancel(
    *,
    destination: str,
    dedup_key: str | None = None,
    event_id: uuid.UUID | str | None = None,
    using: str = "default",
) -> bool:
    """Remove, in the current transaction of ``using``, the unfinished event of
    ``destination`` with ``dedup_key`` (or ``event_id``) that no relay has claimed;
    returns whether there was one. An event in flight is not cancelled
    (:class:`~django_outbox.exceptions.EventInFlight`), nor one of an ordered route
    (:class:`~django_outbox.exceptions.CancelRefused`). See docs/scheduling.md."""
    if (dedup_key is None) == (event_id is None):
        raise TypeError("cancel() takes one of dedup_key= and event_id=, exactly one")
    _check_destination_format(destination)
    _require_atomic(using, "cancel()")
    from ..state import store

    return store.cancel(using, destination, dedup_key=dedup_key, event_id=event_id)


def in_user_atomic(connection: Any) -> bool:
    """Whether ``connection`` is inside an atomic block of the caller's code. Those a test
    case opens around each test (Django's ``TestCase``, pytest-django's ``django_db``;
    Django marks them ``_from_testcase``) do not count: there is none in production, so
    a ``stage()`` that runs in them alone fails in tests as it would in production."""
    return connection.in_atomic_block and not all(
        getattr(block, "_from_testcase", False) for block in connection.atomic_blocks
    )


def _ordered(destinations: set[str]) -> frozenset[str]:
    """Those of ``destinations`` whose route is ordered now: their events take a
    sequence number, and keep it whatever the route says later."""
    return frozenset(
        destination
        for destination in destinations
        if getattr(outbox_settings.route_for(destination), "ordered", False)
    )


def _committed(rows: list[OutboxMessage], using: str) -> None:
    model = type(rows[0])
    for receiver, error in event_committed.send_robust(model, messages=rows, using=using):
        if isinstance(error, Exception):
            logger.error(
                "event_committed receiver %r failed",
                receiver,
                exc_info=error,
                extra={"action": "outbox.signal_failed", "signal": "event_committed"},
            )


def to_json(value: Any, what: str, event_type: str) -> Any:
    """Encode once with DjangoJSONEncoder (strict: no NaN) and keep the decoded form,
    which is exactly what the row stores and the relay sends.

    Refused here, before any SQL: what JSON cannot encode, text PostgreSQL cannot
    store (NUL, surrogates: its error would abort the caller's transaction) and
    JSON over ``MAX_PAYLOAD_BYTES``. The text is encoded without ASCII escapes,
    so that UTF-8 encoding both measures it and fails on any surrogate, and a NUL
    is the only character that still appears as ``\\u0000``."""
    where = f"the {what} of event {event_type!r}"
    try:
        text = json.dumps(value, cls=DjangoJSONEncoder, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise PayloadNotSerializable(f"{where} is not JSON-serialisable: {exc}") from None
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        raise PayloadNotSerializable(_unstorable(exc.object[exc.start], where)) from None
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise PayloadNotSerializable(_unstorable("\x00", where))
    limit = outbox_settings.MAX_PAYLOAD_BYTES
    if size > limit:
        raise PayloadTooLarge(
            f"the JSON of {where} is {size} bytes, more than "
            f'OUTBOX["MAX_PAYLOAD_BYTES"] ({limit}): stage a reference to the data '
            "(an id, a URL) instead, or raise the setting"
        )
    return json.loads(text)


def _unstorable(char: str, where: str) -> str:
    """The refusal of ``char`` (NUL or a surrogate) in ``where``, without the text around it."""
    if char == "\x00":
        return f"PostgreSQL cannot store the NUL character (\\u0000) in {where}"
    return (
        f"PostgreSQL cannot store the lone surrogate \\u{ord(char):04x} in {where}: "
        "it is half of a UTF-16 pair, not a Unicode character"
    )


def _check_routing_key(route: Route, key: str, event_type: str) -> None:
    """The routing key ``key`` makes must fit AMQP's 255 bytes, or no broker takes it."""
    size = 0 if route.is_celery else len(route.routing_key_for(key).encode())
    if size > MAX_NAME_BYTES:
        raise InvalidEvent(
            f"event {event_type!r}: its key makes the routing key of route "
            f"{route.destination!r} {size} bytes long, over AMQP's {MAX_NAME_BYTES}; "
            "use a shorter key"
        )


def _check_event_type(event_type: object) -> None:
    if not (isinstance(event_type, str) and 0 < len(event_type) <= _MAX_LENGTH):
        raise InvalidEvent(
            f"event_type must be a non-empty string of at most {_MAX_LENGTH} characters; "
            f"got {reprlib.repr(event_type)}"
        )
    if bad := _UNSTORABLE.search(event_type):
        raise InvalidEvent(_unstorable(bad.group(), f"event_type {reprlib.repr(event_type)}"))


def _check_destination_format(destination: object) -> None:
    if not is_valid_destination(destination):
        raise InvalidDestination(
            f"destination {reprlib.repr(destination)} is malformed: use 1-255 characters of "
            "letters, digits and ._:/- starting with a letter or digit"
        )


def _check_headers(
    headers: Mapping[str, Any] | None, event_type: str, route: Route
) -> dict[str, Any]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping) or not all(isinstance(k, str) and k for k in headers):
        raise InvalidEvent(
            f"event {event_type!r}: headers must be a dict with non-empty string keys"
        )
    clash = [
        name
        for name in headers
        if name in RESERVED_HEADERS or is_broker_header(name) or is_attribute_header(name)
    ]
    if clash:
        raise InvalidEvent(
            f"event {event_type!r}: headers {sorted(clash)} are reserved for the relay, "
            "kombu and the brokers and cannot be given"
        )
    refused = celery_header_clash(route, headers)
    if refused:
        raise InvalidEvent(f"event {event_type!r}: {refused}")
    return dict(headers)


def _describe_key(key: object) -> str:
    """What was wrong with a key, without its text (it may be long, or a secret)."""
    if not isinstance(key, str):
        return type(key).__name__
    return f"a string of {len(key)} characters" if key else "an empty string"


def _check_header_values(headers: dict[str, Any], event_type: str) -> dict[str, Any]:
    """Headers travel as AMQP field tables, whose names (nested ones too) are at most 255
    bytes and whose integers have 64 bits; the relay could not publish others."""
    for name, value in headers.items():
        if problem := _amqp_problem(name, value):
            raise InvalidEvent(
                f"event {event_type!r}: header {reprlib.repr(name)} {problem}, which AMQP "
                "headers cannot carry; put it in the payload or send it as a string"
            )
    size = _amqp_size(headers)
    if size > MAX_HEADERS_BYTES:
        raise InvalidEvent(
            f"event {event_type!r}: the headers take {size} bytes as an AMQP field table, "
            f"more than the {MAX_HEADERS_BYTES} a message's properties can carry; put the "
            "data in the payload"
        )
    return headers


def _amqp_size(value: Any) -> int:
    """The bytes ``value`` takes in an AMQP field table at most: a type octet, then a
    32-bit length and the UTF-8 text, 8 bytes for a number, a length octet before a name."""
    if isinstance(value, dict):
        return 5 + sum(1 + len(k.encode()) + _amqp_size(v) for k, v in value.items())
    if isinstance(value, list):
        return 5 + sum(map(_amqp_size, value))
    if isinstance(value, str):
        return 5 + len(value.encode())
    return 9


def _amqp_problem(name: str, value: Any) -> str | None:
    if len(name.encode()) > _MAX_LENGTH:
        return f"has a name (or holds a key) of over {_MAX_LENGTH} bytes"
    if isinstance(value, int | float) and not -_AMQP_INT_LIMIT <= value < _AMQP_INT_LIMIT:
        return "holds a number outside the signed 64-bit range"
    children: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        children = list(value.items())
    elif isinstance(value, list):
        children = [("", item) for item in value]
    return next((p for key, child in children if (p := _amqp_problem(key, child))), None)


def _check_time(value: object, event_type: str) -> dt.datetime:
    if not isinstance(value, dt.datetime):
        raise InvalidEvent(
            f"event {event_type!r}: available_at must be a datetime; got {type(value).__name__}"
        )
    if timezone.is_naive(value):
        raise InvalidEvent(
            f"event {event_type!r}: available_at must be timezone-aware "
            "(use django.utils.timezone.now() + timedelta(...))"
        )
    return value
