"""What the settings know of a broker: :class:`Broker`, one entry of the broker table
(``OUTBOX["BROKERS"]``, or the short form ``BROKER_URL``), its URL's scheme, and the
Python package each kombu transport needs.

What each broker can do when publishing (confirms, batches, queue types) is the
transports' own (:mod:`django_outbox.transports`); this module only says what the
settings and their checks need before any transport is loaded.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class Broker:
    """One broker the relay publishes to: its alias, kombu URL and transport options,
    and ``setting``, where it is configured (for error texts)."""

    alias: str
    url: str
    options: Mapping[str, Any]
    setting: str

    @property
    def scheme(self) -> str:
        """The URL's transport, lowercased (``"amqp"``, ``"redis"``, ``"memory"`` ...)."""
        return broker_scheme(self.url)

    @property
    def options_setting(self) -> str:
        """The setting that holds this broker's transport options."""
        if self.setting.startswith('OUTBOX["BROKERS"]'):
            return f'{self.setting}["OPTIONS"]'
        return 'OUTBOX["BROKER_TRANSPORT_OPTIONS"]'

    @property
    def named(self) -> str:
        """How error texts name it: '' for the short form (BROKER_URL,
        CELERY_BROKER_URL), else ' of OUTBOX["BROKERS"]["alias"]'."""
        return f" of {self.setting}" if self.setting.startswith('OUTBOX["BROKERS"]') else ""


def broker_scheme(url: str) -> str:
    """The transport a broker URL names, lowercased: ``"amqp"`` for ``AMQP://host//``."""
    return url.partition("://")[0].lower()


#: The package a kombu transport needs, by URL scheme: (module to import, what to install).
DRIVERS = {
    **dict.fromkeys(
        ("redis", "rediss", "sentinel"), ("redis", '"django-transactional-outbox[redis]"')
    ),
    **dict.fromkeys(("sqs", "SQS"), ("boto3", '"kombu[sqs]"')),
    "mongodb": ("pymongo", '"kombu[mongodb]"'),
    "kafka": ("confluent_kafka", '"django-transactional-outbox[kafka]"'),
    "confluentkafka": ("confluent_kafka", '"kombu[confluentkafka]"'),
    "zookeeper": ("kazoo", '"kombu[zookeeper]"'),
    **dict.fromkeys(("sqlalchemy", "sqla"), ("sqlalchemy", '"kombu[sqlalchemy]"')),
    "consul": ("consul", '"kombu[consul]"'),
    "etcd": ("etcd", '"kombu[etcd]"'),
    "azurestoragequeues": ("azure.storage.queue", '"kombu[azurestoragequeues]"'),
    "azureservicebus": ("azure.servicebus", '"kombu[azureservicebus]"'),
    "gcpubsub": ("google.cloud.pubsub_v1", '"kombu[gcpubsub]"'),
    "librabbitmq": ("librabbitmq", '"kombu[librabbitmq]"'),
    "pyro": ("Pyro4", '"kombu[pyro]"'),
}

#: The scheme of the outbox's own Kafka transport (not kombu's ``confluentkafka://``).
KAFKA_SCHEME = "kafka"
_KAFKA_ADDRESS = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})")


def kafka_bootstrap(url: str) -> str:
    """The ``bootstrap.servers`` of a ``kafka://host:port[,host:port...]`` URL."""
    return url.partition("://")[2].rstrip("/")


def kafka_url_problem(url: str) -> str | None:
    """Why ``url`` is no ``kafka://host:port[,host:port...]`` (a phrase that never
    quotes it), or None. Credentials go in OPTIONS (``sasl.password``), never the URL."""
    addresses = kafka_bootstrap(url).split(",")
    for address in addresses:
        match = _KAFKA_ADDRESS.fullmatch(address)
        if match is None or not 0 < int(match[1]) < 65536:
            return "it is not of the form kafka://host:port[,host:port...]"
    return None


#: What to install for the Celery routes.
CELERY_EXTRA = '"django-transactional-outbox[celery]"'

#: The schemes of NATS JetStream brokers (``nats://host:port[,host:port...]``), published
#: by :mod:`django_outbox.transports.nats` through nats-py, not kombu.
NATS_SCHEMES = frozenset({"nats"})
#: What to install for a ``nats://`` broker: (module to import, what to install).
NATS_DRIVER = ("nats", '"django-transactional-outbox[nats]"')


def nats_servers(url: str) -> list[str]:
    """The server URLs of ``nats://user:password@h1:p1,h2:p2``: each address with the
    user and password the URL gives once."""
    scheme, _, rest = url.partition("://")
    userinfo, at, hosts = rest.rpartition("@")
    prefix = f"{scheme}://{userinfo}{at}"
    return [prefix + host.strip().rstrip("/") for host in hosts.split(",")]
