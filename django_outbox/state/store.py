"""The one owner of an outbox row's state: every write of ``status`` and of the
lease columns happens here (the vendor SQL it runs lives in :mod:`django_outbox.db`).

The state machine (DESIGN section 3) and the function behind each transition::

    PENDING --claim--> PROCESSING --confirm--> PUBLISHED --retention--> (deleted)
                           |  with PUBLISHED_RETENTION 0: --confirm--> (deleted)
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
- PROCESSING -> PUBLISHED: :func:`record` (``published``); -> deleted instead when
  ``PUBLISHED_RETENTION`` is 0 (no PUBLISHED row is kept).
- PROCESSING -> FAILED or ABANDONED: :func:`record` (``failed``, :class:`FailedRows`).
- PROCESSING -> PENDING, an ordered row after its key's first failure in a batch:
  :func:`record` (``held``).
- FAILED, ABANDONED -> PENDING: :func:`requeue`, :func:`requeue_selected`.
- PENDING, FAILED, PROCESSING with an expired lease -> ABANDONED: :func:`abandon`.
- Either of the two on a selection whose rows are counted too, for the admin's
  actions: :func:`change_counted`.
- FAILED, ABANDONED head of an ordered key -> PENDING: :func:`requeue_heads`; -> PENDING
  as a skip marker (``skipped_at`` set): :func:`skip`.
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
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from django.db import models, transaction
from django.db.models.functions import Now

from .. import db
from ..conf import outbox_settings
from ..db.expressions import now_plus
from ..db.postgresql import Window
from ..envelope import ClaimedBatch
from ..exceptions import CancelRefused, EventInFlight, RequeueRefused, SkipRefused
from ..models import (
    KEY_UNFINISHED,
    REQUEUEABLE,
    UNFINISHED,
    OutboxMessage,
    OutboxQuerySet,
    OutboxStatus,
)

logger = logging.getLogger("django_outbox.store")


def claim(
    using: str,
    *,
    limit: int,
    lease_seconds: float,
    worker: str,
    token: uuid.UUID,
    max_bytes: int | None = None,
    ordered: bool = True,
    window: Window | None = None,
) -> ClaimedBatch:
    """PENDING/FAILED rows that are due -> PROCESSING under ``token`` for ``lease_seconds``
    (with ``ordered`` False, the unordered ones only; with a ``window``, those of its
    ids only: :func:`claim_window`).

    Also the **reclaim**: a PROCESSING row whose lease expired (its relay died
    or was too slow) is due again once its ``locked_until`` has passed (a claim
    leaves ``available_at`` as it was), so the same statement takes it over with
    a new token; the old
    relay's late writes then match no row. Up to ``limit`` rows, oldest first,
    bounded by ``max_bytes`` of payload (default ``OUTBOX["MAX_BATCH_BYTES"]``;
    the first row always); rows another claim holds are skipped. Returned in
    id order. See :func:`django_outbox.db.claim` for the vendor paths. With
    ``OUTBOX["SIGNING_KEYS"]``, each message is signed here, once (its ``signature``).
    """
    batch = db.claim(
        using,
        limit=limit,
        lease_seconds=lease_seconds,
        worker=worker,
        token=token,
        max_bytes=max_bytes,
        ordered=ordered,
        window=window,
    )
    keys = outbox_settings.SIGNING_KEYS
    if keys:  # signed once here, whatever the transport and however often it is encoded
        for message in batch:
            message.signature = keys.sign(message.envelope())
    return batch


def claim_window(using: str) -> Window | None:
    """The ids a relay's claims may read: on a partitioned outbox, from the first range
    that may hold a row to claim to the top of the ranges; None (all) elsewhere. A
    relay reads it again every few seconds (``CLAIM_WINDOW_SECONDS`` in
    :mod:`django_outbox.relay.batch`)."""
    return db.claim_window(using)


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
    record of which claim published the row), or deleted at once when
    ``PUBLISHED_RETENTION`` is 0; PROCESSING -> FAILED (due again
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

    def leased(ids: Sequence[int]) -> OutboxQuerySet:
        return rows.filter(db.AnyOf(models.F("id"), ids)).leased(token)

    writes: list[tuple[Sequence[int], Callable[[OutboxQuerySet], int]]] = [(held, _mark_held)]
    writes += [(group.ids, functools.partial(_mark_failed, group=group)) for group in failed]
    with transaction.atomic(using=using) if several else contextlib.nullcontext():
        lost |= _record_published(using, published, token, leased)
        for ids, mark in writes:
            if ids and mark(leased(ids)) != len(ids):
                lost |= _not_held(ids, leased(ids))
        for group in failed:
            failed_rows = rows.filter(id__in=group.ids).leased(token)
            _park_after_failure(using, _heads_by_key(failed_rows), group.abandon)
    return lost


#: Where the waiting events of a key whose head is ABANDONED are parked
#: (``available_at``): out of the claim's reach until the head is requeued or skipped.
PARKED = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)


#: Per ordered key (destination, ordering key): the sequence of its head (or of the
#: row an operator changed) and that row's ``available_at`` before the change: where
#: the events waiting behind a FAILED head were parked (its retry).
_Heads = dict[tuple[str, str], tuple[int, dt.datetime]]


def _heads_by_key(rows: OutboxQuerySet, before: Mapping[int, dt.datetime] | None = None) -> _Heads:
    """The lowest sequence of each ordered key among ``rows``, with that row's
    ``available_at`` (as ``before``, id -> time, had it, when given)."""
    lowest: _Heads = {}
    ordered = rows.filter(sequence__isnull=False)
    for pk, destination, key, sequence, at in ordered.values_list(
        "id", "destination", "ordering_key", "sequence", "available_at"
    ):
        assert sequence is not None  # filtered above
        if (destination, key) not in lowest or sequence < lowest[destination, key][0]:
            lowest[destination, key] = (sequence, (before or {}).get(pk, at))
    return lowest


#: Keys one UPDATE of :func:`_update_followers` names at most.
_KEYS_PER_UPDATE = 500


def _update_followers(
    using: str,
    heads: _Heads,
    available_at: dt.datetime | models.Expression,
    which: Callable[[tuple[str, str], dt.datetime], models.Q],
) -> int:
    """Set ``available_at`` of the PENDING rows waiting behind ``heads`` that match
    ``which(key, the head's time)``."""
    total = 0
    for after in _per_key(heads, "sequence__gt", which):
        rows = OutboxMessage.objects.using(using).filter(
            after, KEY_UNFINISHED, status=OutboxStatus.PENDING
        )
        total += rows.update(available_at=available_at)
    return total


def _due_or_parked(scope: tuple[str, str], at: dt.datetime) -> models.Q:
    """The waiting rows to park: due now, or parked at ``at`` (the head's retry, before
    it was abandoned). A row staged with a later ``available_at`` keeps it."""
    return models.Q(available_at__lte=Now()) | models.Q(available_at=at)


def _park_followers(using: str, heads: _Heads, until: dt.datetime | models.Expression) -> int:
    """Make the events waiting behind the ordered rows ``heads`` (now FAILED or
    ABANDONED) due no sooner than ``until``: the head's retry, or :data:`PARKED`.

    Without it every claim would walk the waiting rows of a failing key, due but
    gated, before it reached other keys' rows: the claim's cost would grow with
    the backlog of one blocked key (docs/ordering.md). Rows staged to the key later
    are due until the next failure (or abandon) of its head parks them; rows staged
    to be due later than now keep their time."""
    return _update_followers(using, heads, until, _due_or_parked)


def _park_after_failure(using: str, heads: _Heads, abandoned: bool) -> int:
    """Park the events waiting behind the ordered rows of one failed group: at
    :data:`PARKED` if abandoned, else at exactly their heads' retry (one UPDATE set it
    for the group, so one time), by which a requeue or skip finds them again."""
    if not heads:
        return 0
    _, retry = next(iter(heads.values()))
    return _park_followers(using, heads, PARKED if abandoned else retry)


def _release_followers(using: str, lowest: _Heads) -> int:
    """Make the events parked behind requeued or skipped heads due now: those parked at
    :data:`PARKED` or at the head's retry (a row staged for later keeps its time), up
    to the key's next ABANDONED row, which keeps the rows after it parked."""
    stops = _next_abandoned(using, lowest)

    def parked(scope: tuple[str, str], at: dt.datetime) -> models.Q:
        rows = models.Q(available_at__in=[PARKED, at], available_at__gt=Now())
        return rows & models.Q(sequence__lt=stops[scope]) if scope in stops else rows

    return _update_followers(using, lowest, Now(), parked)


def _next_abandoned(using: str, heads: _Heads) -> dict[tuple[str, str], int]:
    """The sequence of each key's first ABANDONED row after its head's in ``heads``."""
    rows = OutboxMessage.objects.using(using).abandoned()
    stops: dict[tuple[str, str], int] = {}
    for after in _per_key(heads, "sequence__gt"):
        found = rows.filter(after).values_list("destination", "ordering_key", "sequence")
        for destination, key, sequence in found:
            assert sequence is not None  # the condition names a sequence
            stops[destination, key] = min(stops.get((destination, key), sequence), sequence)
    return stops


def _mark_held(rows: OutboxQuerySet) -> int:
    return rows.update(status=OutboxStatus.PENDING, available_at=Now(), locked_until=None)


def _mark_failed(rows: OutboxQuerySet, group: FailedRows) -> int:
    attempts = models.F("attempts") + 1 if group.counts else models.F("attempts")
    # Never empty: a FAILED row is told by its error in outbox_failed_idx (models.ERRORED).
    error = group.error or "(no error text)"
    failed = {"attempts": attempts, "last_error": error, "locked_until": None}
    if group.abandon:
        return rows.update(status=OutboxStatus.ABANDONED, abandoned_at=Now(), **failed)
    return rows.update(status=OutboxStatus.FAILED, available_at=now_plus(group.delay), **failed)


def _record_published(
    using: str,
    ids: Sequence[int],
    token: uuid.UUID,
    leased: Callable[[Sequence[int]], OutboxQuerySet],
) -> set[int]:
    """PROCESSING -> PUBLISHED for ``ids`` under ``token``, or deleted at once when
    ``PUBLISHED_RETENTION`` is 0; returns the ids no longer under ``token``. Vendor SQL
    (:func:`django_outbox.db.mark_published`, ``delete_published``), as the hot path."""
    if not ids:
        return set()
    if not outbox_settings.PUBLISHED_RETENTION:
        return set(ids) - db.delete_published(using, ids, token)
    if db.mark_published(using, ids, token) == len(ids):
        return set()
    return _not_held(ids, leased(ids))


def _not_held(ids: Sequence[int], held: OutboxQuerySet) -> set[int]:
    """The ``ids`` whose rows ``held`` (still under the batch's lease) no longer has."""
    return set(ids) - set(held.values_list("id", flat=True))


#: What :func:`backdate_due` sets ``available_at`` to: before any transaction began.
_LONG_AGO = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


def backdate_due(using: str, now: dt.datetime) -> int:
    """Rows due at ``now`` (a wall-clock time) -> due since long ago, state unchanged.

    For :func:`django_outbox.testing.drain` inside a transaction, where the database
    clock stands still at the transaction's start, before the rows were staged; any
    time before it will do, since the claim leases them at once. A PROCESSING row due
    at ``now`` had its lease run out: its end (``locked_until``, which the claim reads
    for a lease) is backdated too. Returns how many."""
    due = OutboxMessage.objects.using(using).due(now)
    expired = due.filter(status=OutboxStatus.PROCESSING)
    leases = expired.update(available_at=_LONG_AGO, locked_until=_LONG_AGO)
    return leases + due.exclude(status=OutboxStatus.PROCESSING).update(available_at=_LONG_AGO)


def _dedup_key_held(using: str, selected: OutboxQuerySet) -> list[int]:
    """The ABANDONED rows of ``selected`` a requeue leaves out because their dedup key
    would then name two unfinished events (``outbox_dedup_unfinished_idx``): another
    unfinished event holds it (staged since), or a newer row of the selection has it
    too. Each is logged (WARNING, ``outbox.requeue_dedup_held``)."""
    abandoned = selected.filter(abandoned_at__isnull=False, dedup_key__isnull=False)
    candidates = sorted(abandoned.values_list("id", "destination", "dedup_key"), reverse=True)
    if not candidates:
        return []
    db.lock_dedup_keys(using, ((d, key or "") for _, d, key in candidates))  # if partitioned
    scopes = models.Q(pk__in=[])
    for _, destination, dedup_key in candidates:
        scopes |= models.Q(destination=destination, dedup_key=dedup_key)
    unfinished = OutboxMessage.objects.using(using).filter(UNFINISHED).filter(scopes)
    holders = dict(
        ((d, k), pk) for pk, d, k in unfinished.values_list("id", "destination", "dedup_key")
    )
    held = []
    for pk, destination, dedup_key in candidates:  # newest first: it takes a free key
        holder = holders.setdefault((destination, dedup_key), pk)
        if holder != pk:
            held.append(pk)
            logger.warning(
                "outbox row %s not requeued: its dedup key %r of %r is held by unfinished "
                "row %s (cancel that one first to requeue this one)",
                pk,
                dedup_key,
                destination,
                holder,
                extra={
                    "action": "outbox.requeue_dedup_held",
                    "using": using,
                    "id": pk,
                    "destination": destination,
                    "holder": holder,
                },
            )
    return held


def _selection(using: str, rows: OutboxQuerySet | None) -> OutboxQuerySet:
    return (OutboxMessage.objects.all() if rows is None else rows).using(using)


def mark_in_log(using: str, event_ids: Sequence[str]) -> int:
    """Unfinished rows of ``event_ids`` (a broker's log holds their events: a Kafka
    transactional route's record) -> PUBLISHED, whoever leases them, their lease
    cleared; returns how many changed. Called by the relay at its start."""
    rows = OutboxMessage.objects.using(using).filter(UNFINISHED, event_id__in=event_ids)
    return rows.update(
        status=OutboxStatus.PUBLISHED,
        published_at=Now(),
        locked_until=None,
        locked_by="",
        last_error="",
    )


def requeue(using: str, rows: OutboxQuerySet | None = None) -> int:
    """FAILED/ABANDONED -> PENDING, due now, attempts reset, lease cleared.

    ``rows`` narrows the selection (default: every row); selected rows in other
    states are left alone. The events waiting behind a requeued ordered row are due
    now too (see :func:`_park_followers`). Returns how many rows changed."""
    selected = _selection(using, rows).requeueable()
    with transaction.atomic(using=using):
        selected = selected.exclude(id__in=_dedup_key_held(using, selected))
        ordered = _ordered_ids(selected)
        count = selected.update(
            status=OutboxStatus.PENDING,
            attempts=0,
            available_at=Now(),
            last_error="",
            abandoned_at=None,
            locked_until=None,
            locked_by="",
            lease_token=None,
        )
        lowest = _heads_by_key(_now(using, ordered, OutboxStatus.PENDING), ordered)
        blocked = _blocked_before(using, lowest)
        parked = {k: (lowest[k][0] - 1, lowest[k][1]) for k in blocked}  # the rows too
        _park_followers(using, parked, PARKED)
        _release_followers(using, {k: v for k, v in lowest.items() if k not in blocked})
    return count


def _blocked_before(using: str, lowest: _Heads) -> set[tuple[str, str]]:
    """The keys of ``lowest`` (key -> a sequence) with an ABANDONED row before that
    sequence: requeuing a row behind it must leave the key parked (its own requeue or
    skip releases everything after it), not let every claim walk the key's backlog."""
    rows = OutboxMessage.objects.using(using).abandoned()
    blocked: set[tuple[str, str]] = set()
    for before in _per_key(lowest, "sequence__lt"):
        blocked.update(rows.filter(before).values_list("destination", "ordering_key"))
    return blocked


def _per_key(
    heads: _Heads,
    lookup: str,
    which: Callable[[tuple[str, str], dt.datetime], models.Q] = lambda scope, at: models.Q(),
) -> Iterator[models.Q]:
    """Conditions on the rows of the keys of ``heads`` whose sequence compares with
    their key's by ``lookup`` and that match ``which(key, the key's time)``: one per
    :data:`_KEYS_PER_UPDATE` keys."""
    keys = sorted(heads.items())
    for start in range(0, len(keys), _KEYS_PER_UPDATE):
        condition = models.Q(pk__in=[])
        for (destination, key), (sequence, at) in keys[start : start + _KEYS_PER_UPDATE]:
            scope = models.Q(destination=destination, ordering_key=key, **{lookup: sequence})
            condition |= scope & which((destination, key), at)
        yield condition


def abandon(using: str, rows: OutboxQuerySet | None = None) -> int:
    """PENDING/FAILED (and PROCESSING with an expired lease) -> ABANDONED.

    Selected rows in other states are left alone; ``last_error`` is kept (it
    usually says why). A PROCESSING row under a live lease is refused: its relay
    may be publishing it this instant. The lease columns are cleared, so a relay
    whose expired lease is abandoned here finds its token gone and its late
    write dropped. One UPDATE whose WHERE PostgreSQL re-checks after waiting for
    a row lock, so a row claimed meanwhile is refused rather than abandoned
    under its relay. The events waiting behind an abandoned ordered row are parked
    (see :func:`_park_followers`). Returns how many rows changed."""
    selected = _selection(using, rows).abandonable()
    with transaction.atomic(using=using):
        ordered = _ordered_ids(selected)
        count = selected.update(
            status=OutboxStatus.ABANDONED,
            abandoned_at=Now(),
            locked_until=None,
            locked_by="",
            lease_token=None,
        )
        abandoned = _heads_by_key(_now(using, ordered, OutboxStatus.ABANDONED), ordered)
        _park_followers(using, abandoned, PARKED)
    return count


def _ordered_ids(rows: OutboxQuerySet) -> dict[int, dt.datetime]:
    """The ordered rows among ``rows``: id -> ``available_at``."""
    return dict(rows.filter(sequence__isnull=False).values_list("id", "available_at"))


def _now(using: str, ids: Iterable[int], status: OutboxStatus) -> OutboxQuerySet:
    """The rows of ``ids`` in ``status`` now: after an operator's UPDATE, the rows it
    changed, not those a claim took while the UPDATE waited for their lock (it re-checks
    its WHERE then and leaves them). Parking or releasing keys by the rows read before
    it would park a key behind a row the relay publishes: parked for ever."""
    return OutboxMessage.objects.using(using).filter(id__in=list(ids), status=status)


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
        rows = _named(rows, ids)
    if status:
        rows = rows.filter(status=status)
    if event_type:
        rows = rows.filter(event_type=event_type)
    with _reading_then_writing(using):
        if ids:
            _refuse_unrequeueable(rows, ids)
        return requeue(using, rows)


def change_counted(
    using: str, rows: OutboxQuerySet, change: Callable[[str, OutboxQuerySet], int]
) -> tuple[int, int]:
    """Apply ``change`` (:func:`requeue` or :func:`abandon`) to ``rows``, counted in the
    same transaction: returns (rows changed, selected rows it left alone by their
    state), as the admin's actions report them."""
    with _reading_then_writing(using):
        selected = rows.count()
        changed = change(using, rows)
    return changed, selected - changed


@contextlib.contextmanager
def _reading_then_writing(using: str) -> Iterator[None]:
    """A transaction that reads, then writes: on SQLite it takes the write lock first
    (:func:`django_outbox.db.write_first`), so another writer's commit makes it wait
    rather than refuses its write (its snapshot would be stale)."""
    with transaction.atomic(using=using):
        db.write_first(using)
        yield


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
    """Delete ``rows`` (outbox rows in a final state, inbox rows, samples) ``batch_size``
    at a time, each batch its own short statement; returns how many went.

    The selection is applied again to each batch's ids, so a row that left the
    selection since it was read (an abandoned row requeued) stays."""
    total = 0
    while ids := list(rows.values_list("pk", flat=True)[:batch_size]):
        deleted, _ = rows.filter(pk__in=ids).delete()
        total += deleted
    return total


def heads(rows: OutboxQuerySet) -> OutboxQuerySet:
    """The rows of ``rows`` that are their key's **head**: ordered (a ``sequence``), not
    PUBLISHED, and no row of the same (destination, ordering key) with a lower sequence
    is unfinished. Each probe reads ``outbox_key_unfinished_idx``. A head stays the head
    until it is published: a PUBLISHED row never goes back."""
    earlier = OutboxMessage.objects.using(rows.db).filter(
        destination=models.OuterRef("destination"),
        ordering_key=models.OuterRef("ordering_key"),
        sequence__lt=models.OuterRef("sequence"),
        sequence__isnull=False,
    )
    return rows.filter(KEY_UNFINISHED, sequence__isnull=False).filter(
        ~models.Exists(earlier.filter(KEY_UNFINISHED))
    )


def requeue_heads(using: str, ids: Sequence[int | uuid.UUID]) -> int:
    """Requeue (FAILED/ABANDONED -> PENDING, as :func:`requeue`) the named rows, each of
    which must be its key's head: "requeue head" of the admin. Any other named row
    refuses the whole call (:class:`~django_outbox.exceptions.SkipRefused`, a
    :class:`~django_outbox.exceptions.RequeueRefused`, naming each row and why);
    nothing changed then. Returns how many rows changed."""
    with transaction.atomic(using=using):
        rows = _locked_heads(using, ids, "requeued")
        return requeue(using, rows)


def skip(using: str, ids: Sequence[int | uuid.UUID]) -> int:
    """Skip the named rows, each its key's FAILED or ABANDONED head: ``skipped_at`` now,
    PENDING, attempts 0, due now, lease cleared. The relay then publishes a **skip
    marker** in its place (body ``null``, header ``skipped``, the row's own
    ``sequence``) and marks it PUBLISHED, so every consumer sees the gap and the key
    moves on. ``ids`` are row ids or event ids. Any row that is not found, not ordered,
    not its key's head or not FAILED/ABANDONED refuses the whole skip
    (:class:`~django_outbox.exceptions.SkipRefused` naming each one and why; nothing
    changed). Logged (WARNING, ``outbox.skipped``). Returns how many rows changed."""
    with transaction.atomic(using=using):
        rows = _locked_heads(using, ids, "skipped")
        skipped = list(
            rows.values_list("id", "event_id", "destination", "ordering_key", "sequence")
        )
        _release_followers(using, _heads_by_key(rows))
        count = rows.update(
            skipped_at=Now(),
            status=OutboxStatus.PENDING,
            attempts=0,
            available_at=Now(),
            abandoned_at=None,
            locked_until=None,
            locked_by="",
            lease_token=None,
        )
    for pk, event_id, destination, key, sequence in skipped:
        logger.warning(
            "skipped outbox row %s (event %s), sequence %s of key %r of %r: "
            "a skip marker will be published in its place",
            pk,
            event_id,
            sequence,
            key,
            destination,
            extra={
                "action": "outbox.skipped",
                "using": using,
                "id": pk,
                "event_id": str(event_id),
                "destination": destination,
                "ordering_key": key,
                "sequence": sequence,
            },
        )
    return count


def cancel(
    using: str,
    destination: str,
    *,
    dedup_key: str | None = None,
    event_id: uuid.UUID | str | None = None,
) -> bool:
    """Delete the unfinished row of ``destination`` with ``dedup_key`` (or ``event_id``)
    in the caller's transaction, unless a relay holds it (PROCESSING:
    :class:`EventInFlight`) or it is ordered (:class:`CancelRefused`: its key's
    sequence would keep a gap). Locking the row first (``FOR UPDATE``) waits for a
    claim in progress and reads the status after it. Returns whether a row went."""
    db.write_first(using)  # it reads, then writes
    named = {"dedup_key": dedup_key} if event_id is None else {"event_id": event_id}
    rows = OutboxMessage.objects.using(using).filter(UNFINISHED, destination=destination, **named)
    found = rows.select_for_update().values_list("id", "status", "sequence", "locked_by").first()
    if found is None:
        return False
    pk, status, sequence, locked_by = found
    ((name, value),) = named.items()
    which = f"the event with {name} {value!r} of {destination!r}"
    if sequence is not None:
        raise CancelRefused(
            f"cancel(): {which} is on an ordered route and is not cancelled: its key's "
            "sequence would keep a gap (an operator may skip it: outbox_skip)"
        )
    if status == OutboxStatus.PROCESSING:
        raise EventInFlight(
            f"cancel(): {which} is in flight (claimed by relay {locked_by!r}) and may be "
            "on the broker already: not cancelled"
        )
    OutboxMessage.objects.using(using).filter(id=pk).delete()
    return True


def _locked_heads(using: str, ids: Sequence[int | uuid.UUID], verb: str) -> OutboxQuerySet:
    """The named rows, locked, once each is checked to be its key's FAILED or ABANDONED
    head; else :class:`SkipRefused` naming every row that is not and why. Locking
    (``FOR UPDATE``, no SKIP LOCKED) waits for a claim in progress and re-reads the
    status after it; a head stays the head until it is published, which needs a claim."""
    db.write_first(using)  # it reads, then writes
    named = _named(OutboxMessage.objects.using(using), ids)
    found = {
        key: row
        for row in named.select_for_update().values("id", "event_id", "status", "sequence")
        for key in (row["id"], row["event_id"])
    }
    head_ids = set(heads(named).values_list("id", flat=True))
    requeueable = {status.value for status in REQUEUEABLE}
    reasons = []
    for name in dict.fromkeys(ids):
        row = found.get(name)
        if row is None:
            reasons.append(f"{name} (not found)")
        elif row["sequence"] is None:
            reasons.append(f"{row['id']} (not ordered: its route has no sequence)")
        elif row["status"] not in requeueable:
            reasons.append(f"{row['id']} ({row['status']}, not failed or abandoned)")
        elif row["id"] not in head_ids:
            reasons.append(f"{row['id']} (not its key's head: an earlier event is unpublished)")
    if reasons:
        raise SkipRefused(
            f"refused: only the failed or abandoned head of an ordered key can be {verb}; "
            f"not {', '.join(reasons)}; nothing {verb}"
        )
    return named.filter(id__in=head_ids)


def _named(rows: OutboxQuerySet, ids: Sequence[int | uuid.UUID]) -> OutboxQuerySet:
    """The rows named by row ids (ints) or event ids (UUIDs)."""
    ints = [i for i in ids if isinstance(i, int)]
    uuids = [i for i in ids if isinstance(i, uuid.UUID)]
    return rows.filter(models.Q(id__in=ints) | models.Q(event_id__in=uuids))
