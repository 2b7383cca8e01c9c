"""What the runner and its workers share: the message every scenario sends, and small probes."""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
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


def emit(result: dict[str, Any]) -> None:
    """A worker's result: one JSON line on stdout."""
    print(json.dumps(result), flush=True)
