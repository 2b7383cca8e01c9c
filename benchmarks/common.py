"""What the runner and its workers share: the message every scenario sends, and small probes."""

from __future__ import annotations

import datetime as dt
import json
import os
import statistics
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import kombu

#: The default route's exchange (OUTBOX["DEFAULT_EXCHANGE"] is left at its default).
EXCHANGE = "outbox"
#: One event's payload; every scenario, raw or relay, sends this size.
PAYLOAD: dict[str, Any] = {
    "order_id": 123456,
    "customer": "customer-000042",
    "total": "1234.50",
    "currency": "EUR",
    "lines": [{"sku": f"SKU-{n:05d}", "quantity": n + 1, "price": "99.90"} for n in range(3)],
}
BODY = json.dumps(PAYLOAD).encode()


def bound_queue(name: str) -> kombu.Queue:
    """The durable queue ``name``, bound by its name to the relay's default exchange."""
    exchange = kombu.Exchange(EXCHANGE, "topic", durable=True)
    return kombu.Queue(name, exchange, routing_key=name, durable=True)


def wire_headers() -> dict[str, Any]:
    """Headers shaped like the relay's (see django_outbox.envelope) for the raw publishers."""
    event_id = str(uuid.uuid4())
    return {
        "correlation_id": event_id,
        "causation_id": None,
        "event_id": event_id,
        "event_type": "bench.order_placed",
        "occurred_at": dt.datetime.now(dt.UTC).isoformat(),
        "ordering_key": None,
    }


def rss_mb() -> float:
    """This process's resident set size, in MiB (Linux)."""
    with open(f"/proc/{os.getpid()}/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


#: What the command line of a broker's processes holds, by the scheme of its URL: the
#: Kafka brokers' JVMs and nats-server (the benchmarks' clusters run on this machine).
BROKER_PROCESSES = {"kafka": "kafka.Kafka", "nats": "nats-server"}


def broker_cpu_seconds(url: str) -> float | None:
    """The CPU time the broker processes of ``url``'s scheme (:data:`BROKER_PROCESSES`)
    have spent so far (:func:`cpu_seconds`); None for another scheme. Every cluster's
    brokers on this machine: two readings around the same stretch of work tell what it
    cost them."""
    marker = BROKER_PROCESSES.get(url.partition("://")[0])
    return None if marker is None else cpu_seconds(marker)


def cpu_seconds(marker: str) -> float:
    """The CPU time (user and system) spent so far by this machine's processes whose
    command line holds ``marker``, read from ``/proc``."""
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if marker.encode() not in cmdline.read():
                    continue
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """The CPU a stretch of work costs this process (every thread: a client library's
    own included) and the brokers of ``url`` (:func:`broker_cpu_seconds`): started when
    made, read by :meth:`per_message`."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.process, self.brokers = time.process_time(), broker_cpu_seconds(url)

    def per_message(self, count: int) -> dict[str, float | None]:
        """Since it was made, in microseconds per message: ``process_cpu_us_per_msg`` and
        ``broker_cpu_us_per_msg`` (None when the brokers' could not be read)."""
        process = (time.process_time() - self.process) / count * 1e6
        brokers = broker_cpu_seconds(self.url)
        return {
            "process_cpu_us_per_msg": process,
            "broker_cpu_us_per_msg": (
                None if brokers is None or self.brokers is None
                else (brokers - self.brokers) / count * 1e6
            ),
        }  # fmt: skip


def cpu_ratio(ceiling: Mapping[str, Any], drain: Mapping[str, Any]) -> float | None:
    """What the relay's rate over the ceiling's would be if CPU alone bounded both, as it
    does on a machine whose cores the brokers, PostgreSQL and the publisher share: the CPU
    a message costs the ceiling (its process and the brokers) over the CPU an event costs
    the relay (its process, PostgreSQL's server and the brokers). None when a part of it
    was not read (a server of another user's, a broker elsewhere)."""
    parts = (
        ceiling["process_cpu_us_per_msg"],
        ceiling["broker_cpu_us_per_msg"],
        drain["cpu_us_per_event"],
        drain["drain_pg_cpu_us_per_event"],
        drain["broker_cpu_us_per_event"],
    )
    if any(part is None for part in parts):
        return None
    raw_process, raw_brokers, relay, server, relay_brokers = parts
    return float((raw_process + raw_brokers) / (relay + server + relay_brokers))


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values read (None: not read), or None if none was."""
    read = [value for value in values if value is not None]
    return statistics.median(read) if read else None


def cpu_figures(
    name: str, rounds: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]
) -> dict[str, Any]:
    """The CPU figures of (ceiling, relay drain) rounds on broker ``name`` (``kafka``,
    ``nats``): each side's CPU per message or event, by whom, and :func:`cpu_ratio`."""
    ratios = [cpu_ratio(top, drain) for top, drain in rounds]
    return {
        f"raw_{name}_process_cpu_us_per_msg": median(
            top["process_cpu_us_per_msg"] for top, _ in rounds
        ),
        f"raw_{name}_broker_cpu_us_per_msg": median(
            top["broker_cpu_us_per_msg"] for top, _ in rounds
        ),
        f"relay_{name}_pg_cpu_us_per_event": median(
            d["drain_pg_cpu_us_per_event"] for _, d in rounds
        ),
        f"relay_{name}_broker_cpu_us_per_event": median(
            d["broker_cpu_us_per_event"] for _, d in rounds
        ),
        f"{name}_cpu_ratio": median(ratios),
        f"{name}_cpu_ratio_rounds": ratios,
    }


def emit(result: dict[str, Any]) -> None:
    """A worker's result: one JSON line on stdout."""
    print(json.dumps(result), flush=True)
