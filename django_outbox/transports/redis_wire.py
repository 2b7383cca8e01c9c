"""A route's batch written to Redis in kombu's own message format, one pipeline per batch.

kombu's producer builds, encodes and routes every message in Python of its own (the
message dict, its augmentation, the exchange's lookup, a JSON dump, one ``LPUSH``), and
that is most of what a relay publishing to Redis spends. :class:`RedisWire` keeps the
result and drops the repetition: per batch and routing key, it asks kombu's channel for
everything that does not change from one message to the next (the message's JSON around
its body, headers, message id and delivery tag; the list each queue keeps its priority's
messages in), reads the exchange's bindings from kombu's binding set once, and per
message fills four holes in that text, written as its ``LPUSH`` value (Redis's protocol)
at once. The batch's messages go out in one non-transactional pipeline: an ``LPUSH`` of
many values per list, in the batch's order, so a consumer (which pops from the list's
other end) reads them in that order, as if each had been pushed alone. Redis runs each
command of a pipeline on its own: one may fail (``WRONGTYPE``, out of memory) while the
others took effect, so every reply is read, and only the messages of a refused ``LPUSH``
fail (:attr:`RedisWire.failed`); the others are in their lists and count as published.

What reaches Redis is what kombu's ``Producer.publish`` would have written (to the
delivery tag, a fresh UUID like kombu's): kombu's consumers, ``SimpleQueue``, Celery's
and :class:`~django_outbox.consumer.InboxConsumer` read it unchanged. Where kombu would
write something else (a fanout exchange: PUB/SUB; a body encoding other than base64)
:meth:`RedisWire.takes` says no and the transport keeps kombu's producer.
"""

from __future__ import annotations

import binascii
import dataclasses
import itertools
import logging
import re
import uuid
from collections.abc import Sequence
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

from kombu.utils.encoding import bytes_to_str
from kombu.utils.json import JSONEncoder, dumps

from .. import cloudevents
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE, RELAY_HEADERS, ClaimedMessage
from ..exceptions import BrokerOutOfMemory, BrokerRefusesWrites
from ..signing import SIGNATURE_HEADER

logger = logging.getLogger(__name__)

#: What every relayed message carries, as the transport's producer sets it: persistent,
#: and kombu's default priority.
DELIVERY_MODE = 2
PRIORITY = 0
#: How kombu's Redis channel encodes bodies unless a transport option says otherwise:
#: the only encoding written here.
BODY_ENCODING = "base64"
#: Values per ``LPUSH``: a bound on one command's size, not on the batch.
LPUSH_VALUES = 500

#: Stand-ins for a message's own parts while its constant JSON is built: the body,
#: the headers (a JSON object), the message id and the delivery tag. JSON keeps them
#: as they are (``\\u0000`` apart), so each marks one place in the text.
_HOLES = tuple(f"\x00django_outbox:{part}\x00" for part in ("body", "headers", "id", "tag"))
#: kombu's JSON of headers: its encoder (its own types included), built once.
_encode_headers = JSONEncoder().encode
#: The headers every message carries (see :meth:`ClaimedMessage.wire_headers`), which
#: :func:`headers_json` writes itself: a user's header of one of these names changes
#: their place or value, and the headers' dict is encoded then.
_STANDARD_HEADERS = RELAY_HEADERS | {
    "correlation_id",
    "causation_id",
    "event_id",
    "event_type",
    "occurred_at",
    "ordering_key",
}


@dataclasses.dataclass(slots=True)
class HeadersMemo:
    """What the headers of one batch's messages share, kept by :func:`headers_json`:
    the text of user headers whose values are all strings (under their items, see
    :func:`_user_json`), and the text around an unordered message's event id (under its
    event type, ordering key, time and user headers' text). The events of a claim often
    share all of these: with them, the headers' text took 0.65 µs instead of 1.6."""

    users: dict[tuple[Any, ...], str] = dataclasses.field(default_factory=dict)
    around: dict[tuple[str, str, str, str], tuple[str, str]] = dataclasses.field(
        default_factory=dict
    )


def headers_json(
    message: ClaimedMessage,
    event_id: str,
    occurred_at: str | None = None,
    known: HeadersMemo | None = None,
) -> str:
    """kombu's JSON of ``message.wire_headers()`` (the same text; ``event_id`` is the
    message's event id as text), written from its parts without the dict and the
    encoder's walk over it, which were a sixth of the relay's time per message on
    Redis. ``occurred_at``, when given, is ``message.created_at.isoformat()``; with
    ``known``, the texts the batch's messages share are written once (see
    :class:`HeadersMemo`). User headers are encoded by kombu's encoder as they are in
    the dict; one named like a standard header, or headers that are not a dict, send
    the whole through it (and its error)."""
    user = message.headers
    if type(user) is not dict or (user and not _STANDARD_HEADERS.isdisjoint(user)):
        return _encode_headers(message.wire_headers())
    occurred_at = occurred_at or message.created_at.isoformat()
    user_text = _user_json(user, known.users if known else None) if user else ""
    if known is None or message.sequence is not None or message.skipped:
        between, after = _around_id(message, occurred_at, user_text)
    else:
        key = (message.event_type, message.ordering_key, occurred_at, user_text)
        parts = known.around.get(key)
        if parts is None:
            parts = known.around[key] = _around_id(message, occurred_at, user_text)
        between, after = parts
    signed = "" if message.signature is None else _signature_json(message.signature)
    return "".join(('{"correlation_id": "', event_id, between, event_id, after, signed, "}"))


def _signature_json(signature: str) -> str:
    return f", {encode_basestring_ascii(SIGNATURE_HEADER)}: {encode_basestring_ascii(signature)}"


def _around_id(message: ClaimedMessage, occurred_at: str, user_text: str) -> tuple[str, str]:
    """The headers' JSON between the event id's two places (as correlation id and as
    event id), and after the second one, up to the signature and the closing brace."""
    user_part = f"{user_text}, " if user_text else ""
    key = message.ordering_key
    after = [
        '", "event_type": ',
        encode_basestring_ascii(message.event_type),
        ', "occurred_at": "',
        occurred_at,
        '", "ordering_key": ',
        encode_basestring_ascii(key) if key else "null",
    ]
    if message.sequence is not None:
        after += ', "destination": ', encode_basestring_ascii(message.destination)
        after += ', "sequence": ', str(message.sequence)
    if message.skipped:
        after.append(', "skipped": true')
    return f'", "causation_id": null, {user_part}"event_id": "', "".join(after)


def _user_json(user: dict[str, Any], known: dict[tuple[Any, ...], str] | None) -> str:
    """kombu's JSON of the user headers ``user``, without its braces. With ``known``, the
    text of headers whose values are all strings is kept there under their items (a
    tenant, a trace context). Strings only, because equal values of other types can be
    written differently (``1`` and ``True``, ``0.0`` and ``-0.0``); headers found there
    hold strings only too, as no value decoded from JSON but a string equals one."""
    if known is None:
        return _encode_headers(user)[1:-1]
    items = tuple(user.items())
    try:
        text = known.get(items)
    except TypeError:  # a value that is not hashable (a list, a dict): not kept
        return _encode_headers(user)[1:-1]
    if text is None:
        text = _encode_headers(user)[1:-1]
        if all(type(value) is str for value in user.values()):
            known[items] = text
    return text


class WireFormatError(RuntimeError):
    """kombu's message JSON has a shape this module does not know (another kombu
    version): nothing is sent, and the relay logs the error."""


class Parts(NamedTuple):
    """The constant texts of a message's JSON, around its own four parts."""

    head: str
    after_body: str
    after_headers: str
    after_id: str
    tail: str


def message_parts(
    channel: Any,
    exchange: str,
    routing_key: str,
    tag_prefix: str,
    content_type: str = CONTENT_TYPE,
) -> Parts:
    """kombu's JSON of a message published to ``exchange`` with ``routing_key`` on
    ``channel``, cut at its body (base64), headers (a JSON object), message id and
    delivery tag, in that order (kombu's): the five texts around them. The body, message
    id and delivery tag go inside quotes already there; the text before the tag ends
    with ``tag_prefix``.

    The message is built by the channel's own ``prepare_message``, with the properties
    the producer gives it and those the channel adds when it publishes, then dumped
    with kombu's JSON; only the holes are cut out."""
    message = channel.prepare_message(
        _HOLES[0],
        PRIORITY,
        content_type,
        CONTENT_ENCODING,
        _HOLES[1],
        {"message_id": _HOLES[2], "delivery_mode": DELIVERY_MODE},
    )
    properties = message["properties"]
    properties.update(body_encoding=BODY_ENCODING, delivery_tag=_HOLES[3])
    properties["delivery_info"].update(exchange=exchange, routing_key=routing_key)
    rest, parts = dumps(message), []
    for hole in _HOLES:
        quoted = dumps(hole)
        cut = quoted if hole == _HOLES[1] else quoted[1:-1]  # headers: an object, unquoted
        before, found, rest = rest.partition(cut)
        if not found or cut in before or cut in rest:
            raise WireFormatError(
                f"kombu's Redis message has no single place for its {hole.strip(chr(0))!r} "
                "in the order known here: this kombu version writes another format"
            )
        parts.append(before)
    head, after_body, after_headers, after_id = parts
    return Parts(head, after_body, after_headers, after_id + tag_prefix, rest)


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """Where the messages of one routing key go, and their JSON around the holes."""

    queues: tuple[str, ...]
    lists: tuple[str, ...]  # each queue's list for the messages' priority
    parts: Parts
    size: int | None  # the parts' length, when they are ASCII


class RedisWire:
    """One route's batch for kombu's Redis ``channel``: :meth:`reaches` and
    :meth:`write` per message, then :meth:`send` once.

    The exchange's bindings are read once per batch, at its first message (a binding
    made meanwhile applies from the next batch), like the lists' expiry times the
    channel learnt when it declared the queues."""

    #: Messages count as published only once :meth:`send` ran.
    deferred = True

    def __init__(
        self,
        channel: Any,
        exchange: str,
        envelope: tuple[str, str, bool] = (cloudevents.OUTBOX, "", False),
    ) -> None:
        self._channel = channel
        self._exchange = exchange
        #: The envelope (``routes.ENVELOPES``) and CloudEvents source of the batch.
        self._envelope = envelope
        self._table: list[tuple[str, ...]] | None = None
        self._targets: dict[str, _Target] = {}
        self._pushes: dict[str, list[str]] = {}  # list -> messages as RESP bulk strings
        # Delivery tags are UUIDs, as kombu's are: a random one per batch, its last
        # 48 bits replaced by a serial number (uuid4() per message cost a tenth of it all).
        self._tag_prefix = str(uuid.uuid4())[:24]
        self._serials = itertools.count()
        #: The last ``created_at`` formatted, and its text: a claim gives the events
        #: staged at one instant one datetime object (a microsecond each to format).
        self._occurred: tuple[object, str] = (None, "")
        self._known = HeadersMemo()
        #: The lists of each message written, in the order written.
        self._written: list[tuple[str, ...]] = []
        #: After :meth:`send`: the messages Redis refused (by their place among those
        #: written), each with its error reply.
        self.failed: dict[int, Exception] = {}

    @staticmethod
    def unusable(channel: Any) -> str:
        """Why this module cannot write for ``channel`` ("" when it can): it reads parts
        of kombu's Redis channel that are not kombu's public API (the message's JSON
        shape, ``_q_for_pri``, ``_get_message_priority``, ``_expires``, ...), and another
        kombu version may have changed them. Checked before the first batch, so that such a
        kombu makes the relay fall back to kombu's producer instead of failing every
        batch."""
        try:
            message_parts(channel, "", "django_outbox.check", "0" * 24)
            priority = channel._get_message_priority({"properties": {"priority": PRIORITY}})
            channel._q_for_pri("django_outbox.check", priority)
            used = ("_expires", "priority_steps", "deadletter_queue", "global_keyprefix")
            for name in (*used, "pool", "keyprefix_queue", "sep"):
                getattr(channel, name)
        except (AttributeError, KeyError, TypeError, ValueError, WireFormatError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return ""

    @staticmethod
    def takes(channel: Any, exchange: str) -> bool:
        """Whether kombu would write this exchange's messages to lists, with base64
        bodies: not on a fanout exchange (PUB/SUB), nor under another ``body_encoding``."""
        if channel.body_encoding != BODY_ENCODING:
            return False
        return not exchange or channel.typeof(exchange).type != "fanout"

    def reaches(self, routing_key: str) -> bool:
        """Whether a message with ``routing_key`` would reach a queue."""
        return bool(self._target(routing_key).lists)

    def write(self, message: ClaimedMessage, routing_key: str) -> None:
        """Add ``message`` (which :meth:`reaches` a queue) to the batch. Raises what
        kombu's JSON raises for headers it cannot encode; nothing is added then."""
        target = self._targets[routing_key]
        head, after_body, after_headers, after_id, tail = target.parts
        event_id = str(message.event_id)
        at, occurred_at = self._occurred
        if at is not message.created_at:  # the same object: its text (not equal: a zone)
            occurred_at = message.created_at.isoformat()
            self._occurred = (message.created_at, occurred_at)
        if self._envelope[0] == cloudevents.OUTBOX:
            data = message.body
            headers = headers_json(message, event_id, occurred_at, self._known)
        else:
            wire = cloudevents.wire(message, *self._envelope)
            data, headers = wire.body, _encode_headers(wire.headers)
        body = binascii.b2a_base64(data, newline=False).decode("ascii")
        tag = f"{next(self._serials):012x}"
        text = (head, body, after_body, headers, after_headers, event_id, after_id, tag, tail)
        # Written as the value of an LPUSH already (a RESP bulk string: its size in bytes,
        # then the text). kombu's JSON escapes what is not ASCII, and the body (base64), id
        # and tag are ASCII: the size is the text's length, counted without encoding it.
        if target.size is not None and headers.isascii():
            size = target.size + len(body) + len(headers) + len(event_id) + len(tag)
            value = "".join((f"${size}\r\n", *text, "\r\n"))
        else:
            value = _bulk("".join(text))
        for name in target.lists:
            self._pushes[name].append(value)
        self._written.append(target.lists)

    def send(self) -> None:
        """Write the batch in one pipeline (nothing when no message was written), then
        read every reply: the messages of an ``LPUSH`` Redis refused (an error reply) go
        to :attr:`failed`, a message pushed to several lists when any of its pushes was
        refused. Raises the client's error when the pipeline itself fails (the
        connection): some of the batch may have reached Redis, none of it counts as
        published."""
        written = {
            queue
            for target in self._targets.values()
            for queue, name in zip(target.queues, target.lists, strict=True)
            if self._pushes[name]
        }
        if not written:
            return
        channel = self._channel
        prefix: str = channel.global_keyprefix  # what kombu's prefixing client adds to keys
        pushes = [
            (name, start)
            for name, texts in self._pushes.items()
            for start in range(0, len(texts), LPUSH_VALUES)
        ]
        commands = [
            _command("LPUSH", prefix + name, bulks=self._pushes[name][start : start + LPUSH_VALUES])
            for name, start in pushes
        ]
        # kombu renews an expiring queue's lists with each message it puts there
        expires: dict[str, int] = channel._expires  # queue -> ms, from its declaration
        commands += [
            _command("PEXPIRE", prefix + channel._q_for_pri(queue, step), str(expires[queue]))
            for queue in sorted(expires.keys() & written)
            for step in channel.priority_steps
        ]
        replies = _pipeline(channel.pool, commands)
        refused = {
            push: reply
            for push, reply in zip(pushes, replies, strict=False)
            if isinstance(reply, Exception)
        }
        if refused:
            self.failed = self._refused_rows(refused)
        if renewals := [r for r in replies[len(pushes) :] if isinstance(r, Exception)]:
            logger.warning(
                "a queue's expiry was not renewed (its messages were pushed): %s",
                renewals[0],
                extra={"action": "outbox.redis_expiry_refused"},
            )

    def _refused_rows(self, refused: dict[tuple[str, int], Exception]) -> dict[int, Exception]:
        """The messages (by their place among those written) with a value in one of the
        ``refused`` pushes (list, first value's place in it), each with its error."""
        places = dict.fromkeys(self._pushes, 0)  # list -> the next value's place in it
        failed: dict[int, Exception] = {}
        for row, names in enumerate(self._written):
            for name in names:
                place = places[name]
                places[name] = place + 1
                error = refused.get((name, place - place % LPUSH_VALUES))
                if error is not None:
                    failed.setdefault(row, error)
        return failed

    def _target(self, routing_key: str) -> _Target:
        target = self._targets.get(routing_key)
        if target is None:
            channel = self._channel
            queues = self._queues(routing_key)
            priority = channel._get_message_priority({"properties": {"priority": PRIORITY}})
            lists = tuple(channel._q_for_pri(queue, priority) for queue in queues)
            kind = CONTENT_TYPE
            if self._envelope[0] == cloudevents.STRUCTURED:
                kind = cloudevents.STRUCTURED_CONTENT_TYPE
            parts = message_parts(channel, self._exchange, routing_key, self._tag_prefix, kind)
            size = sum(map(len, parts)) if all(part.isascii() for part in parts) else None
            target = _Target(queues, lists, parts, size)
            self._targets[routing_key] = target
            for name in lists:
                self._pushes.setdefault(name, [])
        return target

    def _queues(self, routing_key: str) -> tuple[str, ...]:
        """The queues kombu's exchange lookup routes ``routing_key`` to (sorted), without
        its dead-letter fallback; the default exchange ("") delivers to the queue named
        by the key."""
        if not self._exchange:
            return (routing_key,)
        channel = self._channel
        if self._table is None:
            self._table = _bindings(channel, self._exchange)
        exchange_type = channel.typeof(self._exchange)
        queues = exchange_type.lookup(self._table, self._exchange, routing_key, None)
        if exchange_type.type == "topic":  # kombu's topic delivery skips its dead-letter queue
            queues = {queue for queue in queues if queue != channel.deadletter_queue}
        return tuple(sorted(queue for queue in queues if queue))


def _command(*words: str, bulks: Sequence[str] = ()) -> bytes:
    """A command in Redis's protocol (RESP): what redis-py's packer writes, in one
    join and one encode instead of its loop over each word (a tenth of the relay's time
    per message on Redis). ``bulks`` are more words, each written as a bulk string
    already (see :meth:`RedisWire.write`)."""
    return "".join([f"*{len(words) + len(bulks)}\r\n", *map(_bulk, words), *bulks]).encode()


def _bulk(word: str) -> str:
    """``word`` as a RESP bulk string: its size in UTF-8 bytes, then itself."""
    size = len(word) if word.isascii() else len(word.encode())
    return f"${size}\r\n{word}\r\n"


def _bindings(channel: Any, exchange: str) -> list[tuple[str, ...]]:
    """What kombu's ``channel.get_table(exchange)`` returns (the exchange's bindings),
    read on a connection of the channel's pool: kombu's makes a Redis client for each
    call, 0.18 ms of CPU a batch against 0.07. Not retried, as kombu's client is not
    unless told to (``retry_on_timeout``): a failure fails the batch, to be retried."""
    key = channel.global_keyprefix + channel.keyprefix_queue % exchange
    (members,) = _pipeline(channel.pool, [_command("SMEMBERS", key)])
    if isinstance(members, Exception):
        raise members
    return [tuple(bytes_to_str(member).split(channel.sep)) for member in members]


def _pipeline(pool: Any, commands: list[bytes]) -> list[Any]:
    """Send ``commands`` on one of ``pool``'s connections in one write, then read every
    reply (so that the connection goes back to the pool in step); returns the replies,
    an error reply as redis-py's exception (each command of a pipeline succeeds or fails
    on its own). A connection error drops the connection, as redis-py's client does; it
    is not retried (a retry of a batch's pipeline could push it twice)."""
    from redis.exceptions import ResponseError  # redis is kombu's Redis transport's

    replies: list[Any] = []
    connection = pool.get_connection()
    try:
        connection.send_packed_command([b"".join(commands)])  # one write
        for _ in commands:
            try:
                replies.append(connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
    except BaseException:
        connection.disconnect()
        raise
    finally:
        pool.release(connection)
    return replies


class WriteRefusal(NamedTuple):
    """Why a Redis refuses every write for now: the broker's state, never a message's
    fault, so an outage (no attempt spent) until a probe write is accepted again."""

    #: The failure's kind (a metrics label) and the outage's condition in its log line.
    kind: str
    condition: str
    #: What Redis said, in a few words, and what brings it back.
    why: str
    fix: str


OUT_OF_MEMORY = WriteRefusal(
    "out_of_memory",
    "out of memory",
    "Redis maxmemory reached, nothing it may evict",
    "let consumers drain its queues or raise maxmemory",
)
READ_ONLY = WriteRefusal(
    "read_only",
    "read-only",
    "READONLY: a replica, as a Redis demoted by a failover is",
    "point the broker URL at the master (a sentinel:// URL follows failovers)",
)
CANNOT_PERSIST = WriteRefusal(
    "cannot_persist",
    "unable to persist",
    "MISCONF: its last RDB snapshot failed and stop-writes-on-bgsave-error is on",
    "free its disk or fix its dir's permissions (see its log)",
)
#: How many causes of an error :func:`write_refusal` follows: kombu's and Celery's
#: wrappers add one or two.
_CAUSE_DEPTH = 8


def write_refusal(exc: BaseException | None) -> WriteRefusal | None:
    """Whether ``exc`` is a Redis that cannot take writes now (None: it is not): out of
    memory (``maxmemory`` reached with nothing it may evict), a read-only replica
    (``READONLY``), or a failed snapshot that stops writes (``MISCONF``). Follows the
    error's cause and context, as kombu's ``OperationalError`` (the Celery path) and
    redis-py's pipeline errors wrap the reply. The one classification every path uses:
    the relay's own writer, kombu's producer, the Celery transport, declarations."""
    try:
        from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError
    except ImportError:  # no redis client: no Redis broker either
        return None
    for _ in range(_CAUSE_DEPTH):
        if exc is None:
            return None
        if isinstance(exc, OutOfMemoryError):
            return OUT_OF_MEMORY
        if isinstance(exc, ReadOnlyError):
            return READ_ONLY
        if isinstance(exc, ResponseError) and _MISCONF.search(str(exc)):
            return CANNOT_PERSIST  # (redis-py has no class of its own for it)
        exc = exc.__cause__ or exc.__context__
    return None


#: The reply code of a refused snapshot, at the start of the reply or after redis-py's
#: note of the pipeline's command.
_MISCONF = re.compile(r"(?:^|error: )MISCONF ")


def refusal_named(kind: str) -> WriteRefusal | None:
    """The refusal whose :attr:`WriteRefusal.kind` or condition is ``kind``."""
    for refusal in (OUT_OF_MEMORY, READ_ONLY, CANNOT_PERSIST):
        if kind in (refusal.kind, refusal.condition):
            return refusal
    return None


def probe_writes(client: Any, answered: tuple[type[BaseException], ...]) -> None:
    """Have the Redis of ``client`` (redis-py's) take a write: ``LPUSHX`` to a key that
    does not exist (nothing is written), which Redis refuses as it refuses any push while
    it cannot take writes (:func:`write_refusal`): then raises :func:`refusing_writes`'s
    error. Any other refusal among ``answered`` (an ACL that does not let this user
    write the probe's key: ``NOPERM``) is an answer: the broker is up."""
    try:
        client.lpushx(f"django_outbox.probe.{uuid.uuid4().hex}", "")
    except answered as exc:
        if write_refusal(exc) is None:
            return
        raise refusing_writes(exc) from exc


def refusing_writes(exc: BaseException) -> BaseException:
    """``exc`` as :class:`~django_outbox.exceptions.BrokerRefusesWrites`
    (:class:`BrokerOutOfMemory` out of memory), naming what Redis said and the fix, when
    it is a Redis that cannot take writes now (:func:`write_refusal`); else ``exc``. (A
    Redis unable to persist refuses even the ``PING`` of a new connection.)"""
    refusal = write_refusal(exc)
    if refusal is None or isinstance(exc, BrokerRefusesWrites):
        return exc
    error = BrokerOutOfMemory if refusal is OUT_OF_MEMORY else BrokerRefusesWrites
    refused = error(
        f"Redis refuses every write ({refusal.condition}, {refusal.why}: {exc}): "
        f"{refusal.fix}; the rows wait, attempts unchanged",
        refusal.condition,
    )
    refused.__cause__ = exc
    return refused
