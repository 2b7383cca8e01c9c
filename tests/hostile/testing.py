"""Triggers for the rows of docs/hostile-input.md about the test helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from . import case, error_line


@case("outbox-fixture-without-django")
def outbox_fixture_without_django(request: Any) -> str:
    folder = request.getfixturevalue("tmp_path")
    (folder / "test_x.py").write_text("def test_x(outbox):\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:django"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    (line,) = [
        line for line in result.stdout.splitlines() if line.startswith("the outbox fixture needs")
    ]
    return line


@case("drain-route-unknown-broker")
def drain_unknown_alias(request: Any) -> str:
    from django.db import transaction
    from django.test import override_settings

    from django_outbox import stage
    from django_outbox.exceptions import OutboxConfigurationError
    from django_outbox.testing import drain

    outbox = {
        "BROKERS": {"default": {"URL": "memory://"}},
        "ROUTES": {"orders": {"queue": "orders", "broker": "evnets"}},
    }
    with override_settings(OUTBOX=outbox):
        with transaction.atomic():
            stage("order.placed", {"id": 1}, destination="orders")
        try:
            drain()
        except OutboxConfigurationError as exc:
            return error_line(exc)
    raise AssertionError("drain() published to an alias no broker has")
