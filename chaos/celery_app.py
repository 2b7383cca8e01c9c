"""The chaos suite's Celery app (Django 6 only), written as Celery's Django guide writes a
project's: ``celery -A chaos.celery_app worker`` is the task worker, and the app
(:class:`chaos.apps.ChaosConfig` imports it, as a project's package does) is current in
every chaos process, so the relays send the Django tasks through it. Its settings are the
``CELERY_`` ones of :mod:`chaos.settings`: the relays' broker (theirs through the proxy),
with publisher confirms."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chaos.settings")
app = Celery("chaos")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # django_outbox.tasks: the Celery task that runs Django tasks
