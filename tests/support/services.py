"""The services themselves (scripts/services): stopped and started for outage tests,
``rabbitmqctl``, a Redis out of memory, a broker URL nothing listens on."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.support.brokers import REDIS_URL
from tests.support.processes import REPO


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


def unreachable_broker_url(password: str = "guest") -> str:
    """An AMQP URL on a loopback port nothing listens on (bound a moment ago, then freed):
    every connection is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"amqp://guest:{password}@127.0.0.1:{port}//"
