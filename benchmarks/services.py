"""The services under test, started with the project's own ``scripts/services``.

Services already running are used as they are; the ones this run started are
stopped again when it ends. Ports follow the ``OUTBOX_*_PORT`` variables that
``scripts/services`` honours. The benchmark works in its own database,
``outbox_bench``, created afresh on the PostgreSQL server and dropped at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "services"
NAMES = ("postgres", "rabbitmq", "redis")
DATABASE = "outbox_bench"


class Services:
    def __init__(self) -> None:
        self.started: list[str] = []
        self.env: dict[str, str] = {}

    def __enter__(self) -> Services:
        status = self._run("status")
        self.started = [name for name in NAMES if f"{name}: running" not in status]
        if self.started:
            print(f"starting {', '.join(self.started)} with scripts/services", file=sys.stderr)
            self._run("start", *self.started)
        for line in self._run("env").splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            self.env[name] = value
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.started:
            self._run("stop", *self.started)

    def _run(self, *args: str) -> str:
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
    def redis_url(self) -> str:
        return self.env["OUTBOX_REDIS_URL"]

    @property
    def database_url(self) -> str:
        """The benchmark database on the services' PostgreSQL."""
        return urlunsplit(urlsplit(self.env["DATABASE_URL"])._replace(path=f"/{DATABASE}"))


def recreate_database(url: str) -> None:
    """Drop and create the benchmark database on the server of ``url``."""
    _on_server(
        url, f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)', f'CREATE DATABASE "{DATABASE}"'
    )


def drop_database(url: str) -> None:
    _on_server(url, f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')


def _on_server(url: str, *statements: str) -> None:
    """Run ``statements`` on the server of ``url``, connected to its ``postgres`` database."""
    import psycopg

    server = urlunsplit(urlsplit(url)._replace(path="/postgres"))
    with psycopg.connect(server, autocommit=True) as connection:
        for statement in statements:
            connection.execute(statement)


def worker_env(services: Services) -> dict[str, str]:
    """The environment of the runner's Django and of every worker it starts."""
    return {
        **os.environ,
        **services.env,
        "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
        "OUTBOX_BENCH_DATABASE_URL": services.database_url,
        "PYTHONUNBUFFERED": "1",
    }
