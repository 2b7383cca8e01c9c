"""Every setting of ``settings.OUTBOX``: its name, default, parser and line of docs, in
the order of the settings reference (docs/reference/settings.md, which
tests/integration/test_docs.py holds to this table)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings

from . import parsers


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    default: Any
    parse: Callable[[Any], Any] | None  # None: parsed by OutboxSettings._parse itself
    doc: str


#: Every knob of ``settings.OUTBOX``, in documentation order.
SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "BROKER_URL",
            None,
            parsers.optional_str,
            "kombu URL the relay publishes to; when None, settings.CELERY_BROKER_URL is used.",
        ),
        Setting(
            "BROKER_TRANSPORT_OPTIONS",
            {},
            parsers.string_dict,
            "transport_options passed to kombu.Connection (e.g. data_folder_in/out for "
            'filesystem://): the short form of OUTBOX["BROKERS"]["default"]["OPTIONS"].',
        ),
        Setting(
            "BROKERS",
            {},
            parsers.broker_table,
            'alias -> {"URL": kombu URL, "OPTIONS": transport options}; routes name an alias '
            '("broker"), "default" when they do not. BROKER_URL is the short form of '
            '{"default": {"URL": ...}}.',
        ),
        Setting(
            "ROUTES",
            {},
            None,  # parsed by parse_routes with DEFAULT_EXCHANGE, see _parse()
            "destination -> {exchange, exchange_type, routing_key, queue, queue_arguments, "
            "exchange_arguments, queue_type, dead_letter_exchange, broker, ordered, partitions, "
            "envelope} "
            "or {celery_task}.",
        ),
        Setting(
            "DEFAULT_EXCHANGE",
            "outbox",
            parsers.exchange_name,
            "durable topic exchange of the default route and of routes that name no exchange.",
        ),
        Setting(
            "DEFAULT_ROUTE",
            True,
            parsers.boolean,
            "publish destinations missing from ROUTES by the default route; False makes them "
            "an error at stage time.",
        ),
        Setting(
            "DEFAULT_ORDERED",
            False,
            parsers.boolean,
            'make the default route ordered (strict per-key order, as "ordered": True on a '
            "route; see docs/ordering.md).",
        ),
        Setting("BATCH_SIZE", 500, parsers.positive_int, "rows the relay claims per batch."),
        Setting(
            "MAX_BATCH_BYTES",
            16 * 1024 * 1024,
            parsers.positive_int,
            "bytes of payload JSON the relay claims per batch, at most (a batch always takes "
            "its first row, however large).",
        ),
        Setting(
            "MAX_PAYLOAD_BYTES",
            1024 * 1024,
            parsers.positive_int,
            "largest payload (and largest headers) stage() accepts, in bytes of UTF-8 JSON.",
        ),
        Setting(
            "LEASE_SECONDS",
            60,
            parsers.seconds,
            "how long a claim holds before another relay may take the row over; a RabbitMQ "
            "batch waits for its confirms at most a third of it (30 s at most).",
        ),
        Setting(
            "MAX_ATTEMPTS",
            10,
            parsers.positive_int,
            "publish attempts before a row is ABANDONED.",
        ),
        Setting(
            "RETRY_BASE_DELAY",
            1,
            parsers.seconds,
            "first retry delay in seconds; doubled per attempt.",
        ),
        Setting("RETRY_MAX_DELAY", 3600, parsers.seconds, "cap on the retry delay, in seconds."),
        Setting(
            "RETRY_JITTER",
            0.2,
            parsers.fraction,
            "random fraction (0-1) taken off each retry delay so failed rows do not retry in step.",
        ),
        Setting(
            "PUBLISHED_RETENTION",
            dt.timedelta(days=7),
            parsers.duration_or_zero,
            "how long PUBLISHED rows are kept (timedelta or seconds); 0: a row is deleted "
            "when the broker confirms it, and no PUBLISHED row is kept.",
        ),
        Setting(
            "ABANDONED_RETENTION",
            dt.timedelta(days=30),
            parsers.duration,
            "how long ABANDONED rows are kept after they were abandoned (timedelta or seconds).",
        ),
        Setting(
            "INBOX_RETENTION",
            dt.timedelta(days=7),
            parsers.duration,
            "how long inbox marks (and failure records of handled events) are kept; must exceed "
            "the longest time a message can be redelivered after it was handled.",
        ),
        Setting(
            "TASK_RESULT_RETENTION",
            dt.timedelta(days=7),
            parsers.duration,
            "how long the results of finished Django tasks (SUCCESSFUL or FAILED, by their "
            "finished time) are kept for get_result() and the admin (timedelta or seconds).",
        ),
        Setting(
            "CLEANUP_INTERVAL",
            300,
            parsers.seconds,
            "seconds between the retention cleanups a running relay makes.",
        ),
        Setting(
            "PARTITIONING",
            None,
            parsers.partitioning,
            "the sizes of a partitioned outbox (PostgreSQL, after manage.py outbox_partition): "
            '{"rows": ids per partition (1,000,000), "ahead": empty partitions the relays keep '
            "ahead (2)}; retention then drops whole partitions (see docs/scaling.md).",
        ),
        Setting(
            "POLL_INTERVAL",
            1,
            parsers.seconds,
            "seconds the relay sleeps when idle and no NOTIFY wakes it.",
        ),
        Setting(
            "HEARTBEAT_INTERVAL",
            10,
            parsers.seconds,
            "seconds between the heartbeats a running relay or consumer writes (its row in "
            "the relays and consumers table); live within 3 intervals, stale within 30.",
        ),
        Setting(
            "HEALTH_MAX_DUE_AGE",
            300,
            parsers.seconds,
            "seconds the oldest due row may wait before outbox_health and the health view "
            "report the outbox unhealthy.",
        ),
        Setting(
            "HEALTH_MAX_SNAPSHOT_AGE",
            600,
            parsers.seconds_or_zero,
            "seconds another session of the database (PostgreSQL) may hold a snapshot open "
            "before outbox_health and the health view report the outbox unhealthy, naming "
            "that session: vacuum keeps the rows the relays finished meanwhile; 0: not "
            "checked.",
        ),
        Setting(
            "METRICS_BACKLOG_INTERVAL",
            5,
            parsers.seconds_or_zero,
            "seconds a relay's /metrics serves the backlog gauges it last read before it reads "
            "them from the database again; 0: on every scrape.",
        ),
        Setting(
            "SIGNING_KEYS",
            (),
            parsers.signing_keys,
            "HMAC-SHA256 keys (str or bytes, 32 bytes at least): the relay signs each message "
            "with the first, a consumer that verifies accepts any (see docs/hostile-input.md).",
        ),
        Setting(
            "VERIFY_SIGNATURES",
            False,
            parsers.boolean,
            "run_outbox_consumer parks every message not signed by one of SIGNING_KEYS "
            "(also --verify-signatures).",
        ),
        Setting(
            "DEFAULT_ENVELOPE",
            "outbox",
            parsers.envelope,
            'the wire format of broker routes that name no "envelope": "outbox", '
            '"cloudevents" or "cloudevents-structured" (see docs/cloudevents.md).',
        ),
        Setting(
            "CLOUDEVENTS_SOURCE",
            "/django-outbox",
            parsers.text,
            "the CloudEvents source attribute of every event the relay publishes in a "
            "CloudEvents envelope: a URI reference naming your service (see docs/cloudevents.md).",
        ),
        Setting(
            "START_JITTER",
            1,
            parsers.seconds_or_zero,
            "a running relay (not a drain) waits a random 0 to START_JITTER seconds before its "
            "first claim, so relays started together do not claim and poll in step; 0: none.",
        ),
    )
}


def raw(name: str) -> Any:
    """``settings.OUTBOX[name]`` as the project wrote it (its default when the project
    sets none, or when ``OUTBOX`` is no dict), not parsed."""
    user = getattr(settings, "OUTBOX", {})
    if not isinstance(user, Mapping):
        user = {}
    return user.get(name, SETTINGS[name].default)
