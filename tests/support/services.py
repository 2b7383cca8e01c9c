"""The services themselves (scripts/services): stopped and started for outage tests,
``rabbitmqctl``, a Redis out of memory or read-only, a broker URL nothing listens on."""

from __future__ import annotations

import functools
import random
import socket
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tests.support.brokers import REDIS_URL
from tests.support.processes import REPO, wait_until


def services(*args: str) -> None:
    """Drive scripts/services (stop/start a broker for outage tests)."""
    subprocess.run([str(REPO / "scripts" / "services"), *args], check=True, timeout=180)


def services_output(*args: str, timeout: float = 120) -> str:
    """``scripts/services ARGS``, which must succeed; its stdout."""
    result = subprocess.run(
        [str(REPO / "scripts" / "services"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def rabbitmqctl(*args: str) -> str:
    """rabbitmqctl against the test broker (through scripts/services)."""
    return services_output("rabbitmqctl", *args)


def queue_settled(queue: str) -> bool:
    """No message waiting in RabbitMQ's ``queue`` and none delivered but unacked (tasks
    ack late)."""
    for line in rabbitmqctl(
        "list_queues", "name", "messages", "messages_unacknowledged"
    ).splitlines():
        name, *counts = line.split()
        if name == queue:
            return counts == ["0", "0"]
    return False


@contextmanager
def redis_maxmemory(margin: int | None = None) -> Iterator[Any]:
    """The test Redis at ``maxmemory`` (``noeviction``, as a broker's Redis should be):
    its memory in use now plus ``margin`` bytes, or (None) 1 byte, so every write is
    refused; yields a client; the settings before are set back at the end."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    before = client.config_get("maxmemory")
    policy = client.config_get("maxmemory-policy")
    try:
        client.config_set("maxmemory-policy", "noeviction")
        used = client.info("memory")["used_memory"]
        client.config_set("maxmemory", 1 if margin is None else used + margin)
        yield client
    finally:
        client.config_set("maxmemory", before["maxmemory"])
        client.config_set("maxmemory-policy", policy["maxmemory-policy"])
        client.close()


@contextmanager
def redis_read_only() -> Iterator[Any]:
    """The test Redis made a replica of a master that never answers (port 1): it refuses
    every write with ``READONLY``, as a Redis demoted by a Sentinel failover does to the
    clients still connected to it; its data stays (it never syncs). Yields a client; a
    master again at the end."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    client.execute_command("REPLICAOF", "127.0.0.1", "1")
    try:
        yield client
    finally:
        client.execute_command("REPLICAOF", "NO", "ONE")
        client.close()


@contextmanager
def redis_unable_to_persist(tmp_path: Path) -> Iterator[str]:
    """A Redis of its own (redis-server on a free port) that refuses every write with
    ``MISCONF``: its snapshot failed (its directory was removed under it) and it stops
    writes on a failed snapshot, as it does by default with save points. Yields its URL."""
    import redis

    port, workdir = free_port(), tmp_path / "redis-misconf"
    workdir.mkdir()
    server = subprocess.Popen(
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)),
            *("--save", "3600 1", "--stop-writes-on-bgsave-error", "yes", "--logfile", ""),
        ],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url)
        wait_until(lambda: _answers(client), timeout=10, what="the MISCONF redis-server")
        workdir.rmdir()  # the snapshot's temporary file cannot be made: it fails
        client.bgsave()
        saved = lambda: client.info("persistence")["rdb_last_bgsave_status"]  # noqa: E731
        wait_until(lambda: saved() == "err", timeout=10, what="the snapshot failed")
        client.close()
        yield url
    finally:
        server.kill()  # (a SIGTERM would have it save first, which fails: it stays up)
        server.wait(10)


def _answers(client: Any) -> bool:
    import redis

    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free a moment ago, for servers the test starts
    there. They are bound together before any is freed: ports bound and freed one at a
    time can come back equal (it happened: Prometheus then scraped itself). They are
    drawn from outside the kernel's range of ephemeral ports: a port the kernel handed
    out was once given to another chain's outgoing connection before the test's
    PostgreSQL could bind it."""
    low, high = _ephemeral_ports()
    choices = [port for port in range(10_000, 65_536) if not low <= port <= high]
    found: list[int] = []
    with ExitStack() as stack:
        while len(found) < count:
            port = random.choice(choices)
            probe = stack.enter_context(socket.socket())
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # taken, or lingering in TIME_WAIT
                continue
            found.append(port)
    return found


@functools.cache
def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel gives outgoing connections their local port from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    except (OSError, ValueError):  # not Linux: the IANA range, as BSD and macOS use
        return 49_152, 65_535
    return int(low), int(high)


def free_port() -> int:
    """A loopback port free a moment ago, for a server the test starts there."""
    (port,) = free_ports(1)
    return port


@functools.cache
def _held_unlistened() -> socket.socket:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    return held


def refused_port() -> int:
    """A loopback port where every connection is refused, for as long as the test process
    runs: a socket is bound there and never listens. A port only freed could be taken by
    a server another test (or the other CI chain) starts; this one cannot be bound again."""
    return int(_held_unlistened().getsockname()[1])


def unreachable_broker_url(password: str = "guest") -> str:
    """An AMQP URL on a loopback port where every connection is refused at once."""
    return f"amqp://guest:{password}@127.0.0.1:{refused_port()}//"
