"""The one owner of an outbox row's state: every write of ``status`` and of the
lease columns happens here (the vendor SQL it runs lives in :mod:`django_outbox.db`).

The state machine (DESIGN section 3) and the function behind each transition::

    PENDING --claim--> PROCESSING --confirm--> PUBLISHED --retention--> (deleted)
                           |  lease expired: claimable again (reclaim)
                           +--error--> FAILED --available_at reached, claim--> PROCESSING
                                         +--attempts exhausted / poison--> ABANDONED
    ABANDONED --retention--> (deleted)
    FAILED, ABANDONED --requeue (admin, command)--> PENDING (attempts reset)
    PENDING, FAILED, PROCESSING with an expired lease --abandon (admin)--> ABANDONED

Each transition and the function that makes it:

- PENDING, FAILED (due) -> PROCESSING: :func:`claim`.
- PROCESSING with an expired lease -> PROCESSING under a new lease (reclaim):
  :func:`claim`, the same statement.
- PROCESSING -> PUBLISHED: :func:`record` (``published``).
- PROCESSING -> FAILED or ABANDONED: :func:`record` (``failed``, :class:`FailedRows`).
- PROCESSING -> PENDING, an ordered row after its key's first failure in a batch:
  :func:`record` (``held``).
- FAILED, ABANDONED -> PENDING: :func:`requeue`, :func:`requeue_selected`.
- PENDING, FAILED, PROCESSING with an expired lease -> ABANDONED: :func:`abandon`.
- PUBLISHED, ABANDONED -> deleted: :func:`delete_in_batches` (called by ``retention``).
- Due rows -> due since long ago, for :func:`django_outbox.testing.drain` inside a
  transaction: :func:`backdate_due`.

Every write a relay makes after its claim is filtered by the claim's lease
token, so a relay whose lease was taken over changes nothing; :func:`record`
returns the rows it lost that way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import functools
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from django.db import models, transaction
from django.db.models.functions import Now

from . import db
from .envelope import ClaimedMessage
from .exceptions import RequeueRefused
from .expressions import now_plus
from .models import REQUEUEABLE, OutboxMessage, OutboxQuerySet, OutboxStatus


def claim(
    using: str,
    *,
    limit: int,
    lease_seconds: float,
    worker: str,
    token: uuid.UUID,
    max_bytes: int | None = None,
) -> list[ClaimedMessage]:
    """PENDING/FAILED rows that are due -> PROCESSING under ``token`` for ``lease_seconds``.

    Also the **reclaim**: a PROCESSING row whose lease expired (its relay died
    or was too slow) is due again, because a claim sets ``available_at`` to the
    lease's end, so the same statement takes it over with a new token; the old
    relay's late writes then match no row. Up to ``limit`` rows, oldest first,
    bounded by ``max_bytes`` of payload (default ``OUTBOX["MAX_BATCH_BYTES"]``;
    the first row always); rows another claim holds are skipped. Returned in
    id order. See :func:`django_outbox.db.claim` for the vendor paths.
    """
    return db.claim(
        using,
        limit=limit,
        lease_seconds=lease_seconds,
        worker=worker,
        token=token,
        max_bytes=max_bytes,
    )


@dataclasses.dataclass(frozen=True)
class FailedRows:
    """Rows of a batch that failed alike, written with one UPDATE."""

    ids: Sequence[int]
    error: str
    #: ABANDONED instead of FAILED (attempts exhausted, or poison).
    abandon: bool
    #: Seconds until a FAILED row is due again (ignored when abandoned).
    delay: float
    #: False: nothing was sent, so the attempt is not counted.
    counts: bool = True


def record(
    using: str,
    token: uuid.UUID,
    *,
    published: Sequence[int],
    failed: Sequence[FailedRows],
    held: Sequence[int] = (),
) -> set[int]:
    """Record a published batch's outcomes under its lease ``token``.

    PROCESSING -> PUBLISHED for the ``published`` ids (the token stays, as a
    record of which claim published the row); PROCESSING -> FAILED (due again
    after ``delay``) or ABANDONED for each group of ``failed``; PROCESSING ->
    PENDING for the ``held`` ids (ordered rows after their key's first failure in
    the batch: due now, no attempt spent, the lease cleared; the failed row before
    them keeps them back). One UPDATE per group; several share one transaction,
    so no reader sees a key half recorded. Returns the ids no longer under
    ``token`` (another relay took them over): they are left untouched.
    """
    rows = OutboxMessage.objects.using(using)
    several = bool(published) + len(failed) + bool(held) > 1
    lost: set[int] = set()
    writes: list[tuple[Sequence[int], Callable[[OutboxQuerySet], int]]] = [
        (published, _mark_published),
        (held, _mark_held),
    ]
    writes += [(group.ids, functools.partial(_mark_failed, group=group)) for group in failed]
    with transaction.atomic(using=using) if several else contextlib.nullcontext():
        for ids, mark in writes:
            if not ids:
                continue
            leased = rows.filter(id__in=ids).leased(token)
            if mark(leased) != len(ids):
                lost |= _not_held(ids, leased)
    return lost


def _mark_published(rows: OutboxQuerySet) -> int:
    return rows.update(
        status=OutboxStatus.PUBLISHED, published_at=Now(), locked_until=None, last_error=""
    )


def _mark_held(rows: OutboxQuerySet) -> int:
    return rows.update(status=OutboxStatus.PENDING, available_at=Now(), locked_until=None)


def _mark_failed(rows: OutboxQuerySet, group: FailedRows) -> int:
    attempts = models.F("attempts") + 1 if group.counts else models.F("attempts")
    failed = {"attempts": attempts, "last_error": group.error, "locked_until": None}
    if group.abandon:
        return rows.update(status=OutboxStatus.ABANDONED, abandoned_at=Now(), **failed)
    return rows.update(status=OutboxStatus.FAILED, available_at=now_plus(group.delay), **failed)


def _not_held(ids: Sequence[int], held: OutboxQuerySet) -> set[int]:
    """The ``ids`` whose rows ``held`` (still under the batch's lease) no longer has."""
    return set(ids) - set(held.values_list("id", flat=True))


#: What :func:`backdate_due` sets ``available_at`` to: before any transaction began.
_LONG_AGO = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def backdate_due(using: str, now: dt.datetime) -> int:
    """Rows due at ``now`` (a wall-clock time) -> due since long ago, state unchanged.

    For :func:`django_outbox.testing.drain` inside a transaction, where the database
    clock stands still at the transaction's start, before the rows were staged; any
    time before it will do, since the claim leases them at once. Returns how many."""
    return OutboxMessage.objects.using(using).due(now).update(available_at=_LONG_AGO)


def _selection(using: str, rows: OutboxQuerySet | None) -> OutboxQuerySet:
    return (OutboxMessage.objects.all() if rows is None else rows).using(using)


def requeue(using: str, rows: OutboxQuerySet | None = None) -> int:
    """FAILED/ABANDONED -> PENDING, due now, attempts reset, lease cleared.

    ``rows`` narrows the selection (default: every row); selected rows in other
    states are left alone. Returns how many rows changed."""
    return (
        _selection(using, rows)
        .requeueable()
        .update(
            status=OutboxStatus.PENDING,
            attempts=0,
            available_at=Now(),
            last_error="",
            abandoned_at=None,
            locked_until=None,
            locked_by="",
            lease_token=None,
        )
    )


def abandon(using: str, rows: OutboxQuerySet | None = None) -> int:
    """PENDING/FAILED (and PROCESSING with an expired lease) -> ABANDONED.

    Selected rows in other states are left alone; ``last_error`` is kept (it
    usually says why). A PROCESSING row under a live lease is refused: its relay
    may be publishing it this instant. The lease columns are cleared, so a relay
    whose expired lease is abandoned here finds its token gone and its late
    write dropped. One UPDATE whose WHERE PostgreSQL re-checks after waiting for
    a row lock, so a row claimed meanwhile is refused rather than abandoned
    under its relay. Returns how many rows changed."""
    return (
        _selection(using, rows)
        .abandonable()
        .update(
            status=OutboxStatus.ABANDONED,
            abandoned_at=Now(),
            locked_until=None,
            locked_by="",
            lease_token=None,
        )
    )


def requeue_selected(
    using: str,
    *,
    ids: Sequence[int | uuid.UUID] = (),
    status: str | None = None,
    event_type: str | None = None,
) -> int:
    """Requeue the rows that match every filter given (``outbox_requeue``'s policy).

    ``ids`` are row ids or event ids. Naming a row that does not exist or that
    is not FAILED/ABANDONED refuses the whole requeue
    (:class:`~django_outbox.exceptions.RequeueRefused`, nothing changed);
    without ``ids`` rows in other states are simply left alone."""
    rows = OutboxMessage.objects.using(using)
    if ids:
        ints = [i for i in ids if isinstance(i, int)]
        uuids = [i for i in ids if isinstance(i, uuid.UUID)]
        rows = rows.filter(models.Q(id__in=ints) | models.Q(event_id__in=uuids))
    if status:
        rows = rows.filter(status=status)
    if event_type:
        rows = rows.filter(event_type=event_type)
    with transaction.atomic(using=using):
        db.write_first(using)  # it reads, then writes
        if ids:
            _refuse_unrequeueable(rows, ids)
        return requeue(using, rows)


def _refuse_unrequeueable(rows: OutboxQuerySet, ids: Sequence[int | uuid.UUID]) -> None:
    found = {
        key: (pk, status)
        for pk, event_id, status in rows.values_list("id", "event_id", "status")
        for key in (pk, event_id)
    }
    missing = [str(i) for i in ids if i not in found]
    if missing:
        raise RequeueRefused(f"no outbox row matches {', '.join(missing)}; nothing requeued")
    requeueable = {status.value for status in REQUEUEABLE}
    refused = sorted({found[i] for i in ids if found[i][1] not in requeueable})
    if refused:
        listed = ", ".join(f"{pk} ({status})" for pk, status in refused)
        raise RequeueRefused(
            f"refused: only failed or abandoned rows can be requeued; not {listed}; "
            "nothing requeued"
        )


def delete_in_batches(rows: models.QuerySet[Any], batch_size: int) -> int:
    """Delete ``rows`` (outbox rows in a final state, or inbox rows) ``batch_size``
    at a time, each batch its own short statement; returns how many went.

    The selection is applied again to each batch's ids, so a row that left the
    selection since it was read (an abandoned row requeued) stays."""
    total = 0
    while ids := list(rows.values_list("id", flat=True)[:batch_size]):
        deleted, _ = rows.filter(id__in=ids).delete()
        total += deleted
    return total
