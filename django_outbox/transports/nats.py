"""NATS JetStream (``nats://host:port[,host:port...]``) through nats-py.

nats-py is asyncio only, and the relay's threads are not: each :class:`NatsTransport`
runs one event loop on a thread of its own (:class:`EventLoop`), holding the connection,
and the relay's thread hands it a whole batch (``asyncio.run_coroutine_threadsafe``),
then waits for the batch's outcomes. One hand-over per batch, not per message.

A batch's messages are published concurrently and their PubAcks awaited together; a row
counts as published only once its own PubAck came back (a duplicate's too: the stream
already holds it). Each message carries ``Nats-Msg-Id`` = its event id, so a message the
relay publishes again within the stream's duplicate window (after a crash between the
publish and the mark) is acknowledged without being stored twice.

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
import inspect
import json
import logging
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from .. import cloudevents
from ..conf import CHECK_IDS, Broker, Problem, outbox_settings
from ..conf.brokers import nats_servers
from ..conf.redact import SecretFilter, mask_url
from ..conf.routes import JetStream, Route
from ..envelope import ClaimedMessage
from ..exceptions import BrokerUnreachable
from .base import MAX_ERROR_LENGTH, Failure, Outcome, Transport
from .confirms import lease_confirm_timeout

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
    as JSON. ``ValueError`` for a header NATS cannot carry (a line break, a name with
    ``:`` or white space)."""
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    if not name or any(c in name for c in ": \t\r\n") or "\r" in text or "\n" in text:
        raise ValueError(f"header {name!r} cannot travel as a NATS header")
    return text


def nats_headers(message: ClaimedMessage, wire: cloudevents.Wire) -> dict[str, str]:
    """``message``'s headers as NATS carries them (text): strings as they are, numbers and
    booleans as JSON, None left out; ``Nats-Msg-Id`` = the event id. ``ValueError`` for a
    header NATS cannot carry (a line break, a name with ``:`` or white space) or a user
    header JetStream would read (``Nats-...``)."""
    headers = {}
    for name, value in wire.headers.items():
        if value is None:
            continue
        text = header_text(name, value)
        if name.lower().startswith(RESERVED_PREFIX):
            raise ValueError(f"header {name!r} is JetStream's own (Nats-...)")
        headers[name] = text
    if wire.content_type != cloudevents.CONTENT_TYPE:
        headers["content-type"] = wire.content_type
    headers[MSG_ID] = str(message.event_id)
    return headers


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
        self._nc = self._js = self._loop = None
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
        encoded = _encode(route, messages, outcomes)
        try:
            self._connect(_left(deadline))
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

    def _publish_within(
        self,
        route: Route,
        jetstream: JetStream,
        chains: list[list[tuple[int, bytes, dict[str, str]]]],
        deadline: float,
    ) -> dict[int, Outcome]:
        """The outcomes of the messages of ``chains`` acknowledged (or refused) by
        ``deadline``; the others are left out."""
        subject = jetstream.subject_for(route.destination)
        stream = jetstream.stream_for(route.destination)
        results: dict[int, Outcome] = {}
        chained = self._publish_chains(subject, stream, chains, results)
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
        self,
        subject: str,
        stream: str,
        chains: list[list[tuple[int, bytes, dict[str, str]]]],
        results: dict[int, Outcome],
    ) -> None:
        """Publish each chain (a key's messages, or an unordered message alone) one
        message after the other, the chains concurrently; each message's outcome into
        ``results`` as it comes."""
        await asyncio.gather(*(self._chain(subject, stream, c, results) for c in chains))

    async def _chain(
        self,
        subject: str,
        stream: str,
        chain: list[tuple[int, bytes, dict[str, str]]],
        results: dict[int, Outcome],
    ) -> None:
        for place, (index, body, headers) in enumerate(chain):
            outcome = await self._publish_one(subject, stream, body, headers)
            results[index] = outcome
            if outcome is not None:  # the rest of its key waits (sent after it, later)
                held = _behind(headers[MSG_ID])
                results.update((later, held) for later, _, _ in chain[place + 1 :])
                return

    async def _publish_one(
        self, subject: str, stream: str, body: bytes, headers: dict[str, str]
    ) -> Outcome:
        """Publish one message and await its PubAck: None when the stream has it."""
        import nats.errors
        from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

        try:
            await self._js.publish(subject, body, stream=stream, headers=dict(headers))
        except nats.errors.MaxPayloadError as exc:
            return Failure(
                f"MaxPayloadError: the message ({len(body)} bytes of payload) is larger than "
                f"the server's max_payload: {exc}",
                permanent=True,
                kind="max_payload",
            )
        except NoStreamResponseError:
            return await self._no_stream(subject, stream)
        except ServiceUnavailableError as exc:  # 503: JetStream without a leader
            return outage(exc)
        except APIError as exc:  # the stream refused this message for itself
            error = f"JetStream refused the message: {exc.description or exc}"
            return Failure(error[:MAX_ERROR_LENGTH])
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            return outage(exc)
        return None

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


def _encode(
    route: Route, messages: Sequence[ClaimedMessage], outcomes: list[Outcome]
) -> dict[int, tuple[bytes, dict[str, str]]]:
    """Each message's body and headers by its index; a message that cannot be
    encoded gets a permanent failure in ``outcomes``."""
    envelope = route.envelope or outbox_settings.DEFAULT_ENVELOPE
    if envelope == cloudevents.BINARY:  # no binary binding for NATS: structured
        envelope = cloudevents.STRUCTURED
    source = outbox_settings.CLOUDEVENTS_SOURCE
    encoded = {}
    for index, message in enumerate(messages):
        try:
            wire = cloudevents.wire(message, envelope, source)
            encoded[index] = (wire.body, nats_headers(message, wire))
        except (TypeError, ValueError, UnicodeError) as exc:
            outcomes[index] = Failure.from_exception(exc, permanent=True)
    return encoded


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
    encoded: Mapping[int, tuple[bytes, dict[str, str]]],
    outcomes: list[Outcome],
    *,
    ordered: bool,
) -> list[list[tuple[int, bytes, dict[str, str]]]]:
    """The batch's encoded messages as chains sent one message at a time: on an ordered
    route one chain per ordering key (in the batch's order, which is the key's sequence
    order), every other message a chain of its own. An ordered message behind one of its
    key that could not be encoded is not sent (its outcome says so)."""
    chains: dict[object, list[tuple[int, bytes, dict[str, str]]]] = {}
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
            chains.setdefault(scope, []).append((index, *encoded[index]))
    return list(chains.values())


def _behind(event_id: str) -> Failure:
    """The outcome of an ordered message not sent because an earlier one of its key
    failed: no attempt; the relay publishes it after that one."""
    return Failure.not_attempted(f"not sent: behind event {event_id} of its key, which failed", 0.0)
