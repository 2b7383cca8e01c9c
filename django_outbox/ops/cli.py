"""The command-line side of the outbox commands, kept out of the commands so they
stay thin: argparse types, the options of each command, stopping on signals, and
turning ``run_outbox_consumer``'s options into an :class:`InboxConsumer`."""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from django.core.management.base import CommandError, OutputWrapper, SystemCheckError
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections, models
from django.utils.module_loading import import_string

from .. import db
from ..conf import outbox_settings
from ..consumer.loop import (
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_PREFETCH,
    DEFAULT_RETRY_DELAY,
    DEFAULT_RETRY_MAX_DELAY,
    InboxConsumer,
)
from ..exceptions import OutboxConfigurationError, OutboxError
from ..models import InboxFailure, InboxMessage, OutboxMessage, WorkerHeartbeat
from ..relay.loop import BatchStats, Relay
from ..state.status import due_count
from ..transports.confirms import CONFIRM_TIMEOUT
from .health import Health, check_health
from .reporting import CommandResult, DrainProgress, run_result
from .text import one_line

if TYPE_CHECKING:
    from .metrics import ConsumerMetrics, Exporter, RelayMetrics

#: ``outbox_health``'s exit codes: healthy, unhealthy, could not check (see docs/commands.md).
HEALTHY, UNHEALTHY, HEALTH_UNKNOWN = 0, 1, 2
#: How to install what ``--metrics-port`` needs.
METRICS_EXTRA = "pip install 'django-transactional-outbox[prometheus]'"
T = TypeVar("T")
#: The logger of the relay, whose stopping on a signal ``run_outbox_relay`` logs.
RELAY_LOGGER = logging.getLogger("django_outbox.relay")


def _number(value: str, parse: type[int] | type[float], minimum: float, what: str) -> float:
    try:
        number = parse(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}; got {value!r}") from None
    if not number >= minimum or number != number:  # NaN fails both
        raise argparse.ArgumentTypeError(f"must be {what}; got {value}")
    return number


def positive_int(value: str) -> int:
    """An argparse type: an integer of 1 or more."""
    return int(_number(value, int, 1, "a positive integer"))


def non_negative_int(value: str) -> int:
    """An argparse type: an integer of 0 or more."""
    return int(_number(value, int, 0, "an integer of 0 or more"))


def positive_seconds(value: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    seconds = _number(value, float, 0, "a positive number of seconds")
    if seconds == 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds; got {value}")
    return seconds


def non_negative_seconds(value: str) -> float:
    """An argparse type: a finite number of seconds, 0 or more."""
    seconds = _number(value, float, 0, "a number of seconds of 0 or more")
    if seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds; got {value}")
    return seconds


def port_number(value: str) -> int:
    """An argparse type: a TCP port, 1-65535."""
    port = int(_number(value, int, 1, "a port number (1-65535)"))
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1-65535); got {value}")
    return port


def database_alias(value: str) -> str:
    """An argparse type: a database alias of ``DATABASES``."""
    if value not in connections.settings:
        known = ", ".join(connections.settings)
        raise argparse.ArgumentTypeError(f"unknown database alias {value!r} (known: {known})")
    return value


def event_id(value: str) -> uuid.UUID:
    """An argparse type: an event id (a UUID)."""
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an event id (UUID)") from None


def row_id(value: str) -> int | uuid.UUID:
    """An argparse type: a row's primary key (an integer) or its event id (a UUID)."""
    if value.isdigit():
        return int(value)
    try:
        return uuid.UUID(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a row id (integer) nor an event id (UUID)"
        ) from None


PARTITION_RANGE = re.compile(r"\s*(\d+)(?:-(\d+))?\s*")


def partition_numbers(value: str) -> tuple[int, ...]:
    """An argparse type: partition numbers such as ``0-3,8`` (ranges inclusive)."""
    numbers: list[int] = []
    for part in value.split(","):
        match = PARTITION_RANGE.fullmatch(part)
        low, high = (int(match[1]), int(match[2] or match[1])) if match else (1, 0)
        if high < low:
            raise argparse.ArgumentTypeError(
                f"must be partition numbers such as 0-3,8; got {value!r}"
            )
        numbers.extend(range(low, high + 1))
    return tuple(numbers)


def key_position(value: str) -> tuple[str, int]:
    """An argparse type: ``KEY=LAST``, an ordering key (it may hold ``=``) and a
    sequence of 0 or more."""
    key, sep, last = value.rpartition("=")
    if not (sep and key):
        raise argparse.ArgumentTypeError(f"must be KEY=LAST (a sequence); got {value!r}")
    return key, non_negative_int(last)


def add_database_option(parser: argparse.ArgumentParser, what: str = "outbox") -> None:
    """``--database ALIAS``."""
    parser.add_argument(
        "--database",
        type=database_alias,
        default=DEFAULT_DB_ALIAS,
        help=f"database alias whose {what} to use (default: %(default)r)",
    )


def add_relay_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``run_outbox_relay``."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="relay one batch and exit")
    mode.add_argument(
        "--drain",
        action="store_true",
        help="relay until nothing is due, then exit (a progress line on a terminal)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="rows claimed per batch (default: OUTBOX['BATCH_SIZE'])",
    )
    add_database_option(parser)
    add_metrics_options(parser, "relay")


def add_health_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``outbox_health``."""
    add_database_option(parser)
    parser.add_argument(
        "--max-due-age",
        type=non_negative_seconds,
        default=None,
        metavar="SECONDS",
        help='how long the oldest due row may wait (default: OUTBOX["HEALTH_MAX_DUE_AGE"])',
    )
    parser.add_argument(
        "--no-relay-required",
        action="store_true",
        help="do not require a live relay (relays that run as --drain from cron do not beat)",
    )
    parser.add_argument("--json", action="store_true", help="print the outcome as JSON")


def add_metrics_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--metrics-port PORT`` and ``--metrics-address ADDRESS``."""
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help=f"serve the {what}'s Prometheus metrics at http://ADDRESS:PORT/metrics; needs "
        f"the [prometheus] extra (default: no metrics)",
    )
    parser.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="the address --metrics-port listens on; 0.0.0.0 for every interface, so that "
        "a Prometheus on another host can scrape it (default: %(default)r)",
    )


def add_consumer_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``run_outbox_consumer``."""
    _add_consumer_source(parser)
    option = parser.add_argument
    option(
        "--partitions",
        type=partition_numbers,
        default=None,
        metavar="N[-M],...",
        help="of a route with partitions, the partition queues to take, e.g. 0-3,8 "
        "(default: all; each queue has one active consumer at a time, others stand by)",
    )
    option(
        "--handler",
        required=True,
        help="dotted path of a callable taking a django_outbox.ReceivedEvent",
    )
    option(
        "--consumer",
        help="the inbox name of this consumer: each consumer handles an event once "
        "(default: the name given to @inbox_handler, if the handler has one)",
    )
    option(
        "--prefetch",
        type=positive_int,
        default=DEFAULT_PREFETCH,
        help="messages the broker may deliver before they are acked (default: %(default)r)",
    )
    option(
        "--verify-signatures",
        action="store_true",
        default=None,
        help="park every message not signed by one of OUTBOX['SIGNING_KEYS'] (default: "
        "OUTBOX['VERIFY_SIGNATURES'])",
    )
    option(
        "--max-deliveries",
        type=non_negative_int,
        default=DEFAULT_MAX_DELIVERIES,
        help="park a message in InboxFailure after this many failed deliveries; "
        "0 never parks (default: %(default)r)",
    )
    _add_consumer_timing(parser)
    add_database_option(parser, "inbox (and the handler's writes)")
    add_metrics_options(parser, "consumer")


def _add_consumer_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue",
        required=True,
        help="the queue to consume; on Kafka, the topic; on NATS, a stream or a subject of one",
    )
    parser.add_argument(
        "--broker",
        metavar="ALIAS",
        help="the alias of OUTBOX['BROKERS'] to consume from (default: the broker of the "
        "queue's route; on Kafka, --consumer is the group id)",
    )


def _add_consumer_timing(parser: argparse.ArgumentParser) -> None:
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


def add_replay_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``outbox_replay_parked``."""
    parser.add_argument(
        "--dry-run", action="store_true", help="list what would be replayed; change nothing"
    )
    parser.add_argument("--consumer", help="only messages parked by this inbox consumer")
    parser.add_argument("--queue", help="only messages parked from this queue")
    parser.add_argument(
        "--event-id",
        dest="event_ids",
        nargs="+",
        type=event_id,
        default=[],
        metavar="EVENT_ID",
        help="only these events; each must be parked (matching the other filters)",
    )
    parser.add_argument(
        "--confirm-timeout",
        type=positive_seconds,
        default=CONFIRM_TIMEOUT,
        metavar="SECONDS",
        help="give up when the broker has not confirmed a message within this long "
        "(default: %(default)r)",
    )
    add_database_option(parser, "inbox failures")


def consumer_from_options(
    options: dict[str, Any], stop: threading.Event, metrics: ConsumerMetrics | None = None
) -> InboxConsumer:
    """The consumer ``run_outbox_consumer`` runs (its handler timed and its counts
    exported by ``metrics``, if given); :class:`CommandError` for options that disagree
    or a broker URL it cannot use. Its tables are not checked here."""
    if options["retry_delay"] > options["retry_max_delay"]:
        raise CommandError(
            f"--retry-delay {options['retry_delay']:g} is longer than "
            f"--retry-max-delay {options['retry_max_delay']:g}"
        )
    handler, consumer, using, event_types = resolve_handler(
        options["handler"], options["consumer"], options["database"]
    )
    require_tables(using, InboxMessage, InboxFailure)
    if metrics is not None:
        handler = metrics.timed(handler, consumer)
    try:
        built = InboxConsumer(
            options["queue"],
            handler,
            consumer,
            using=using,
            prefetch=options["prefetch"],
            max_deliveries=options["max_deliveries"] or None,
            retry_delay=options["retry_delay"],
            retry_max_delay=options["retry_max_delay"],
            event_types=event_types,
            stop=stop,
            partitions=options["partitions"],
            broker=options["broker"],
            verify_signatures=options["verify_signatures"],
        )
    except OutboxError as exc:
        raise CommandError(str(exc)) from exc
    if metrics is not None:
        metrics.watch(built)
    return built


def relay_metrics(options: dict[str, Any]) -> RelayMetrics | None:
    """The relay's metrics when ``--metrics-port`` is given (not serving yet)."""
    if options["metrics_port"] is None:
        return None
    if options["once"]:
        raise CommandError("--metrics-port needs a relay that keeps running; drop --once")
    return _metrics_module().RelayMetrics(options["database"])


def consumer_metrics(options: dict[str, Any]) -> ConsumerMetrics | None:
    """The consumer's metrics when ``--metrics-port`` is given (not serving yet)."""
    if options["metrics_port"] is None:
        return None
    return _metrics_module().ConsumerMetrics()


def _metrics_module() -> ModuleType:
    """:mod:`django_outbox.ops.metrics`; a one-line :class:`CommandError` naming the extra
    to install when ``prometheus_client`` is missing."""
    try:
        from . import metrics
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "prometheus_client":
            raise
        raise CommandError(
            f"--metrics-port needs prometheus_client, which is not installed: {METRICS_EXTRA}"
        ) from None
    return metrics


@contextlib.contextmanager
def serving(exporter: Exporter | None, options: dict[str, Any]) -> Iterator[None]:
    """Serve ``exporter`` (if any) at ``--metrics-address``:``--metrics-port`` while
    inside; a one-line :class:`CommandError` when the port cannot be bound."""
    if exporter is None:
        yield
        return
    port, address = options["metrics_port"], options["metrics_address"]
    try:
        exporter.serve(port, address)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise CommandError(
            f"--metrics-port {port}: cannot listen on {address}:{port}: {reason}"
        ) from None
    try:
        yield
    finally:
        exporter.close()


def each(*callbacks: Callable[[T], object] | None) -> Callable[[T], None] | None:
    """One callback that calls each of ``callbacks`` that is not None; None if none is."""
    given = [callback for callback in callbacks if callback is not None]
    if not given:
        return None

    def call(value: T) -> None:
        for callback in given:
            callback(value)

    return call


def resolve_handler(
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
        return _decorated_handler(handler, path, consumer, using)
    if consumer is None:
        raise CommandError(
            f"--consumer is required: handler {path!r} is not decorated with @inbox_handler"
        )
    if not 0 < len(consumer) <= 255:
        raise CommandError(f"--consumer must be 1-255 characters; got {consumer!r}")
    return handler, consumer, using, None


def _decorated_handler(
    handler: Any, path: str, consumer: str | None, using: str
) -> tuple[Any, str, str, frozenset[str] | None]:
    decorated = handler.inbox_consumer
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


def require_tables(using: str, *tables: type[models.Model]) -> None:
    """A one-line CommandError when database ``using`` lacks the table of a model of
    ``tables`` (``migrate`` not run), before a command's first query fails on it."""
    try:
        db.require_tables(using, *tables)
    except OutboxConfigurationError as exc:
        raise CommandError(str(exc)) from None


def checked_health(using: str, run_checks: Callable[[], None], options: dict[str, Any]) -> Health:
    """``outbox_health``'s outcome for ``options``; a :class:`CommandError` exiting
    :data:`HEALTH_UNKNOWN` when it cannot be had: ``run_checks`` (the system checks)
    raises :class:`SystemCheckError`, a table is missing, the database cannot be read."""
    try:
        run_checks()
        require_tables(using, OutboxMessage, WorkerHeartbeat)
        return check_health(
            using,
            max_due_age=options["max_due_age"],
            require_relay=not options["no_relay_required"],
        )
    except SystemCheckError:
        problem = "the system checks failed (run manage.py check)"
    except CommandError as exc:
        problem = str(exc)
    except DatabaseError as exc:
        error = one_line(outbox_settings.redact(f"{type(exc).__name__}: {exc}"))
        problem = f"database {using!r} cannot be read ({error})"
    raise CommandError(f"cannot check the outbox: {problem}", returncode=HEALTH_UNKNOWN)


@contextlib.contextmanager
def library_errors() -> Iterator[None]:
    """An :class:`OutboxError` raised inside becomes a one-line :class:`CommandError`."""
    try:
        yield
    except OutboxError as exc:
        raise CommandError(str(exc)) from exc


def finish(out: OutputWrapper, result: CommandResult) -> None:
    """Print a result's lines; exit 1 with its error, if any."""
    for line in result.lines:
        out.write(line)
    if result.error:
        raise CommandError(result.error)


def relay_until_stopped(
    relay: Relay, out: OutputWrapper, options: dict[str, Any], metrics: RelayMetrics | None
) -> CommandResult:
    """``run_outbox_relay`` without ``--once``: relay until SIGTERM or SIGINT (with
    ``--drain``, until nothing is due), serving ``metrics``; a drain on a terminal shows a
    progress line on ``out``. What the command prints and exits with at the end."""
    using, drain = options["database"], options["drain"]
    stop = threading.Event()
    stop_on_signals(stop, RELAY_LOGGER, "the batch in hand")
    progress = DrainProgress(due_count(using)) if drain and out.isatty() else None
    started = time.monotonic()
    show = None if progress is None else functools.partial(_show_progress, out, progress)
    with serving(metrics, options):
        on_batch = each(show, None if metrics is None else metrics.batch)
        totals = relay.run(stop, drain=drain, on_batch=on_batch)
    if progress is not None and progress.done:
        out.write("")  # end the progress line
    return run_result(totals, time.monotonic() - started, using, drain=drain)


def _show_progress(out: OutputWrapper, progress: DrainProgress, stats: BatchStats) -> None:
    out.write(progress.add(stats), ending="")
    out.flush()


def stop_on_signals(stop: threading.Event, logger: logging.Logger, after: str) -> None:
    """SIGTERM or SIGINT sets ``stop`` (the loop finishes ``after`` first); a
    second one exits at once, with status 1."""

    def handler(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            logger.warning("%s again: exiting at once", name, extra={"action": "outbox.stopping"})
            _exit_now(1)
        logger.info("%s: stopping after %s", name, after, extra={"action": "outbox.stopping"})
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _exit_now(status: int) -> None:
    """Exit without unwinding: no ``finally`` and no atexit hook runs, because those
    close broker channels and join the database threads, and each of those waits for
    a peer that may have stopped answering (the very reason for a second signal).
    What was in hand is left to its lease (relay) or to the broker (consumer)."""
    logging.shutdown()  # flush the log handlers
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)
