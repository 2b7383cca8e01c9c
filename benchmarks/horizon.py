"""The claim under a held xmin horizon (issue 44): another session keeps a snapshot open
(a report's REPEATABLE READ transaction) while the relay's claims drain a backlog.

Vacuum cannot remove a row version that snapshot may still see, and an index entry of a
finished row cannot be marked dead by the scans that pass it (it is not dead to every
snapshot), so each claim of the due index walks past every row finished since the
snapshot was taken. :func:`claim_under_held_horizon` drains ``rows`` events with claims
of ``batch_size`` and marks each batch PUBLISHED as the relay does, once without and
once with a snapshot held throughout, and compares the p99 of the last tenth of the
claims with the first tenth's in each."""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence

import psycopg
from django.db import connection

from django_outbox import db
from django_outbox.relay.batch import CLAIM_WINDOW_SECONDS

from .scenarios import TABLE, backlog, destination, reset_outbox


def _p99_ms(samples: Sequence[float]) -> float:
    return statistics.quantiles(samples, n=100, method="inclusive")[98] * 1000


def _drain(rows: int, batch_size: int, windows: list[float] | None = None) -> list[float]:
    """Stage ``rows`` events, then claim and mark them published batch by batch: each
    claim's seconds. With ``windows``, the claims read a partitioned outbox's window of
    ids, read again every ``CLAIM_WINDOW_SECONDS`` as a relay does (each read's seconds
    go to ``windows``)."""
    backlog(rows, destination("horizon"))
    with connection.cursor() as cursor:
        cursor.execute(f'VACUUM ANALYZE "{TABLE}"')
    latencies: list[float] = []
    window, window_until = None, 0.0
    while True:
        if windows is not None and time.monotonic() >= window_until:
            started = time.perf_counter()
            window = db.claim_window("default")
            windows.append(time.perf_counter() - started)
            window_until = time.monotonic() + CLAIM_WINDOW_SECONDS
        token = uuid.uuid4()
        started = time.perf_counter()
        claimed = db.claim(
            "default",
            limit=batch_size,
            lease_seconds=60,
            worker="bench",
            token=token,
            window=window,
        )
        latencies.append(time.perf_counter() - started)
        if not claimed:
            return latencies[:-1]
        db.mark_published("default", [message.id for message in claimed], token)


def _held_snapshot() -> psycopg.Connection:
    """A session of the benchmark's database in REPEATABLE READ with its snapshot taken."""
    params = connection.get_connection_params()
    holder = psycopg.connect(**{k: v for k, v in params.items() if k != "cursor_factory"})
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute(f'SELECT count(*) FROM "{TABLE}"').fetchone()
    return holder


def _growth(latencies: list[float]) -> tuple[float, float]:
    tenth = max(len(latencies) // 10, 1)
    return _p99_ms(latencies[:tenth]), _p99_ms(latencies[-tenth:])


def claim_under_held_horizon(rows: int, batch_size: int) -> dict[str, float]:
    """The drain's claim p99, last tenth over first, with and without a held snapshot."""
    reset_outbox()
    free_start, free_end = _growth(_drain(rows, batch_size))
    reset_outbox()
    holder = _held_snapshot()
    try:
        held_start, held_end = _growth(_drain(rows, batch_size))
    finally:
        holder.close()
    reset_outbox()
    return {
        "horizon_rows": rows,
        "claim_p99_ms_start": held_start,
        "claim_p99_ms_end": held_end,
        "claim_under_held_horizon": held_end / held_start,
        "claim_without_held_horizon": free_end / free_start,
    }


def held_on_partitions(rows: int, batch_size: int) -> dict[str, float]:
    """:func:`claim_under_held_horizon`'s held drain on an outbox already partitioned
    (ranges made ahead to hold the backlog), the claims in a relay's window of ids: a
    range whose rows are all finished leaves the window, and its index entries, which
    the held snapshot keeps, are no longer read."""
    reset_outbox()
    windows: list[float] = []
    holder = _held_snapshot()
    try:
        start, end = _growth(_drain(rows, batch_size, windows))
    finally:
        holder.close()
    reset_outbox()
    return {
        "partitioned_claim_p99_ms_start": start,
        "partitioned_claim_p99_ms_end": end,
        "partitioned_claim_under_held_horizon": end / start,
        "partitioned_window_read_ms_max": max(windows) * 1000,
    }
