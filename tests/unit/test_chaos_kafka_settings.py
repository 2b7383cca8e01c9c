"""The chaos suite's Kafka settings (chaos/settings.py, the ``kafka`` profile): its third
destination is a transactional route in a topic of its own, and each relay has its own
``transactional.id``, the same across its restarts. Two relays sharing one (the default,
``django-outbox-<host name>``, on one machine) would fence each other, and a relay
restarted under another id would not find its own record: the profile's transactional
line would then judge something else than the route.

Each case loads the settings module in a fresh interpreter (they are read from the
environment at import), as the runner starts its processes; nothing connects to Kafka.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import REPO

PRINT = (
    "import json; from chaos import settings as s; "
    "print(json.dumps({'brokers': s.OUTBOX['BROKERS'], 'routes': s.OUTBOX['ROUTES']}))"
)


def _settings(role: str, **more: str) -> dict[str, dict[str, dict[str, object]]]:
    env = {
        **os.environ,
        "CHAOS_ROLE": role,
        "CHAOS_KAFKA_TOPIC": "chaos.kafka.run",
        "CHAOS_KAFKA_TX_TOPIC": "chaos.kafka.run.transactional",
        "OUTBOX_KAFKA_URL": "kafka://127.0.0.1:1",
        **more,
    }
    found = subprocess.run(
        [sys.executable, "-c", PRINT], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(found.stdout)


@pytest.mark.parametrize("role", ["relay-1", "relay-2"])
def test_each_relay_has_its_own_transactional_id(role: str) -> None:
    kafka = _settings(role)["brokers"]["kafka"]
    assert kafka["OPTIONS"] == {"transactional.id": f"chaos-{role}"}


def test_other_processes_build_no_transactional_producer() -> None:
    assert _settings("consumer-kafka-tx")["brokers"]["kafka"]["OPTIONS"] == {}


def test_the_transactional_route_has_a_topic_of_its_own() -> None:
    routes = _settings("relay-1")["routes"]
    assert routes["chaos.kafka.payments"] == {
        "broker": "kafka",
        "topic": "chaos.kafka.run.transactional",
        "ordered": True,
        "transactional": True,
    }
    assert "transactional" not in routes["chaos.kafka.orders"]
    assert routes["chaos.kafka.orders"]["topic"] == "chaos.kafka.run"


def test_the_relay_that_orders_nothing_keeps_it_transactional() -> None:
    routes = _settings("relay-2", CHAOS_ORDERS_NOTHING="1")["routes"]
    assert routes["chaos.kafka.payments"]["transactional"] is True
    assert "ordered" not in routes["chaos.kafka.payments"]
