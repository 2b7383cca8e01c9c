"""The kombu transport's own log records are scrubbed of the configuration's
passwords, like the relay's. No broker: the records are written directly."""

from __future__ import annotations

import logging

from django.test import override_settings

from django_outbox.conf.routes import Route
from django_outbox.transports.declare import DeclareRefused
from django_outbox.transports.kombu import KombuTransport

URL = "amqp://u:s3cret-pw@nohost.invalid//"


def test_a_declare_refusal_quoting_a_password_is_logged_without_it(caplog):
    # A broker's refusal text (or a driver's) may quote a URL of the configuration.
    refused = DeclareRefused("queue", "orders", Exception(f"refused by {URL}"))
    with override_settings(OUTBOX={"BROKER_URL": URL}), caplog.at_level(logging.ERROR):
        KombuTransport(URL)._log_refusal(Route("orders", queue="orders"), refused)
    assert "refused by amqp://u:***@nohost.invalid//" in caplog.text
    assert "s3cret-pw" not in caplog.text
