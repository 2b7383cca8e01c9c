"""The transport registry: URL scheme -> class, and the capability flags. No services."""

from __future__ import annotations

import pytest

from django_outbox.conf import Broker
from django_outbox.transports import REGISTRY, Transport, for_broker, transport_class
from django_outbox.transports.filesystem import FilesystemTransport
from django_outbox.transports.kombu import AmqpTransport, KombuTransport, RedisTransport
from django_outbox.transports.memory import MemoryTransport


@pytest.mark.parametrize(
    ("scheme", "cls"),
    [
        ("amqp", AmqpTransport),
        ("AMQPS", AmqpTransport),
        ("pyamqp", AmqpTransport),
        ("redis", RedisTransport),
        ("rediss", RedisTransport),
        ("redis+socket", RedisTransport),
        ("sentinel", RedisTransport),
        ("filesystem", FilesystemTransport),
        ("memory", MemoryTransport),
        ("sqs", KombuTransport),
        ("mongodb", KombuTransport),
    ],
)
def test_a_scheme_names_its_transport(scheme, cls):
    assert transport_class(scheme) is cls


def test_every_registered_class_is_a_transport():
    assert all(issubclass(transport_class(scheme), Transport) for scheme in REGISTRY)


def test_the_flags():
    flags = {
        cls.__name__: (cls.supports_confirms, cls.supports_batch, cls.reports_unroutable)
        for cls in (AmqpTransport, RedisTransport, FilesystemTransport, KombuTransport)
    }
    assert flags == {
        "AmqpTransport": (True, False, True),
        "RedisTransport": (False, True, True),
        "FilesystemTransport": (False, False, True),
        "KombuTransport": (False, False, True),
    }
    assert (Transport.supports_confirms, Transport.supports_batch) == (False, False)
    assert Transport.reports_unroutable is False


def test_for_broker_builds_the_class_of_the_scheme_with_the_alias_when_named():
    named = Broker("events", "redis://h:6379/0", {"x": 1}, 'OUTBOX["BROKERS"]["events"]')
    transport = for_broker(named)
    assert isinstance(transport, RedisTransport)
    assert transport.alias == "events"
    assert transport.options_setting == 'OUTBOX["BROKERS"]["events"]["OPTIONS"]'
    short = Broker("default", "amqp://h//", {}, 'OUTBOX["BROKER_URL"]')
    transport = for_broker(short)
    assert isinstance(transport, AmqpTransport)
    assert transport.alias is None
    assert transport.options_setting == 'OUTBOX["BROKER_TRANSPORT_OPTIONS"]'


def test_a_named_broker_that_cannot_be_reached_is_named_by_the_check(tmp_path):
    """The filesystem broker's check looks for its folders: no network needed."""
    missing = str(tmp_path / "gone")
    options = {"data_folder_in": missing, "data_folder_out": missing}
    broker = Broker("files", "filesystem://", options, 'OUTBOX["BROKERS"]["files"]')
    transport = for_broker(broker)
    with pytest.raises(ConnectionError) as raised:
        transport.check()
    assert str(raised.value).startswith(
        "broker 'files' (filesystem://): FileNotFoundError: The filesystem:// broker's folder "
    )
    assert 'OUTBOX["BROKERS"]["files"]["OPTIONS"][\'data_folder_in\']' in str(raised.value)
    transport.close()


def test_problems_are_the_transports_own(tmp_path):
    missing = str(tmp_path / "gone")
    broker = Broker(
        "files",
        "filesystem://",
        {"data_folder_in": missing, "data_folder_out": missing},
        'OUTBOX["BROKERS"]["files"]',
    )
    problems = FilesystemTransport.problems(broker)
    assert [p.id for p in problems] == ["django_outbox.E012"] * 2
    assert 'OUTBOX["BROKERS"]["files"]["OPTIONS"]' in problems[0].msg
    assert MemoryTransport.problems(broker) == []
