"""``manage.py run_outbox_relay ARGS`` with tests.celery_app as the current Celery app, as
in a project that imports its Celery app in its package's ``__init__`` (docs/tasks.md):
the relay subprocess of the Django tasks tests, which sends tasks through that app."""

from __future__ import annotations

import sys

from django.core.management import execute_from_command_line

import tests.celery_app  # noqa: F401  (sets up Django and makes its app current)

if __name__ == "__main__":
    execute_from_command_line(["manage.py", "run_outbox_relay", *sys.argv[1:]])
