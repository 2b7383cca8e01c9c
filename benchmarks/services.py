"""The services a runner needs (the benchmarks, the chaos suite), started with the
project's own ``scripts/services``.

Services already running are used as they are; the ones this run started are
stopped again when it ends. Ports follow the ``OUTBOX_*_PORT`` variables that
``scripts/services`` honours. A runner works in a database of its own (the
benchmark in ``outbox_bench``, the chaos suite in ``outbox_chaos``), created afresh
on the PostgreSQL server and dropped at the end.

It lives with the benchmarks, the first runner that needed it, and the chaos suite
imports it from here (``benchmarks.services``): both runners are development tools
outside the package and outside the test suite, and one module keeps one way to start
the services (a third top-level name would add nothing but a place to look).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "services"
NAMES = ("postgres", "rabbitmq", "redis")


class Services:
    def __init__(
        self,
        database: str,
        *,
        names: tuple[str, ...] = NAMES,
        cluster: bool = False,
        nats: bool = False,
        kafka: bool = False,
    ) -> None:
        self.database = database
        #: The services needed, of :data:`NAMES`.
        self.names = names
        #: The three-node clusters needed too, by their ``scripts/services`` command: the
        #: RabbitMQ cluster (the chaos suite's faults), the NATS JetStream cluster and the
        #: Kafka cluster (their destinations and faults).
        self.clusters = [
            name
            for name, wanted in (("cluster", cluster), ("nats", nats), ("kafka", kafka))
            if wanted
        ]
        self.clusters_started: list[str] = []
        self.started: list[str] = []
        self.env: dict[str, str] = {}

    def __enter__(self) -> Services:
        status = self.run("status")
        self.started = [name for name in self.names if f"{name}: running" not in status]
        if self.started:
            print(f"starting {', '.join(self.started)} with scripts/services", file=sys.stderr)
            self.run("start", *self.started)
        for name in self.clusters:
            if f"{name} node 1: running" not in self.run(name, "status"):
                print(f"starting the {name} cluster with scripts/services", file=sys.stderr)
                self.clusters_started.append(name)
                self.run(name, "start")
        for line in self.run("env").splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            self.env[name] = value.strip("'")  # OUTBOX_CLUSTER_URL is quoted (";")
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name in self.clusters_started:
            self.run(name, "stop")
        if self.started:
            self.run("stop", *self.started)

    def run(self, *args: str) -> str:
        """``scripts/services ARGS`` (e.g. ``restart rabbitmq``); its stdout."""
        result = subprocess.run(
            [str(SCRIPT), *args], capture_output=True, text=True, timeout=300, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"scripts/services {' '.join(args)} failed:\n{result.stderr}")
        return result.stdout

    @property
    def amqp_url(self) -> str:
        return self.env["OUTBOX_BROKER_URL"]

    @property
    def cluster_url(self) -> str:
        """The cluster's three nodes as kombu's failover list."""
        return self.env["OUTBOX_CLUSTER_URL"]

    @property
    def nats_url(self) -> str:
        """The NATS cluster's three servers (``nats://h:p1,h:p2,h:p3``)."""
        return self.env["OUTBOX_NATS_URL"]

    @property
    def kafka_url(self) -> str:
        """The Kafka cluster's three brokers (``kafka://h:p1,h:p2,h:p3``)."""
        return self.env["OUTBOX_KAFKA_URL"]

    @property
    def redis_url(self) -> str:
        return self.env["OUTBOX_REDIS_URL"]

    @property
    def database_url(self) -> str:
        """The runner's own database on the services' PostgreSQL."""
        return urlunsplit(urlsplit(self.env["DATABASE_URL"])._replace(path=f"/{self.database}"))


def recreate_database(url: str) -> None:
    """Drop and create the database of ``url`` on its server."""
    name = _database(url)
    _on_server(url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'CREATE DATABASE "{name}"')


def drop_database(url: str) -> None:
    _on_server(url, f'DROP DATABASE IF EXISTS "{_database(url)}" WITH (FORCE)')


def _database(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


def _on_server(url: str, *statements: str) -> None:
    """Run ``statements`` on the server of ``url``, connected to its ``postgres`` database."""
    import psycopg

    server = urlunsplit(urlsplit(url)._replace(path="/postgres"))
    with psycopg.connect(server, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)
