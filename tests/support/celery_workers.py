"""Celery in the tests: a real worker process of ``tests.celery_app``, an app with
publisher confirms on a private queue, and a priority queue as docs/tasks.md declares it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import kombu

from tests.support.brokers import AMQP_URL, delete_queue
from tests.support.processes import REPO, relay_env
from tests.support.rows import unique_destination


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
