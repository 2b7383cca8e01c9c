"""Triggers for the section "A broker the relay cannot reach" of docs/hostile-input.md."""

from __future__ import annotations

import logging
import subprocess
from typing import Any

from django.test import override_settings

from django_outbox.relay import Relay
from tests.support import (
    manage,
    manage_command,
    never_migrated_env,
    stage_events,
    unique_destination,
    unreachable_broker_url,
)

from . import case


@case("publish-failed-log")
def publish_failed_log(request: Any) -> str:
    caplog = request.getfixturevalue("caplog")
    stage_events(3, unique_destination())
    with override_settings(OUTBOX={"BROKER_URL": unreachable_broker_url()}):
        with caplog.at_level(logging.WARNING, logger="django_outbox"), Relay() as relay:
            assert relay.run_once().failed == 3
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "outbox.publish_failed"]
    return record.getMessage()


@case("drain-broker-unreachable")
def drain_broker_unreachable(request: object) -> str:
    stage_events(3, unique_destination())
    result = manage("run_outbox_relay", "--drain", BROKER_URL=unreachable_broker_url(), timeout=60)
    assert result.returncode == 1
    return result.stderr.strip().splitlines()[-1]


@case("never-migrated")
def never_migrated(request: Any) -> str:
    result = subprocess.run(
        manage_command("run_outbox_relay", "--drain"),
        env=never_migrated_env(request.getfixturevalue("tmp_path")),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    return result.stderr.strip()
