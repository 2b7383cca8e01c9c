"""``manage.py run_outbox_consumer``: handle the events of one queue, once each."""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS
from django.utils.module_loading import import_string

from django_outbox.consumer import (
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_PREFETCH,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_MAX_DELAY,
    InboxConsumer,
)
from django_outbox.exceptions import BrokerUnreachable, OutboxError
from django_outbox.models import InboxFailure, InboxMessage

from ._options import (
    add_database_option,
    non_negative_int,
    non_negative_seconds,
    positive_int,
    positive_seconds,
    require_tables,
    stop_on_signals,
)

logger = logging.getLogger("django_outbox.consumer")


class Command(BaseCommand):
    help = (
        "Consume a queue and run a handler for each event through the inbox, so a "
        "redelivered event is acknowledged without running the handler again. Runs until "
        "SIGTERM/SIGINT, then finishes the message in hand and exits 0; a second signal "
        "exits at once."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", required=True, help="the queue to consume")
        parser.add_argument(
            "--handler",
            required=True,
            help="dotted path of a callable taking a django_outbox.ReceivedEvent",
        )
        parser.add_argument(
            "--consumer",
            help="the inbox name of this consumer: each consumer handles an event once "
            "(default: the name given to @inbox_handler, if the handler has one)",
        )
        parser.add_argument(
            "--prefetch",
            type=positive_int,
            default=DEFAULT_PREFETCH,
            help="messages the broker may deliver before they are acked (default: %(default)r)",
        )
        parser.add_argument(
            "--max-deliveries",
            type=non_negative_int,
            default=DEFAULT_MAX_DELIVERIES,
            help="park a message in InboxFailure after this many failed deliveries; "
            "0 never parks (default: %(default)r)",
        )
        parser.add_argument(
            "--retry-delay",
            type=non_negative_seconds,
            default=DEFAULT_RETRY_DELAY,
            help="seconds before a failed message is first requeued, doubling after each "
            "further failure, shortened at random by up to half; 0 requeues at once "
            "(default: %(default)r)",
        )
        parser.add_argument(
            "--retry-max-delay",
            type=positive_seconds,
            default=DEFAULT_RETRY_MAX_DELAY,
            help="the longest delay before a failed message is requeued (default: %(default)r)",
        )
        parser.add_argument(
            "--idle-timeout",
            type=positive_seconds,
            default=None,
            help="exit once no message has come for this many seconds; while the broker is "
            "unreachable for this many seconds in all since the last message, exit 1 "
            "(default: run until stopped, riding out broker outages)",
        )
        add_database_option(parser, "inbox (and the handler's writes)")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["retry_delay"] > options["retry_max_delay"]:
            raise CommandError(
                f"--retry-delay {options['retry_delay']:g} is longer than "
                f"--retry-max-delay {options['retry_max_delay']:g}"
            )
        handler, consumer, using, event_types = _resolve_handler(
            options["handler"], options["consumer"], options["database"]
        )
        require_tables(using, InboxMessage, InboxFailure)
        try:
            inbox_consumer = InboxConsumer(
                options["queue"],
                handler,
                consumer,
                using=using,
                prefetch=options["prefetch"],
                max_deliveries=options["max_deliveries"] or None,
                retry_delay=options["retry_delay"],
                retry_max_delay=options["retry_max_delay"],
                event_types=event_types,
            )
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc
        stop = threading.Event()
        stop_on_signals(stop, logger, "the message in hand")
        try:
            stats = inbox_consumer.run(stop, idle_timeout=options["idle_timeout"])
        except BrokerUnreachable as exc:  # what it did before giving up, then why
            self.stdout.write(inbox_consumer.stats.summary())
            raise CommandError(str(exc)) from exc
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(stats.summary())


def _resolve_handler(
    path: str, consumer: str | None, using: str
) -> tuple[Any, str, str, frozenset[str] | None]:
    """The callable to run, the inbox consumer name, the database alias and the event
    types it handles (None: all).

    A handler decorated with ``@inbox_handler`` is unwrapped (the consumer runs
    the inbox itself) and lends its consumer name, database and event types.
    """
    try:
        handler = import_string(path)
    except ImportError as exc:
        raise CommandError(f"cannot import handler {path!r}: {exc}") from exc
    if not callable(handler):
        raise CommandError(f"handler {path!r} is a {type(handler).__name__}, not a callable")
    decorated = getattr(handler, "inbox_consumer", None)
    if decorated is not None:
        if consumer is not None and consumer != decorated:
            raise CommandError(
                f"handler {path!r} is decorated with @inbox_handler({decorated!r}); "
                f"--consumer {consumer!r} disagrees (drop --consumer or make them match)"
            )
        decorated_using = handler.inbox_using
        if using not in (DEFAULT_DB_ALIAS, decorated_using):
            raise CommandError(
                f"handler {path!r} is decorated with @inbox_handler(using={decorated_using!r}); "
                f"--database {using!r} disagrees (drop --database or make them match)"
            )
        return handler.__wrapped__, decorated, decorated_using, handler.inbox_event_types
    if consumer is None:
        raise CommandError(
            f"--consumer is required: handler {path!r} is not decorated with @inbox_handler"
        )
    if not 0 < len(consumer) <= 255:
        raise CommandError(f"--consumer must be 1-255 characters; got {consumer!r}")
    return handler, consumer, using, None
