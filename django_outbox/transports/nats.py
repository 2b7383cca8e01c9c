"""NATS JetStream (``nats://host:port[,host:port...]``) through nats-py.

nats-py is asyncio only, and the relay's threads are not: each :class:`NatsTransport`
runs one event loop on a thread of its own (:class:`EventLoop`), holding the connection,
and the relay's thread hands it a whole batch (``asyncio.run_coroutine_threadsafe``),
then waits for the batch's outcomes. One hand-over per batch, not per message.

A batch's messages are published together and their PubAcks awaited together; a row
counts as published only once its own PubAck came back (a duplicate's too: the stream
already holds it). Each message carries ``Nats-Msg-Id`` = its event id, so a message the
relay publishes again within the stream's duplicate window (after a crash between the
publish and the mark) is acknowledged without being stored twice. A publish is what
nats-py's ``js.publish`` sends (the message with a reply subject, the stream expected in
``Nats-Expected-Stream``), framed by the relay (:mod:`.nats_frames`: the header blocks made
on the claim thread, a batch's frames written at once), and its PubAck comes back through
one subscription per connection (:class:`PubAcks`) instead of a request each: ``js.publish``
makes a task, a future and a timer per message, and nats-py's ``publish()`` encodes each
header as it sends, which cost the relay as much as the rest of its work (docs/benchmarks.md,
what NATS costs).

On an ordered route the messages of one ordering key go one after the other, each sent
once the previous one's PubAck came back: a key's events reach the stream in sequence
order, and a failed one holds back the rest of its key (the relay publishes them again
later, :func:`~django_outbox.relay.batch._held_back`). Keys go concurrently.

What fails how: a cluster that cannot be reached, a PubAck that does not come in time, a
stream without a leader (no quorum) are outages (no attempt counted, DESIGN 2.8); a
message the server or the client refuses for itself (over ``max_payload``, no stream for
its subject, a header NATS cannot carry) fails alone, with its reason. Each publish has
one deadline (:func:`~.confirms.lease_confirm_timeout`) for connecting, the stream check
and its PubAcks: what is not acknowledged by then is an outage. Errors other than nats-py's
connection and timeout errors are bugs: they leave :meth:`NatsTransport.publish`, and the
relay logs them and counts an attempt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from .. import cloudevents
from ..conf import CHECK_IDS, Broker, Problem, outbox_settings
from ..conf.brokers import nats_servers
from ..conf.redact import SecretFilter, mask_url
from ..conf.routes import JetStream, Route
from ..envelope import ClaimedMessage
from ..exceptions import BrokerUnreachable
from . import nats_frames
from .base import MAX_ERROR_LENGTH, Failure, Outcome, Transport
from .confirms import lease_confirm_timeout
from .writers import ENCODE_ERRORS, envelope_of

logger = logging.getLogger(__name__)
logger.addFilter(SecretFilter(outbox_settings.redact))

T = TypeVar("T")

#: Seconds to connect to one server of the list (nats-py's ``connect_timeout``; the
#: kombu transports' ``connection.CONNECT_TIMEOUT`` is another budget).
SERVER_CONNECT_TIMEOUT = 2.0
#: Seconds until the rows of a route whose stream is missing (and may not be created) or
#: cannot be created are due again: a configuration error, no attempt counted.
STREAM_RETRY_DELAY = 30.0
#: The header JetStream deduplicates on.
MSG_ID = "Nats-Msg-Id"
#: The header naming the stream that must take a message (JetStream refuses it otherwise).
EXPECTED_STREAM = "Nats-Expected-Stream"
#: The header naming a CloudEvent's content type (NATS has no binary mode: structured).
CONTENT_TYPE_HEADER = "content-type"
#: What a user header may not start with: JetStream reads ``Nats-`` headers itself
#: (an expected stream or sequence, a rollup ...).
RESERVED_PREFIX = "nats-"


class StreamRefused(Exception):
    """A route's stream is missing and may not be created, the server refused to
    create it, or it does not take the route's subject: a configuration error (no
    attempt counted)."""


class OptionsRefused(StreamRefused):
    """The broker's ``OPTIONS`` hold a keyword nats-py's ``connect()`` does not take:
    a configuration error too (:meth:`NatsTransport.problems` reports it at start-up)."""


def cluster_errors() -> tuple[type[BaseException], ...]:
    """What nats-py raises when the cluster cannot be reached or does not answer in
    time: an outage. Anything else is a bug or a configuration error."""
    import nats.errors

    return (nats.errors.Error, asyncio.TimeoutError, TimeoutError, OSError)


class EventLoop:
    """An asyncio loop running on a daemon thread of its own: :meth:`run` hands it a
    coroutine from any thread and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="django_outbox.nats", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Run the loop until :meth:`stop`; then cancel the tasks left on it (a connect
        cut short, the client's reader), give them a moment to finish, and close it."""
        try:
            self.loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.wait(tasks, timeout=SERVER_CONNECT_TIMEOUT))
            self.loop.close()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        """``coroutine``'s result; :class:`TimeoutError` (and the coroutine cancelled)
        when it takes longer than ``timeout`` seconds."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own (nats-py's is a TimeoutError too)
                raise
            future.cancel()
            raise TimeoutError(f"no answer from the NATS cluster within {timeout:g}s") from None

    def stop(self) -> None:
        """Stop the loop and wait a moment for its thread to close it. A loop stuck in a
        call that never returns (blocking code on it) cannot be stopped from outside:
        its thread, a daemon, is left with the loop and its sockets, and closes them if
        the call ever returns; a WARNING says so."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=SERVER_CONNECT_TIMEOUT * 2)
        if self._thread.is_alive():
            logger.warning(
                "a NATS event loop did not stop within %gs: its thread is left behind "
                "and closes the loop if it ever returns",
                SERVER_CONNECT_TIMEOUT * 2,
                extra={"action": "outbox.nats_loop_stuck"},
            )


def close_client(loop: EventLoop, client: Any) -> None:
    """Close ``client``'s connection (flushing what it has to send) and stop its loop."""
    # The connection is already broken: nothing to save. nats-py 2.9 raises
    # AttributeError closing a client whose connection never opened.
    broken: tuple[type[BaseException], ...] = (*cluster_errors(), AttributeError)
    if client is not None and not client.is_closed:
        try:
            loop.run(client.close(), SERVER_CONNECT_TIMEOUT)
        except broken:
            logger.debug("error closing a NATS connection", exc_info=True)
    loop.stop()


def connect_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of nats-py's ``connect()`` for a client called ``name``:
    ours, under the broker's ``OPTIONS``."""
    return {
        "connect_timeout": SERVER_CONNECT_TIMEOUT,
        "reconnect_time_wait": 0.5,
        # A few reconnections (a node that stopped: the next one of the list), then the
        # connection closes and the outage backoff of the relay or consumer takes over.
        "max_reconnect_attempts": 2,
        "name": name,
        "error_cb": _client_error,
        **options,
    }


async def _client_error(exc: Exception) -> None:
    logger.debug(
        "NATS client: %s: %s",
        type(exc).__name__,
        exc,
        extra={"action": "outbox.nats_client_error"},
    )


def header_text(name: str, value: object) -> str:
    """A header's value as NATS carries it (text): a string as it is, a number or boolean
    as JSON. ``ValueError`` for a header NATS cannot carry (a line break, a name that is
    no token: ``:``, white space ...)."""
    text = value if isinstance(value, str) else _json(value)
    nats_frames.header_name(name)  # (raises for a name NATS cannot carry)
    if "\r" in text or "\n" in text:
        raise ValueError(f"header {name!r} cannot travel as a NATS header")
    return text


def header_block(message: ClaimedMessage, wire: cloudevents.Wire, stream: str) -> bytes:
    """``message``'s header block as NATS carries it (:func:`.nats_frames.header_block`):
    strings as they are, numbers and booleans as JSON, None left out; ``Nats-Msg-Id`` = the
    event id, ``Nats-Expected-Stream`` = ``stream`` (JetStream refuses it if another
    stream takes its subject). ``ValueError`` for a header NATS cannot carry (a line
    break, a name that is no token) or a user header JetStream would read (``Nats-...``)."""
    line = nats_frames.header_line
    typed = wire.content_type != cloudevents.CONTENT_TYPE  # a header says it (CloudEvents)
    lines = [
        line(_user_header(name), value if type(value) is str else _json(value))
        for name, value in wire.headers.items()
        if value is not None and not (typed and name == CONTENT_TYPE_HEADER)
    ]
    if typed:
        lines.append(line(CONTENT_TYPE_HEADER, wire.content_type))
    # The outbox envelope's event_id header is the event id as text, which no user header
    # overrides (ClaimedMessage.wire_headers); CloudEvents carry it as the id attribute.
    event_id = wire.headers.get("event_id") or str(message.event_id)
    lines += (line(MSG_ID, event_id), line(EXPECTED_STREAM, stream))
    return nats_frames.header_block(lines)


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


@functools.lru_cache(maxsize=1024)
def _user_header(name: str) -> str:
    """``name``, or ``ValueError`` for a name JetStream reads itself (``Nats-...``)."""
    if name.lower().startswith(RESERVED_PREFIX):
        raise ValueError(f"header {name!r} is JetStream's own (Nats-...)")
    return name


#: One message of a chain: its index in the batch, its body, its header block, and the
#: message.
Link = tuple[int, bytes, bytes, ClaimedMessage]
#: Messages sent one after the other: an ordering key's (in sequence order), or an
#: unordered message alone.
Chain = list[Link]

#: The outcome of a message the server answered for with "no responders" (no stream
#: took its subject, or the stream has no leader): an outage until :meth:`NatsTransport.
#: _no_stream` tells which (compared by identity).
NO_RESPONDERS = Failure(
    "NoRespondersError: no JetStream stream answered the publish",
    counts=False,
    outage=True,
    kind="no_responders",
)


def pub_ack_outcome(reply: Any) -> Outcome:
    """The outcome a JetStream reply to a publish gives: None for a PubAck (a duplicate's
    too: the stream has the message), :data:`NO_RESPONDERS`, an outage for a stream
    without a leader (503) or a reply that is no JSON, a failure for a refusal."""
    from nats.js.errors import APIError, ServiceUnavailableError

    data = reply.data
    if not reply.headers and data[:10] == b'{"stream":' and b'"error"' not in data:
        return None  # a PubAck (a refusal has an "error"): most replies, read without json
    if reply.headers and reply.headers.get("Status") == "503":
        return NO_RESPONDERS
    try:
        answer = json.loads(data)
        if "error" in answer:
            APIError.from_error(answer["error"])  # (raises the error's class)
    except ServiceUnavailableError as exc:  # 503: JetStream without a leader
        return outage(exc)
    except APIError as exc:  # the stream refused this message for itself
        return Failure(
            f"JetStream refused the message: {exc.description or exc}"[:MAX_ERROR_LENGTH]
        )
    except (ValueError, TypeError, KeyError) as exc:  # not a reply of JetStream's
        return outage(exc)
    return None


class PubAcks:
    """The PubAcks of a connection's publishes. Each message goes out with a reply subject
    of its own under one inbox, subscribed to once per connection; each reply is handed to
    the :class:`InFlight` batch waiting for it. Unlike nats-py's ``js.publish`` (a request:
    a task, a future and a timer per message), nothing is made per message but its reply
    subject; a reply nobody waits for any more (its batch ran out of time) is dropped."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._numbers = itertools.count()
        #: reply subject -> the batch waiting for it, and the message's place in it
        self._waiting: dict[str, tuple[InFlight, int, int]] = {}

    @classmethod
    async def subscribe(cls, client: Any) -> PubAcks:
        acks = cls(f"{client.new_inbox()}.")
        await client.subscribe(f"{acks._prefix}*", cb=acks._on_reply)
        return acks

    def reply_to(self, batch: InFlight, chain: int, place: int) -> str:
        """A new reply subject, whose reply goes to ``batch`` for ``chain``'s ``place``."""
        subject = f"{self._prefix}{next(self._numbers)}"
        self._waiting[subject] = (batch, chain, place)
        return subject

    def forget(self, subjects: Sequence[str]) -> None:
        for subject in subjects:
            self._waiting.pop(subject, None)

    async def _on_reply(self, reply: Any) -> None:
        waiting = self._waiting.pop(reply.subject, None)
        if waiting is not None:
            batch, chain, place = waiting
            await batch.answered(chain, place, pub_ack_outcome(reply))


class InFlight:
    """One batch's chains on their way to the stream: each chain's first message sent at
    once (the frames of all of them queued together), each next one when the previous
    one's PubAck came back (a key's messages reach the stream in sequence order); a
    message refused or not sent holds back the rest of its chain. Each message's outcome
    goes into ``results`` as it comes."""

    def __init__(
        self,
        client: Any,
        acks: PubAcks,
        subject: str,
        chains: list[Chain],
        results: dict[int, Outcome],
    ) -> None:
        self._client, self._acks, self._subject = client, acks, subject.encode()
        self._chains, self.results = chains, results
        self._count = sum(len(chain) for chain in chains)
        self._replies: list[str] = []
        self._done = asyncio.get_running_loop().create_future()
        #: Set when :meth:`run` returns or is cancelled: nothing more is sent for it.
        self._over = False

    async def run(self) -> None:
        """Send the chains and wait for every message's outcome (cancelled at the
        deadline: the replies still due are forgotten)."""
        try:
            await self._send([(chain, 0) for chain in range(len(self._chains))])
            self._finished()
            await self._done
        finally:
            self._over = True
            self._acks.forget(self._replies)

    async def answered(self, chain: int, place: int, outcome: Outcome) -> None:
        """Note the outcome of ``chain``'s message at ``place``; send the next one of the
        chain after a PubAck, hold the rest back after anything else."""
        links = self._chains[chain]
        self.results[links[place][0]] = outcome
        if outcome is not None:  # the rest of its key waits (sent after it, later)
            held = _behind(str(links[place][3].event_id))
            self.results.update((later[0], held) for later in links[place + 1 :])
        elif place + 1 < len(links):
            await self._send([(chain, place + 1)])
        self._finished()

    async def _send(self, turns: list[tuple[int, int]]) -> None:
        """Send the messages at ``turns`` (chain, place) in one write; a message too large
        for the server, or all of them when the connection cannot take them, fail."""
        import nats.errors

        if self._over:  # out of time: the relay publishes the rest later
            return
        frames, sent, refused = [], [], []
        for chain, place in turns:
            _, body, block, _ = self._chains[chain][place]
            too_large = nats_frames.oversize(self._client, len(block) + len(body))
            if too_large is not None:
                refused.append((chain, place, too_large))
                continue
            reply = self._acks.reply_to(self, chain, place)
            self._replies.append(reply)
            frames.append(nats_frames.hpub(self._subject, reply.encode(), block, body))
            sent.append((chain, place, reply))
        failed: list[tuple[int, int, Failure]] = [
            (chain, place, Failure(text, permanent=True, kind="max_payload"))
            for chain, place, text in refused
        ]
        try:
            if frames:
                await nats_frames.write(self._client, frames)
        except (nats.errors.Error, OSError) as exc:  # the connection broke: an outage
            self._acks.forget([reply for _, _, reply in sent])
            failed += [(chain, place, outage(exc)) for chain, place, _ in sent]
        for chain, place, failure in failed:
            await self.answered(chain, place, failure)

    def _finished(self) -> None:
        if len(self.results) >= self._count and not self._done.done():
            self._done.set_result(None)


class NatsTransport(Transport):
    """NATS JetStream: PubAcks awaited per message, a batch's messages in flight together."""

    supports_confirms = True
    supports_batch = True
    #: A message no stream takes (no stream for its subject) fails instead of counting.
    reports_unroutable = True

    def __init__(
        self,
        url: str,
        options: Mapping[str, Any] | None = None,
        *,
        alias: str | None = None,
        ack_timeout: float | None = None,
    ) -> None:
        self._url = url
        self.alias = alias
        #: Keyword arguments of ``nats.connect()``, over the relay's own.
        self._options = dict(options or {})
        self._ack_timeout = lease_confirm_timeout() if ack_timeout is None else ack_timeout
        self._loop: EventLoop | None = None
        self._nc: Any = None
        self._js: Any = None
        #: The PubAcks subscription of this connection (made by its first publish).
        self._acks: PubAcks | None = None
        #: The streams known to exist on this connection.
        self._streams: set[str] = set()
        #: refusal text -> when (monotonic) it may be logged again
        self._refusals_logged: dict[str, float] = {}

    @classmethod
    def problems(cls, broker: Broker) -> list[Problem]:
        return options_problems(broker)

    # -- connection -----------------------------------------------------------------

    def _run(self, coroutine: Coroutine[Any, Any, T], timeout: float) -> T:
        assert self._loop is not None
        return self._loop.run(coroutine, timeout)

    def _connect(self, timeout: float) -> None:
        """Connect unless connected, in ``timeout`` seconds at most. The client is kept
        from the start, so that :meth:`close` closes its socket when connecting fails."""
        if self._js is not None and not self._nc.is_closed:
            return
        self.close()
        from nats.aio.client import Client

        self._loop = EventLoop()
        options = connect_options("django_outbox relay", self._options)
        client = Client()
        try:
            connecting = client.connect(nats_servers(self._url), **options)
        except TypeError as exc:  # a keyword of OPTIONS connect() does not take
            raise OptionsRefused(
                f"broker {self.alias or 'default'!r}: its OPTIONS are not nats-py's: {exc}"
            ) from None
        self._nc = client
        self._run(connecting, timeout)
        self._js = self._nc.jetstream(timeout=self._ack_timeout)

    def target(self, route: Route) -> str:
        jetstream = route.jetstream or JetStream()
        subject, stream = (
            f(route.destination) for f in (jetstream.subject_for, jetstream.stream_for)
        )
        return f"subject {subject!r} (stream {stream!r})"

    def check(self) -> None:
        """Connect (once) and have JetStream answer an account info request."""
        down: tuple[type[BaseException], ...] = (*cluster_errors(), OptionsRefused)
        try:
            self._connect(SERVER_CONNECT_TIMEOUT * 3 * len(nats_servers(self._url)) + 1)
            self._run(self._js.account_info(), self._ack_timeout + 1)
        except down as exc:
            self.close()
            raise BrokerUnreachable(
                f"broker {self.alias or 'default'!r} ({mask_url(self._url)}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Drop the connection and stop its loop; the next call reconnects."""
        nc, loop = self._nc, self._loop
        self._nc = self._js = self._loop = self._acks = None
        self._streams.clear()
        if loop is not None:
            close_client(loop, nc)

    # -- publishing -----------------------------------------------------------------

    def publish(self, route: Route, messages: Sequence[ClaimedMessage]) -> list[Outcome]:
        """Publish ``messages`` within one deadline, :func:`lease_confirm_timeout` from
        now (connecting, the stream check and every chain of PubAcks): a message not
        acknowledged by then is an outage (no attempt)."""
        deadline = time.monotonic() + self._ack_timeout
        jetstream = route.jetstream or JetStream()
        outcomes: list[Outcome] = [None] * len(messages)
        encoded = self._encode(route, messages, outcomes)
        try:
            self._connect(_left(deadline))
            if jetstream.stream_for(route.destination) not in self._streams:
                self._run(self._ensure_stream(route, jetstream), _left(deadline))
        except StreamRefused as exc:
            self._log_refusal(route, str(exc))
            return [Failure.not_attempted(str(exc), STREAM_RETRY_DELAY)] * len(messages)
        except cluster_errors() as exc:  # nothing sent: the cluster is out of reach
            self.close()
            return [outage(exc)] * len(messages)
        chains = _chains(messages, encoded, outcomes, ordered=route.ordered)
        results = self._publish_within(route, jetstream, chains, deadline)
        late = outage(TimeoutError(f"no PubAck within the publish's {self._ack_timeout:g}s"))
        for index, outcome in enumerate(outcomes):
            if outcome is None:
                outcomes[index] = results.get(index, late)
        return outcomes

    def encoder(self, route: Route) -> Callable[[ClaimedMessage], tuple[bytes, bytes]]:
        return _message_of(route)

    def _encode(
        self, route: Route, messages: Sequence[ClaimedMessage], outcomes: list[Outcome]
    ) -> dict[int, tuple[bytes, bytes]]:
        """Each message's body and header block by its index (as :meth:`prepare` left
        them, or encoded now); a message that cannot be encoded gets a permanent failure
        in ``outcomes``."""
        encode = self.encoder(route)
        encoded = {}
        for index, message in enumerate(messages):
            try:
                encoded[index] = self.encoded(route, message, encode)
            except ENCODE_ERRORS as exc:
                outcomes[index] = Failure.from_exception(exc, permanent=True)
        return encoded

    def _publish_within(
        self,
        route: Route,
        jetstream: JetStream,
        chains: list[Chain],
        deadline: float,
    ) -> dict[int, Outcome]:
        """The outcomes of the messages of ``chains`` acknowledged (or refused) by
        ``deadline``; the others are left out."""
        subject = jetstream.subject_for(route.destination)
        stream = jetstream.stream_for(route.destination)
        results: dict[int, Outcome] = {}
        chained = self._publish_chains(subject, chains, results, stream=stream)
        try:
            # The loop stops waiting at the deadline; this thread a second later, when
            # the loop itself is stuck.
            self._run(_until(chained, _left(deadline)), _left(deadline) + 1)
        except TimeoutError:  # the loop itself gave up: the outcomes not in are unknown
            self.close()
        outcomes = dict(results)  # (taken now: a stuck loop may still write to it)
        if any(isinstance(o, Failure) and o.outage for o in outcomes.values()):
            self._streams.discard(stream)  # asked again next time (a leader may be new)
        return outcomes

    async def _ensure_stream(self, route: Route, jetstream: JetStream) -> None:
        """Make sure the route's stream exists (once per connection) and takes the
        route's subject: create it with the route's settings when it is missing, or
        raise :class:`StreamRefused`."""
        from nats.js.errors import NotFoundError

        stream = jetstream.stream_for(route.destination)
        if stream in self._streams:
            return
        try:
            info = await self._js.stream_info(stream)
        except NotFoundError:
            await self._create_stream(route, jetstream, stream)
        else:
            _require_subject(route, stream, jetstream, info.config.subjects or [])
        self._streams.add(stream)

    async def _create_stream(self, route: Route, jetstream: JetStream, stream: str) -> None:
        from nats.js.errors import APIError, ServiceUnavailableError

        if not jetstream.create_stream:
            raise StreamRefused(
                f"JetStream stream {stream!r} of route {route.destination!r} does not "
                "exist and the route has create_stream False: create it, or let the "
                "relay do it"
            )
        try:
            await self._js.add_stream(
                name=stream,
                subjects=[jetstream.subject_for(route.destination)],
                num_replicas=jetstream.replicas,
                duplicate_window=jetstream.duplicate_window,
            )
        except ServiceUnavailableError:
            raise
        except APIError as exc:
            raise StreamRefused(
                f"JetStream refused to create stream {stream!r} of route "
                f"{route.destination!r}: {exc.description or exc}"
            ) from exc

    async def _publish_chains(
        self, subject: str, chains: list[Chain], results: dict[int, Outcome], *, stream: str
    ) -> None:
        """Publish ``chains`` (:class:`InFlight`), each message's outcome into ``results``
        as its PubAck comes; the messages nobody answered for are looked into once
        (:meth:`_no_stream`) when every PubAck is in."""
        if self._acks is None:
            self._acks = await PubAcks.subscribe(self._nc)
        await InFlight(self._nc, self._acks, subject, chains, results).run()
        unanswered = [index for index, outcome in results.items() if outcome is NO_RESPONDERS]
        if unanswered:
            found = await self._no_stream(subject, stream)
            results.update(dict.fromkeys(unanswered, found))

    async def _no_stream(self, subject: str, stream: str) -> Outcome:
        """Nobody answered a publish: its stream is gone (the message fails, an attempt),
        or it has no leader right now (an outage)."""
        from nats.js.errors import NotFoundError

        try:
            await self._js.stream_info(stream)
        except NotFoundError:
            self._streams.discard(stream)
            return Failure(
                f"no JetStream stream takes subject {subject!r} (stream {stream!r} is gone)",
                kind="unroutable",
            )
        except cluster_errors() as exc:  # (the probe is best effort: an outage)
            return outage(exc)
        return outage(TimeoutError(f"stream {stream!r} did not answer (no leader?)"))

    def _log_refusal(self, route: Route, text: str) -> None:
        """One ERROR per refusal and retry interval, however many batches it fails."""
        now = time.monotonic()
        if self._refusals_logged.get(text, 0.0) > now:
            return
        self._refusals_logged[text] = now + STREAM_RETRY_DELAY
        logger.error(
            "destination %r: %s (its rows wait, attempts unchanged, and are retried every %gs)",
            route.destination,
            text,
            STREAM_RETRY_DELAY,
            extra={"action": "outbox.stream_refused", "destination": route.destination},
        )


def options_problems(broker: Broker) -> list[Problem]:
    """E072: keys of ``OPTIONS`` that nats-py's ``connect()`` does not take (without
    nats-py, E011 says what to install)."""
    try:
        from nats.aio.client import Client
    except ImportError:
        return []
    taken = set(inspect.signature(Client.connect).parameters) - {"self", "servers"}
    unknown = sorted(set(broker.options) - taken)
    if not unknown:
        return []
    return [
        Problem(
            CHECK_IDS["nats_options"],
            f"{broker.options_setting} gives {unknown}, which nats-py's connect() does "
            "not take: the relay could not connect to this NATS broker.",
            "Give only keyword arguments of nats.connect() there (tls, user_credentials, "
            "token, ...), or drop them.",
        )
    ]


def _message_of(route: Route) -> Callable[[ClaimedMessage], tuple[bytes, bytes]]:
    """A function giving a message of ``route`` as its body and its header block, with the
    route's stream as the one expected to take it (JetStream refuses it otherwise). NATS
    has no binary content mode: CloudEvents are structured."""
    envelope = envelope_of(route, binary=False)
    stream = (route.jetstream or JetStream()).stream_for(route.destination)

    def encode(message: ClaimedMessage) -> tuple[bytes, bytes]:
        wire = cloudevents.wire(message, *envelope)
        return wire.body, header_block(message, wire, stream)

    return encode


def _left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic), at least 0."""
    return max(0.0, deadline - time.monotonic())


async def _until(coroutine: Coroutine[Any, Any, None], timeout: float) -> None:
    """Await ``coroutine`` for ``timeout`` seconds at most, then cancel it."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(coroutine, timeout)


def outage(exc: BaseException) -> Failure:
    """The outcome of a message the cluster did not answer for: no attempt counted."""
    return Failure.broker_down(f"{type(exc).__name__}: {exc}")


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a stream subject ``pattern`` takes ``subject``, as NATS matches them:
    tokens split on ``.``, ``*`` standing for one token, a last ``>`` for one or more."""
    tokens, wanted = pattern.split("."), subject.split(".")
    for place, token in enumerate(tokens):
        if token == ">" and place == len(tokens) - 1:
            return len(wanted) > place
        if place >= len(wanted) or token not in ("*", wanted[place]):
            return False
    return len(tokens) == len(wanted)


def _require_subject(
    route: Route, stream: str, jetstream: JetStream, subjects: Sequence[str]
) -> None:
    """:class:`StreamRefused` when none of an existing stream's ``subjects`` takes the
    route's subject: its messages would find no stream (no responders) forever."""
    subject = jetstream.subject_for(route.destination)
    if not any(subject_matches(pattern, subject) for pattern in subjects):
        raise StreamRefused(
            f"JetStream stream {stream!r} of route {route.destination!r} takes subjects "
            f"{list(subjects)}, not the route's subject {subject!r}: add it to the stream's "
            "subjects, or give the route a stream that takes it"
        )


def _chains(
    messages: Sequence[ClaimedMessage],
    encoded: Mapping[int, tuple[bytes, bytes]],
    outcomes: list[Outcome],
    *,
    ordered: bool,
) -> list[Chain]:
    """The batch's encoded messages as chains sent one message at a time: on an ordered
    route one chain per ordering key (in the batch's order, which is the key's sequence
    order), every other message a chain of its own. An ordered message behind one of its
    key that could not be encoded is not sent (its outcome says so)."""
    chains: dict[object, Chain] = {}
    failed: dict[str, ClaimedMessage] = {}  # ordering key -> its message not encoded
    for index, message in enumerate(messages):
        keyed = ordered and message.sequence is not None
        if keyed and message.ordering_key in failed:
            outcomes[index] = _behind(str(failed[message.ordering_key].event_id))
        elif index not in encoded:
            if keyed:
                failed[message.ordering_key] = message
        else:
            scope: object = message.ordering_key if keyed else index
            chains.setdefault(scope, []).append((index, *encoded[index], message))
    return list(chains.values())


def _behind(event_id: str) -> Failure:
    """The outcome of an ordered message not sent because an earlier one of its key
    failed: no attempt; the relay publishes it after that one."""
    return Failure.not_attempted(f"not sent: behind event {event_id} of its key, which failed", 0.0)
