"""Helpers for tests that run real relay processes against real brokers."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kombu
from django.conf import settings
from django.db import connections, transaction

from django_outbox import stage_many
from django_outbox.db import database_now
from django_outbox.envelope import CONTENT_ENCODING, CONTENT_TYPE
from django_outbox.models import OutboxMessage
from django_outbox.workers.samples import current_minute

REPO = Path(__file__).resolve().parent.parent
AMQP_URL = settings.OUTBOX["BROKER_URL"]
REDIS_URL = settings.REDIS_URL


def unique_destination(prefix: str = "t") -> str:
    """A destination (and so a queue) no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def stage_events(
    count: int, destination: str, *, using: str = "default", chunk: int = 1000, keys: int = 0
):
    """Commit ``count`` events to ``destination``; payload {"n": i}. Returns their event ids."""
    ids: list[str] = []
    for start in range(0, count, chunk):
        with transaction.atomic(using=using):
            rows = stage_many(
                [
                    {
                        "event_type": "test.event",
                        "payload": {"n": n},
                        "destination": destination,
                        **({"key": f"k{n % keys}"} if keys else {}),
                    }
                    for n in range(start, min(start + chunk, count))
                ],
                using=using,
            )
        ids += [str(row.event_id) for row in rows]
    return ids


def database_url(alias: str = "default") -> str:
    """The URL of the database the tests really use (pytest-django's test_ database)."""
    params = connections[alias].settings_dict
    return f"postgres://{params['USER']}@{params['HOST']}:{params['PORT']}/{params['NAME']}"


def relay_env(**outbox: Any) -> dict[str, str]:
    """The environment of a manage.py subprocess: the test databases, OUTBOX overrides."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=database_url("default"),
        OTHER_DATABASE_URL=database_url("other"),
        OUTBOX_OVERRIDES=json.dumps(outbox),
        PYTHONUNBUFFERED="1",
    )
    return env


def manage_command(name: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "manage.py"), name, *args]


def relay_command(*args: str) -> list[str]:
    return manage_command("run_outbox_relay", *args)


def never_migrated_env(folder: Path) -> dict[str, str]:
    """The environment of a command whose database is a new SQLite file in ``folder``,
    never migrated (the test settings otherwise)."""
    (folder / "fresh_settings.py").write_text(
        "from tests.settings import *  # noqa: F403\n\n"
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(folder / 'db.sqlite3')!r}}}}}\n"
        # W006: the tasks backend of the test settings on SQLite (Django 6).
        "SILENCED_SYSTEM_CHECKS = ['django_outbox.W001', 'django_outbox.W006']\n"
    )
    env = relay_env()
    env.update(
        DJANGO_SETTINGS_MODULE="fresh_settings",
        PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]),
    )
    return env


def run_python(
    code: str, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (with ``args``) in a fresh interpreter with the test settings, the
    test databases and ``env`` on top."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**relay_env(), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_command(name: str, *args: str, **outbox: Any) -> subprocess.Popen[str]:
    """Start ``manage.py name args...`` in the background, output captured."""
    return subprocess.Popen(
        manage_command(name, *args),
        cwd=REPO,
        env=relay_env(**outbox),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_relay(*args: str, **outbox: Any) -> subprocess.Popen[str]:
    return start_command("run_outbox_relay", *args, **outbox)


def run_relay(*args: str, timeout: float = 300, **outbox: Any) -> subprocess.CompletedProcess[str]:
    result = manage("run_outbox_relay", *args, timeout=timeout, **outbox)
    assert result.returncode == 0, result.stderr
    return result


def manage(*args: str, timeout: float = 120, **outbox: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        manage_command(*args),
        cwd=REPO,
        env=relay_env(**outbox),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def stop(
    process: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout: float = 60
) -> tuple[int, str, str]:
    process.send_signal(sig)
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def wait_until(predicate, *, timeout: float, interval: float = 0.1, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def status_counts(using: str = "default") -> dict[str, int]:
    counts = {s.value: 0 for s in OutboxMessage.Status}
    for status in OutboxMessage.objects.using(using).values_list("status", flat=True):
        counts[status] += 1
    return counts


@contextmanager
def broker_connection(url: str = AMQP_URL) -> Iterator[kombu.Connection]:
    connection = kombu.Connection(url, connect_timeout=10)
    try:
        yield connection
    finally:
        connection.release()


def consume(
    queue: str,
    expected: int,
    *,
    url: str = AMQP_URL,
    timeout: float = 120,
    idle: float = 1.0,
) -> list[kombu.Message]:
    """Read every message from ``queue`` (acking each) until ``expected`` arrived and the
    queue stayed quiet for ``idle`` seconds, so extra (duplicate) messages are seen too."""
    received: list[kombu.Message] = []
    deadline = time.monotonic() + timeout
    with broker_connection(url) as connection:
        simple = connection.SimpleQueue(queue, no_ack=False)
        try:
            while time.monotonic() < deadline:
                try:
                    message = simple.get(block=True, timeout=idle)
                except simple.Empty:
                    if len(received) >= expected:
                        break
                    continue
                message.ack()
                received.append(message)
        finally:
            simple.close()
    return received


def delete_queue(queue: str, url: str = AMQP_URL) -> None:
    with broker_connection(url) as connection:
        kombu.Queue(queue, channel=connection.channel()).delete()


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


def rabbitmqctl(*args: str) -> str:
    """rabbitmqctl against the test broker (through scripts/services)."""
    return services_output("rabbitmqctl", *args)


def publish_raw(queue: str, body: bytes | str, url: str = AMQP_URL, **properties: Any) -> None:
    """Put one message on ``queue`` as given (content type, headers ...): for the
    malformed messages a consumer must survive."""
    with broker_connection(url) as connection:
        producer = connection.Producer()
        producer.publish(body, routing_key=queue, retry=True, **properties)


def drain_raw(queue: str, url: str = AMQP_URL) -> list[kombu.Message]:
    """Take every message now in ``queue`` without decoding any (some may not decode)."""
    messages = []
    with broker_connection(url) as connection:
        bound = kombu.Queue(queue, channel=connection.channel())
        while (message := bound.get(no_ack=True)) is not None:
            messages.append(message)
    return messages


@contextmanager
def confirming_celery_queue(**queue_arguments: Any) -> Iterator[str]:
    """A current Celery app with publisher confirms on, set as docs/consuming.md says
    (``CELERY_BROKER_TRANSPORT_OPTIONS``), sending tasks to a private queue declared
    with ``queue_arguments``; yields the queue's name and deletes the queue after."""
    from celery import Celery
    from django.test import override_settings

    name = unique_destination("celery")
    queue = kombu.Queue(
        name, kombu.Exchange(name, type="direct"), routing_key=name, queue_arguments=queue_arguments
    )
    app = Celery("outbox-tests-confirms", broker=AMQP_URL, set_as_current=True)
    app.config_from_object("django.conf:settings", namespace="CELERY")
    try:
        with override_settings(
            CELERY_BROKER_TRANSPORT_OPTIONS={"confirm_publish": True},
            CELERY_TASK_QUEUES=[queue],
            CELERY_TASK_DEFAULT_QUEUE=name,
        ):
            assert app.conf.broker_transport_options == {"confirm_publish": True}
            yield name
    finally:
        delete_queue(name)
        app.close()


def unreachable_broker_url(password: str = "guest") -> str:
    """An AMQP URL on a loopback port nothing listens on (bound a moment ago, then freed):
    every connection is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"amqp://guest:{password}@127.0.0.1:{port}//"


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


def start_worker(
    queue: str, log: Path, pool: str = "solo", name: str = "celery", **env: str
) -> subprocess.Popen[str]:
    """A real worker of tests.celery_app on ``queue`` (its ``pool``: one process, or with
    "prefork" a parent and one child), logging to ``log`` (a file, not a pipe: a full pipe
    would stall the worker); ``name`` is its node name's first part (two workers at once
    need two); ``env`` joins its environment."""
    with log.open("w") as log_file:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "tests.celery_app",
                "worker",
                "--pool",
                pool,
                "--concurrency",
                "1",
                "--queues",
                queue,
                "--hostname",
                f"{name}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel",
                "INFO",
            ],
            cwd=REPO,
            env={**relay_env(), "TEST_CELERY_QUEUE": queue, **env},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )


def priority_queue(name: str) -> kombu.Queue:
    """A Celery queue ``name`` that orders messages by priority, as docs/tasks.md declares
    it (``x-max-priority`` 10: the broker priorities the Django tasks backend sends)."""
    return kombu.Queue(
        name,
        kombu.Exchange(name, type="direct"),
        routing_key=name,
        queue_arguments={"x-max-priority": 10},
    )


def minute_with_time_left(using: str = "default", *, seconds: int = 10) -> dt.datetime:
    """The database clock's minute, with at least ``seconds`` of it left (the end of a
    minute is waited out), so that what a test does next falls in this minute."""
    now = database_now(using)
    if now.second >= 60 - seconds:
        time.sleep(61 - now.second)
    return current_minute(using)


def publish_as_kombu(producer: kombu.Producer, route: Any, message: Any, **options: Any) -> None:
    """Publish a claimed ``message`` through kombu's own ``Producer.publish`` with what the
    relay sends (persistent, JSON, its wire headers, message id = event id), for tests that
    hold the relay's bytes or output against kombu's. ``options`` go to ``publish``."""
    headers = message.wire_headers()
    producer.publish(
        message.body,
        exchange=route.exchange,
        routing_key=route.routing_key_for(message.ordering_key),
        content_type=CONTENT_TYPE,
        content_encoding=CONTENT_ENCODING,
        headers=headers,
        delivery_mode=2,
        message_id=headers["event_id"],
        **options,
    )


#: TASKS with the outbox backend refusing an enqueue outside the caller's transaction.
TASKS_REQUIRING_TRANSACTION = {
    "default": {
        "BACKEND": "django_outbox.tasks.OutboxTaskBackend",
        "QUEUES": [],
        "OPTIONS": {"REQUIRE_TRANSACTION": True},
    }
}
