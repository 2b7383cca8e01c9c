"""A kombu connection to a broker, shared by publishing (the kombu transports) and
consuming (the consumer, the replay of parked messages): connecting, failover, bounded
socket waits, releasing, and which errors mean the broker or the way to it failed.

A broker URL may be kombu's failover list (``amqp://a//;amqp://b//;amqp://c//``, the
nodes of a cluster): :func:`connect` tries each address once, in the list's order,
so a relay or consumer whose node stops is on another node at its next attempt.

A transient error leaves the messages in flight unsettled; :func:`transient_failure`
says what that means for them: a broker that stopped answering (:class:`BrokerStalled`)
or refuses writes for now (a Redis out of memory, read-only or unable to persist:
:func:`~.redis_wire.write_refusal`) is down, no attempt counted; any other error counts
one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kombu
import kombu.exceptions

from .base import Failure
from .redis_wire import write_refusal

CONNECT_TIMEOUT = 5.0
#: How kombu walks a failover list: each address in turn, from the first.
FAILOVER_STRATEGY = "round-robin"


def new_connection(url: str, options: Mapping[str, Any] | None = None) -> kombu.Connection:
    """A kombu connection to ``url`` (a failover list too), not connected yet."""
    return kombu.Connection(
        url,
        transport_options=dict(options or {}),
        connect_timeout=CONNECT_TIMEOUT,
        failover_strategy=FAILOVER_STRATEGY,
    )


def connect(connection: kombu.Connection) -> None:
    """Connect: one try at each address of a failover list, in its order, without a
    pause between them; a single URL gets kombu's own ``connect()`` (two tries). The
    driver's error of the last address is raised; the caller owns the backoff."""
    connection.ensure_connection(
        max_retries=max(len(connection.alt) - 1, 1), reraise_as_library_errors=False
    )


def open_connection(
    url: str, options: Mapping[str, Any] | None, *, socket_timeout: float
) -> kombu.Connection:
    """A connection to ``url``, connected (:func:`connect`: the caller owns the
    backoff), its socket's waits bounded by ``socket_timeout`` seconds
    (:func:`bound_socket_waits`); released when it cannot be made."""
    connection = new_connection(url, options)
    try:
        connect(connection)
        bound_socket_waits(connection, socket_timeout)
    except BaseException:
        connection.release()
        raise
    return connection


def bound_socket_waits(connection: kombu.Connection, seconds: float) -> None:
    """Make py-amqp give up on a broker that does not answer within ``seconds``: it
    waits for the reply to its close without end, so a broker that went silent while
    the relay was idle would keep a stopping relay from exiting. Other drivers (and
    a connection never made) are left as they are."""
    transport = getattr(connection._connection, "_transport", None)  # py-amqp's socket owner
    sock = getattr(transport, "sock", None)
    if sock is not None:
        sock.settimeout(seconds)


def release(connection: kombu.Connection, log: logging.Logger, *, graceful: bool = True) -> None:
    """Drop ``connection``; an error doing so is logged at DEBUG to ``log`` (the
    caller's). ``graceful=False`` closes the socket without AMQP's close handshake:
    after an error the broker may never answer it (a resource alarm, a network that
    drops packets) and the handshake would wait forever."""
    try:
        if graceful:
            bound_socket_waits(connection, CONNECT_TIMEOUT)
            connection.release()
        else:
            connection.collect()
    except Exception:  # the connection is already broken; nothing to save
        log.debug("error closing a broken broker connection", exc_info=True)


def transient_errors(connection: kombu.Connection) -> tuple[type[BaseException], ...]:
    """Errors that mean the broker or the way to it failed, not the message: the
    connection's driver errors (which ``connection`` need not be connected to tell)."""
    return (
        kombu.exceptions.OperationalError,
        kombu.exceptions.BatchPublishError,  # a pipeline failed: delivery uncertain
        OSError,
        *connection.connection_errors,
        *connection.channel_errors,
    )


class BrokerStalled(ConnectionError):
    """The broker took messages and did not confirm them: it blocked the connection
    (a resource alarm) or said nothing within the confirm timeout. Its messages may
    still arrive; the relay treats the broker as down (no attempt counted)."""


def _stalled(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker stopped answering (not that the message or the
    connection failed): no confirm in time, a blocked connection, or a write that
    timed out because the broker stopped reading (py-amqp wraps the socket timeout)."""
    return isinstance(exc, (BrokerStalled, TimeoutError)) or isinstance(
        exc.__context__, TimeoutError
    )


def transient_failure(exc: BaseException) -> Failure:
    """The outcome of the messages a transient error left unsettled: a broker that
    stopped answering (see :func:`_stalled`) or refuses writes for now (see
    :func:`~.redis_wire.write_refusal`) is down, no attempt counted; any other error
    (a connection refused or reset, a channel closed) counts one, and the relay then
    backs off from the broker, its rows not attempted meanwhile. Shared with the Celery
    transport, whose sends meet the same errors."""
    refusal = write_refusal(exc)
    if refusal is not None:
        return Failure.broker_down(
            f"the broker is {refusal.condition} ({refusal.why}): {type(exc).__name__}: {exc}",
            kind=refusal.kind,
        )
    if _stalled(exc):
        return Failure.broker_down(f"{type(exc).__name__}: {exc}")
    return Failure.from_exception(exc)
