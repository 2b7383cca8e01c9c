"""A TCP proxy on loopback between the relays and RabbitMQ, for the network faults.

The relays connect to the proxy's port instead of RabbitMQ's (the consumer connects
directly), so the fault injector can damage their network without ``tc netem``, which
would act on the loopback interface everyone on the machine shares:

* ``delay(seconds)``: every chunk read from either side is sent on ``seconds`` later
  (latency, in order, not a pause of the stream);
* ``partition()``: nothing is forwarded any more, in either direction, and the sockets
  stay open: to a relay the broker goes silent, as behind a dead link; ``heal()``
  then resets every connection that lived through the partition (what it was sent
  is gone, so its stream is broken) and forwards again.

Each connection runs two threads per direction: a reader stamping each chunk with the
time it is due, and a sender that sends it then.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time

CHUNK = 65536


class Proxy:
    """Forward ``127.0.0.1:<port>`` to ``target`` until :meth:`close`."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._links: list[_Link] = []
        self._delay = 0.0
        self._blackhole = False
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    @property
    def connections(self) -> int:
        with self._lock:
            return sum(1 for link in self._links if not link.closed)

    def delay(self, seconds: float) -> None:
        """Add ``seconds`` of latency to every chunk from now on (0: none)."""
        self._delay = seconds

    def partition(self) -> None:
        """Stop forwarding; keep every socket open."""
        self._blackhole = True

    def heal(self) -> int:
        """Reset the connections that lived through the partition and forward again;
        returns how many were reset."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.reset()
        self._blackhole = False
        return sum(1 for link in links if link.was_open)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.heal()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the broker is down: so is the proxy's side of it
                continue
            upstream.settimeout(None)
            link = _Link(self, client, upstream)
            with self._lock:
                self._links.append(link)
            link.start()

    def due(self) -> float | None:
        """When a chunk read now is to be sent; None: drop it (a partition)."""
        if self._blackhole:
            return None
        return time.monotonic() + self._delay


class _Link:
    """One proxied connection: a client socket and its upstream socket."""

    def __init__(self, proxy: Proxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.sockets = (client, upstream)
        self.closed = False
        self.was_open = True

    def start(self) -> None:
        client, upstream = self.sockets
        for src, dst in ((client, upstream), (upstream, client)):
            chunks: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
            threading.Thread(target=self._read, args=(src, chunks), daemon=True).start()
            threading.Thread(target=self._send, args=(dst, chunks), daemon=True).start()

    def _read(self, src: socket.socket, chunks: queue.Queue[tuple[float, bytes] | None]) -> None:
        while True:
            try:
                data = src.recv(CHUNK)
            except OSError:
                data = b""
            if not data:
                chunks.put(None)
                self.close()
                return
            due = self.proxy.due()
            if due is not None:
                chunks.put((due, data))

    def _send(self, dst: socket.socket, chunks: queue.Queue[tuple[float, bytes] | None]) -> None:
        while (item := chunks.get()) is not None:
            due, data = item
            time.sleep(max(0.0, due - time.monotonic()))
            if self.proxy.due() is None:
                continue  # partitioned while it waited: lost on the way
            try:
                dst.sendall(data)
            except OSError:
                self.close()
                return

    def reset(self) -> None:
        """Close both sockets with an RST (SO_LINGER 0), not a clean FIN."""
        self.was_open = not self.closed
        for sock in self.sockets:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        self.closed = True
        for sock in self.sockets:
            try:  # shutdown wakes this link's threads blocked in recv; close alone would not
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
