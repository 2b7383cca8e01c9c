"""The Celery app of the test worker (``celery -A tests.celery_app worker``).

Broker: the test RabbitMQ (``OUTBOX["BROKER_URL"]``); the queue comes from
``TEST_CELERY_QUEUE`` so each test has its own.
"""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
django.setup()

from celery import Celery, bootsteps  # noqa: E402
from celery.worker import WorkController  # noqa: E402
from django.conf import settings  # noqa: E402

app = Celery("outbox-tests", broker=settings.OUTBOX["BROKER_URL"], set_as_current=True)
app.conf.task_default_queue = os.environ.get("TEST_CELERY_QUEUE", "celery")
# As the docs advise: a retry the broker refuses raises in the worker, not lost unseen.
app.conf.broker_transport_options = {"confirm_publish": True}
if os.environ.get("TEST_CELERY_EXCHANGE"):  # the queue bound to this exchange instead
    from kombu import Exchange, Queue

    queue = app.conf.task_default_queue
    exchange = Exchange(os.environ["TEST_CELERY_EXCHANGE"], type="direct")
    app.conf.task_queues = [Queue(queue, exchange, routing_key=queue)]
if os.environ.get("TEST_CELERY_PRIORITY"):  # the queue takes message priorities 0-9
    from tests.support import priority_queue

    app.conf.task_queues = [priority_queue(app.conf.task_default_queue)]
    app.conf.worker_prefetch_multiplier = 1  # so the worker takes the highest first
if os.environ.get("TEST_CELERY_PREFETCH"):  # a worker holds no more messages than this
    app.conf.worker_prefetch_multiplier = int(os.environ["TEST_CELERY_PREFETCH"])
app.conf.worker_hijack_root_logger = False
app.autodiscover_tasks()  # every installed app: tests.testapp, django_outbox (its runner)


class _Awake(bootsteps.StartStopStep):
    """A no-op timer every half second on the worker's event loop. An idle worker's loop
    sleeps until its next timer, up to 10 s (kombu's hub), before it sees a shutdown
    signal: every test that stopped a worker waited those seconds (about 200 s a run)."""

    requires = ("celery.worker.components:Hub",)

    def start(self, worker: WorkController) -> None:
        if worker.hub is not None:  # None for a pool without an event loop
            worker.hub.call_repeatedly(0.5, _awake)


def _awake() -> None:
    """Nothing: its timer only bounds the event loop's sleep."""


app.steps["worker"].add(_Awake)
