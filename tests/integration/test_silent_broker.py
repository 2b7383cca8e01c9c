"""A broker that stops answering: the relay neither hangs nor loses rows.

A batch whose confirms never come fails after the confirm timeout, and the next
publish reconnects; and a second SIGTERM/SIGINT makes ``run_outbox_relay`` exit at
once, non-zero, even while it waits for those confirms (the relay runs as a real
process and gets real signals). The broker goes silent in two ways: RabbitMQ
itself blocks publishers (a memory alarm, raised with ``rabbitmqctl
set_vm_memory_high_watermark``), and a TCP proxy between the relay and RabbitMQ
stops passing bytes (a network that drops everything; the proxy is ours because
no real part can freeze a connection half-way). Either way the relay has written
a batch and waits for confirms that never come.
"""

from __future__ import annotations

import contextlib
import select
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from django.db import transaction

from django_outbox import db, stage_many
from django_outbox.conf import outbox_settings
from django_outbox.conf.routes import Route
from django_outbox.envelope import ClaimedMessage
from django_outbox.transports.base import Failure, Outcome
from django_outbox.transports.kombu import AmqpTransport
from tests.support import (
    AMQP_URL,
    consume,
    delete_queue,
    rabbitmqctl,
    stage_events,
    start_relay,
    status_counts,
    unique_destination,
    wait_until,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.disrupts]

BROKER = (urlsplit(AMQP_URL).hostname or "127.0.0.1", urlsplit(AMQP_URL).port or 5672)
#: A generous bound on "at once": the relay would wait 30 s for confirms (CONFIRM_TIMEOUT).
PROMPTLY = 10.0


class FreezableProxy:
    """A TCP relay to ``upstream`` that passes bytes both ways until ``freeze()``,
    then passes none (and reads none, so the sender's buffers fill up), like a
    network that silently drops everything. ``thaw()`` is the network coming back:
    the frozen connections are reset, new ones pass again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.frozen = threading.Event()
        self._lock = threading.Lock()
        self._closed = False
        self._connections: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        """AMQP_URL, through this proxy."""
        return urlsplit(AMQP_URL)._replace(netloc=f"guest:guest@127.0.0.1:{self.port}").geturl()

    def freeze(self) -> None:
        self.frozen.set()

    def thaw(self) -> None:
        self._reset()
        self.frozen.clear()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._server.close()
        self._reset()

    def _reset(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for sock in connections:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            broker = socket.create_connection(self.upstream)
            with self._lock:
                if self._closed:
                    client.close()
                    broker.close()
                    return
                self._connections += [client, broker]
            for source, target in ((client, broker), (broker, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        while True:
            try:
                if self.frozen.is_set():
                    time.sleep(0.05)
                    if source.fileno() == -1:  # reset while frozen
                        return
                    continue
                readable, _, _ = select.select([source], [], [], 0.05)
                if not readable or self.frozen.is_set():
                    continue
                data = source.recv(65536)
                if not data:
                    return
                target.sendall(data)
            except (OSError, ValueError):  # reset or closed under us
                return


@pytest.fixture
def destination() -> Iterator[str]:
    name = unique_destination()
    yield name
    delete_queue(name)


@contextlib.contextmanager
def memory_alarm() -> Iterator[str]:
    """RabbitMQ blocks every publishing connection until the alarm clears."""
    try:
        rabbitmqctl("set_vm_memory_high_watermark", "0.0000001")
        wait_until(
            lambda: "memory" in rabbitmqctl("eval", "rabbit_alarm:get_alarms()."),
            timeout=30,
            what="RabbitMQ's memory alarm",
        )
        yield AMQP_URL
    finally:
        rabbitmqctl("set_vm_memory_high_watermark", "0.4")  # RabbitMQ's default


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
# (Under a memory alarm the relay no longer waits: the broker blocks the connection
# and says so, and the relay backs off at once, see test_slow_paths.)
@pytest.mark.parametrize("silence", ["frozen-network"])
def test_a_second_signal_exits_at_once_while_the_relay_waits_for_confirms(
    destination, sig, silence
):
    proxy = FreezableProxy(BROKER)
    relay = None
    try:
        url = proxy.url if silence == "frozen-network" else AMQP_URL
        relay = start_relay(BROKER_URL=url)
        # A first event goes through: the relay is connected, its queue declared.
        stage_events(1, destination)
        wait_until(lambda: status_counts()["published"] == 1, timeout=60, what="a first event")
        with memory_alarm() if silence == "memory-alarm" else contextlib.nullcontext():
            proxy.freeze()
            stage_events(20, destination)
            wait_until(
                lambda: status_counts()["processing"] == 20, timeout=30, what="a claimed batch"
            )
            time.sleep(1)  # now it waits for confirms (for 30 s)
            relay.send_signal(sig)
            with pytest.raises(subprocess.TimeoutExpired):  # the first signal waits for the batch
                relay.wait(timeout=2)

            relay.send_signal(sig)
            second = time.monotonic()
            try:
                _, err = relay.communicate(timeout=60)
            finally:
                took = time.monotonic() - second
        assert relay.returncode != 0, err
        assert took < PROMPTLY, f"exited {took:.1f}s after the second signal:\n{err}"
        name = signal.Signals(sig).name
        assert f"{name}: stopping after the batch in hand" in err
        assert f"{name} again: exiting at once" in err
        # Nothing lost: the batch in hand stays PROCESSING until its lease expires.
        assert status_counts() == {
            "pending": 0,
            "processing": 20,
            "published": 1,
            "failed": 0,
            "abandoned": 0,
        }
    finally:
        if relay is not None and relay.poll() is None:
            relay.kill()
            relay.communicate()
        proxy.close()


def claim_through_a_proxy(destination: str, limit: int):
    """Claim ``limit`` rows of ``destination``; their route, and a transport (confirm
    timeout 1 s) to the broker behind a new :class:`FreezableProxy`."""
    messages = db.claim("default", limit=limit, lease_seconds=60, worker="t", token=uuid.uuid4())
    route = outbox_settings.route_for(destination)
    assert route is not None
    proxy = FreezableProxy(BROKER)
    return messages, route, proxy, AmqpTransport(proxy.url, confirm_timeout=1)


def sigterm_while_silent(proxy: FreezableProxy, process: subprocess.Popen[str]):
    """Silence the broker, send ``process`` SIGTERM: its ``(stdout, stderr)`` and how
    many seconds it took to exit."""
    proxy.freeze()
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        out, err = process.communicate(timeout=60)
    finally:
        took = time.monotonic() - sent
    return out, err, took


def publish_after_the_broker_falls_silent(
    proxy: FreezableProxy, transport: AmqpTransport, route: Route, messages: list[ClaimedMessage]
) -> list[Outcome]:
    """Publish the first message, silence the broker, publish the rest: the outcomes of
    the rest, which must come back promptly instead of waiting for the broker."""
    assert transport.publish(route, messages[:1]) == [None]
    proxy.freeze()
    outcomes: list[Outcome] = []
    publish = threading.Thread(
        target=lambda: outcomes.extend(transport.publish(route, messages[1:])), daemon=True
    )
    publish.start()
    publish.join(timeout=PROMPTLY)
    assert not publish.is_alive(), "publish still waits for the silent broker"
    return outcomes


def test_confirms_that_never_come_fail_the_batch_and_the_next_publish_reconnects(destination):
    """Closing the connection after the timeout must not wait for the silent broker
    either (AMQP's close handshake would, forever)."""
    staged = stage_events(3, destination)
    messages, route, proxy, transport = claim_through_a_proxy(destination, 3)
    try:
        outcomes = publish_after_the_broker_falls_silent(proxy, transport, route, messages)
        # Not a failed attempt: the broker is down (no attempt counted, see test_slow_paths).
        timed_out = "BrokerStalled: 2 of 2 messages were not confirmed by the broker within 1s"
        assert outcomes == [Failure.broker_down(timed_out)] * 2

        proxy.thaw()
        assert transport.publish(route, messages[1:]) == [None, None]
    finally:
        proxy.close()  # also ends a publish that still waits
        transport.close()
    received = [m.headers["event_id"] for m in consume(destination, 3)]
    assert sorted(received) == sorted(staged)


def test_a_batch_too_big_for_the_socket_buffers_fails_too_instead_of_blocking_the_write(
    destination,
):
    """A broker that stops reading (RabbitMQ under a resource alarm, a dead network)
    fills the socket buffers: writing the batch must time out as waiting for its
    confirms does, not block for good."""
    with transaction.atomic():
        stage_many(
            {"event_type": "big", "payload": {"blob": "x" * 50_000}, "destination": destination}
            for _ in range(300)
        )
    messages, route, proxy, transport = claim_through_a_proxy(destination, 300)
    try:
        outcomes = publish_after_the_broker_falls_silent(proxy, transport, route, messages)
        assert len(outcomes) == 299
        # The socket's timeout (the relay's CONNECT_TIMEOUT, 5 s) ends the write.
        timed_out = (
            "BrokerStalled: the broker stopped reading: writing a batch of 299 messages timed out"
        )
        assert set(outcomes) == {Failure.broker_down(timed_out)}
    finally:
        proxy.close()
        transport.close()


def test_sigterm_stops_an_idle_relay_whose_broker_went_silent(destination):
    """Closing the connection waits for the broker's reply, but not for good."""
    proxy = FreezableProxy(BROKER)
    relay = start_relay(BROKER_URL=proxy.url)
    try:
        stage_events(1, destination)
        wait_until(lambda: status_counts()["published"] == 1, timeout=60, what="a first event")
        out, err, took = sigterm_while_silent(proxy, relay)
        assert relay.returncode == 0, err
        assert took < PROMPTLY, f"exited {took:.1f}s after SIGTERM:\n{err}"
        assert out.startswith("claimed 1, published 1,")
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.communicate()
        proxy.close()
