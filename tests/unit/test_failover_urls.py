"""Broker URLs that are kombu failover lists (``amqp://a//;amqp://b//``, the nodes of a
RabbitMQ cluster) through OUTBOX["BROKERS"]: accepted when every address names one
transport, refused with a one-line E010 otherwise, and never shown with a password.
No services: nothing here connects (tests/integration/test_cluster.py does)."""

from __future__ import annotations

import pytest
from django.test import override_settings

from django_outbox.conf import outbox_settings
from django_outbox.conf.redact import mask_url, url_problem
from django_outbox.transports.connection import new_connection

SECRETS = ("pw-one-9f2c", "pw-two-7d1e", "pw-three-4b8a")
CLUSTER = ";".join(
    f"amqp://guest:{secret}@127.0.0.1:{port}//"
    for secret, port in zip(SECRETS, (55680, 55681, 55682), strict=True)
)


def problems(url):
    with override_settings(OUTBOX={"BROKERS": {"default": {"URL": url}}}):
        return [(p.id, p.msg) for p in outbox_settings.problems()]


def test_every_password_of_a_failover_list_is_masked():
    assert mask_url(CLUSTER) == (
        "amqp://guest:***@127.0.0.1:55680//;amqp://guest:***@127.0.0.1:55681//;"
        "amqp://guest:***@127.0.0.1:55682//"
    )


def test_a_failover_list_passes_the_checks_and_gives_kombu_every_address():
    assert problems(CLUSTER) == []
    connection = new_connection(CLUSTER)
    assert [url.rpartition(":")[2] for url in connection.alt] == ["55680//", "55681//", "55682//"]
    assert connection.port == 55680  # round-robin: the list's order, from the first


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        (
            f"amqp://guest:{SECRETS[0]}@h1//;redis://:{SECRETS[1]}@h2:6379/0",
            "its failover list mixes transports (amqp, redis); a list names one broker",
        ),
        (
            f"amqp://guest:{SECRETS[0]}@h1//;",
            'its failover list has an empty address or white space around a ";"',
        ),
        (
            f"amqp://guest:{SECRETS[0]}@h1//; amqp://guest:{SECRETS[1]}@h2//",
            'its failover list has an empty address or white space around a ";"',
        ),
    ],
)
def test_a_broken_failover_list_is_e010_with_no_password(url, reason):
    assert url_problem(url) == reason
    [(check_id, message)] = problems(url)
    assert check_id == "django_outbox.E010"
    assert reason in message
    assert "\n" not in message
    for secret in SECRETS:
        assert secret not in message
