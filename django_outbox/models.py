"""The outbox and inbox tables.

``OutboxMessage`` rows are written by :func:`django_outbox.stage` inside the
business transaction and driven through :class:`OutboxMessage.Status` by
:mod:`django_outbox.state.store`, the only writer of their state; the querysets here
only select.
``InboxMessage`` rows record which consumer already handled which event.
Times that matter for correctness (``created_at``, ``available_at``) default to
the database clock, never the worker's.
"""

from __future__ import annotations

import functools
import operator
import uuid
from typing import TYPE_CHECKING

from django.core.serializers.json import DjangoJSONEncoder
from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

if TYPE_CHECKING:
    import datetime as dt


class OutboxStatus(models.TextChoices):
    """Where an outbox row is in its life; see the state machine in docs/concepts.md."""

    PENDING = "pending", _("Pending")
    """Committed and waiting for a relay; the initial state."""
    PROCESSING = "processing", _("Processing")
    """Claimed by a relay holding a lease until ``locked_until``."""
    PUBLISHED = "published", _("Published")
    """Confirmed by the broker; kept until ``PUBLISHED_RETENTION`` passes (with 0, a
    confirmed row is deleted instead and never has this state)."""
    FAILED = "failed", _("Failed")
    """The last publish failed; retried at ``available_at`` with backoff."""
    ABANDONED = "abandoned", _("Abandoned")
    """Attempts exhausted or poison; waits for an operator to requeue it."""


#: States a relay claims from (PROCESSING only once its lease has expired).
CLAIMABLE = (OutboxStatus.PENDING, OutboxStatus.FAILED, OutboxStatus.PROCESSING)


def _set_exactly_in(status: OutboxStatus, column: str) -> models.Q:
    """``column`` is set on the rows in ``status`` and on no other row."""
    return models.Q(status=status, **{f"{column}__isnull": False}) | (
        ~models.Q(status=status) & models.Q(**{f"{column}__isnull": True})
    )


#: Rows not yet PUBLISHED nor ABANDONED, told by the columns a claim never writes (a
#: row's ``published_at`` is set exactly when it is PUBLISHED, its ``abandoned_at``
#: when it is ABANDONED): the condition of the due indexes and of the key's
#: unfinished events, so that a claim, which changes ``status`` and the lease only,
#: writes a HOT update (no index entry; docs/relay.md).
UNFINISHED = models.Q(published_at__isnull=True, abandoned_at__isnull=True)
#: An ordered key's unfinished events (ABANDONED ones too: they block the key), as
#: ``outbox_key_unfinished_idx`` says it; the probes of a key's head use it so as to
#: read that index.
KEY_UNFINISHED = models.Q(published_at__isnull=True)
#: FAILED rows among the unfinished ones, told without ``status`` as well: a failure
#: always writes a ``last_error`` (store._mark_failed). The condition of
#: ``outbox_failed_idx``, which a claim out of FAILED leaves the row in.
ERRORED = UNFINISHED & ~models.Q(last_error="")
#: Rows in either due index, a condition that holds for every unfinished row but that
#: PostgreSQL reads as both due indexes (a BitmapOr) where a state alone leaves it a
#: scan of the table: PENDING and PROCESSING rows have no partial index of their own.
IN_DUE_INDEXES = UNFINISHED & (models.Q(sequence__isnull=True) | models.Q(sequence__isnull=False))
#: The states whose rows are found through the due indexes alone.
DUE_INDEX_STATES = frozenset({OutboxStatus.PENDING, OutboxStatus.PROCESSING})
#: What else is true of every row in a state (the checks on ``published_at``,
#: ``abandoned_at`` and ``last_error`` say so), stated so that the planner reads that
#: state's rows from an index: its own partial index, or the due indexes.
_INDEXED = {
    **dict.fromkeys(DUE_INDEX_STATES, IN_DUE_INDEXES),
    OutboxStatus.FAILED: ERRORED,
    OutboxStatus.ABANDONED: models.Q(abandoned_at__isnull=False),
    OutboxStatus.PUBLISHED: models.Q(published_at__isnull=False),
}


def in_state(status: str) -> models.Q:
    """The rows in ``status``, read through an index on PostgreSQL (``_INDEXED``)."""
    return models.Q(status=status) & _INDEXED[OutboxStatus(status)]


#: States an operator may requeue.
REQUEUEABLE = (OutboxStatus.FAILED, OutboxStatus.ABANDONED)
#: States an operator may abandon (and PROCESSING once its lease has expired; see
#: django_outbox.state.store.abandon).
ABANDONABLE = (OutboxStatus.PENDING, OutboxStatus.FAILED)


class OutboxQuerySet(models.QuerySet["OutboxMessage"]):
    def pending(self) -> OutboxQuerySet:
        return self.filter(status=OutboxStatus.PENDING)

    def failed(self) -> OutboxQuerySet:
        return self.in_states(OutboxStatus.FAILED)  # through outbox_failed_idx

    def abandoned(self) -> OutboxQuerySet:
        return self.in_states(OutboxStatus.ABANDONED)

    def published(self) -> OutboxQuerySet:
        return self.in_states(OutboxStatus.PUBLISHED)

    def in_states(self, *states: str) -> OutboxQuerySet:
        """The rows in any of ``states``, read through indexes on PostgreSQL on any table
        size (:func:`in_state`): by ``status`` alone, every state but PUBLISHED would be
        read by a scan of the table, published rows and all."""
        if not states:
            return self.none()
        return self.filter(functools.reduce(operator.or_, map(in_state, states)))

    def due(self, now: dt.datetime | Now | None = None) -> OutboxQuerySet:
        """Rows a relay may claim at ``now`` (default: the database clock).

        PENDING and FAILED rows whose ``available_at`` has come, and PROCESSING
        rows whose lease (``locked_until``) expired: a claim leaves ``available_at``
        as it was, so the two due indexes (the unordered rows' ``outbox_due_idx``,
        the ordered rows' ``outbox_ordered_due_idx``) hold the rows in flight too,
        and the lease is read from the row.
        """
        now = Now() if now is None else now
        due = self.filter(UNFINISHED, status__in=CLAIMABLE, available_at__lte=now)
        return due.exclude(status=OutboxStatus.PROCESSING, locked_until__gt=now)

    def leased(self, token: uuid.UUID) -> OutboxQuerySet:
        """Rows whose current lease is ``token``: every write a relay makes after
        its claim goes through this filter, so a relay whose lease was taken
        over changes nothing."""
        return self.filter(lease_token=token)

    def requeueable(self) -> OutboxQuerySet:
        """Rows an operator may requeue: FAILED and ABANDONED."""
        return self.in_states(*REQUEUEABLE)

    def abandonable(self) -> OutboxQuerySet:
        """Rows no relay is publishing right now: PENDING, FAILED, and PROCESSING
        rows whose lease has expired (their relay died; any relay may claim them)."""
        expired = in_state(OutboxStatus.PROCESSING) & models.Q(locked_until__lte=Now())
        return self.in_states(*ABANDONABLE) | self.filter(expired)


class OutboxMessage(models.Model):
    """One event staged in the business transaction, waiting for or done with the relay."""

    Status = OutboxStatus

    id = models.BigAutoField(primary_key=True)
    event_id = models.UUIDField(_("event id"), default=uuid.uuid4, unique=True, editable=False)
    event_type = models.CharField(_("event type"), max_length=255)
    destination = models.CharField(_("destination"), max_length=255)
    payload = models.JSONField(_("payload"), encoder=DjangoJSONEncoder)
    headers = models.JSONField(_("headers"), default=dict, blank=True, encoder=DjangoJSONEncoder)
    ordering_key = models.CharField(_("ordering key"), max_length=255, blank=True, default="")
    status = models.CharField(
        _("status"), max_length=16, choices=Status.choices, default=Status.PENDING
    )
    attempts = models.IntegerField(_("attempts"), default=0)
    available_at = models.DateTimeField(_("available at"), db_default=Now())
    locked_until = models.DateTimeField(_("locked until"), null=True, blank=True)
    locked_by = models.CharField(_("locked by"), max_length=255, blank=True, default="")
    lease_token = models.UUIDField(_("lease token"), null=True, blank=True, editable=False)
    last_error = models.TextField(_("last error"), blank=True, default="")
    created_at = models.DateTimeField(_("created at"), db_default=Now(), editable=False)
    published_at = models.DateTimeField(_("published at"), null=True, blank=True)
    abandoned_at = models.DateTimeField(_("abandoned at"), null=True, blank=True)
    #: On an ordered route: the event's place among its key's events, 1, 2, 3, ... in the
    #: commit order of their staging transactions (taken from OutboxSequence); NULL on
    #: other routes. See docs/ordering.md.
    sequence = models.BigIntegerField(_("sequence"), null=True, blank=True, editable=False)
    #: When an operator skipped this event, the blocked head of its key: the relay then
    #: publishes a marker in its place (no payload, header ``skipped``).
    skipped_at = models.DateTimeField(_("skipped at"), null=True, blank=True)
    #: ``stage(dedup_key=...)``: at most one unfinished event per (destination, dedup
    #: key) (``outbox_dedup_unfinished_idx``); NULL when none was given. See
    #: docs/scheduling.md.
    dedup_key = models.CharField(  # noqa: DJ001  (NULL: none given, outside the index)
        _("dedup key"), max_length=255, null=True, blank=True, editable=False
    )

    #: Set on the rows ``stage()`` and ``stage_many()`` return, not a column: ``"staged"``,
    #: ``"deduplicated"``, ``"replaced"`` or ``"in_flight"`` (docs/scheduling.md).
    staging_outcome: str

    objects = OutboxQuerySet.as_manager()

    class Meta:
        verbose_name = _("outbox message")
        verbose_name_plural = _("outbox messages")
        ordering = ("id",)
        permissions = [("requeue_outboxmessage", _("Can requeue or abandon outbox messages"))]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(attempts__gte=0), name="outbox_attempts_gte_0"
            ),
            models.CheckConstraint(
                condition=models.Q(status__in=OutboxStatus.values),
                name="outbox_status_valid",
            ),
            # What UNFINISHED and the partial indexes rely on: published_at is set
            # exactly on PUBLISHED rows, abandoned_at exactly on ABANDONED ones.
            models.CheckConstraint(
                condition=_set_exactly_in(OutboxStatus.PUBLISHED, "published_at"),
                name="outbox_published_at_iff_published",
            ),
            models.CheckConstraint(
                condition=_set_exactly_in(OutboxStatus.ABANDONED, "abandoned_at"),
                name="outbox_abandoned_at_iff_abandoned",
            ),
            # What ERRORED (outbox_failed_idx) relies on: a FAILED row says why.
            models.CheckConstraint(
                condition=~models.Q(status=OutboxStatus.FAILED) | ~models.Q(last_error=""),
                name="outbox_failed_has_error",
            ),
            # The unfinished events of each key in order, one per place: a key's head
            # (ordered_gate) and the run after it. Partial, so that the claim's probes
            # never read a key's published past; unique, a backstop under the counter
            # (OutboxSequence), which numbers each key's events 1, 2, 3, ... once.
            models.UniqueConstraint(
                fields=["destination", "ordering_key", "sequence"],
                condition=KEY_UNFINISHED & models.Q(sequence__isnull=False),
                name="outbox_key_unfinished_idx",
            ),
            # At most one unfinished event per (destination, dedup key): staging's
            # INSERT ... ON CONFLICT arbitrates concurrent transactions on it. Its
            # condition names no column the claim writes (UNFINISHED), so the claim
            # stays a HOT update.
            models.UniqueConstraint(
                fields=["destination", "dedup_key"],
                condition=UNFINISHED & models.Q(dedup_key__isnull=False),
                name="outbox_dedup_unfinished_idx",
            ),
        ]
        # On PostgreSQL the table's fillfactor is 50 (migration 0007: Django has no option
        # for it): the claim and the finalize write a row's next version on its own page,
        # and the WAL record leaves out the unchanged payload. No index names a column
        # the claim writes (status, locked_until, locked_by, lease_token), so the claim
        # is a HOT update: no index entry (docs/relay.md). The finalize sets published_at
        # and takes new entries.
        indexes = [
            # The claim: due rows oldest first, expired leases included (see due()).
            # Partial, so PUBLISHED rows kept for retention never enter it and the
            # claim stays fast as they pile up.
            models.Index(
                fields=["available_at", "id"],
                name="outbox_due_idx",
                condition=UNFINISHED & models.Q(sequence__isnull=True),
            ),
            # The claim of ordered rows (those with a sequence): the same, apart.
            models.Index(
                fields=["available_at", "id"],
                name="outbox_ordered_due_idx",
                condition=UNFINISHED & models.Q(sequence__isnull=False),
            ),
            # FAILED rows by their next retry: outbox_status's recent errors and
            # attempts, and the rows waiting for a retry, read only the failing rows.
            models.Index(
                fields=["available_at"],
                name="outbox_failed_idx",
                condition=ERRORED,
            ),
            # Retention cleanup, one index per final state.
            models.Index(
                fields=["published_at"],
                name="outbox_published_idx",
                condition=models.Q(published_at__isnull=False),
            ),
            models.Index(
                fields=["abandoned_at"],
                name="outbox_abandoned_idx",
                condition=models.Q(abandoned_at__isnull=False),
            ),
            # The admin: its date filter, and its search for an ordering key (the newest
            # first). Columns written once, at staging, so the claim stays HOT.
            models.Index(fields=["created_at"], name="outbox_created_idx"),
            models.Index(
                fields=["ordering_key", "id"],
                name="outbox_ordering_key_idx",
                condition=~models.Q(ordering_key=""),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.event_type} -> {self.destination} [{self.status}] {self.event_id}"


class OutboxSequence(models.Model):
    """The last sequence number given to one ordering key of one ordered destination.

    Staging an ordered event increments it in the business transaction, so its row
    lock orders the writers of a key by commit (docs/ordering.md). Never deleted: a
    key that started again from 1 would look like a replay to its consumers."""

    id = models.BigAutoField(primary_key=True)
    destination = models.CharField(_("destination"), max_length=255)
    ordering_key = models.CharField(_("ordering key"), max_length=255)
    last_sequence = models.BigIntegerField(_("last sequence"))

    class Meta:
        verbose_name = _("outbox sequence")
        verbose_name_plural = _("outbox sequences")
        constraints = [
            models.UniqueConstraint(
                fields=["destination", "ordering_key"], name="outbox_sequence_key_uniq"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.destination} {self.ordering_key}: {self.last_sequence}"


class InboxMessage(models.Model):
    """A mark that ``consumer`` has handled ``event_id``; written with the handler's writes."""

    id = models.BigAutoField(primary_key=True)
    consumer = models.CharField(_("consumer"), max_length=255)
    event_id = models.UUIDField(_("event id"))
    processed_at = models.DateTimeField(_("processed at"), db_default=Now(), editable=False)

    class Meta:
        verbose_name = _("inbox message")
        verbose_name_plural = _("inbox messages")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "event_id"], name="inbox_consumer_event_uniq"
            ),
        ]
        indexes = [models.Index(fields=["processed_at"], name="inbox_processed_idx")]

    def __str__(self) -> str:
        return f"{self.consumer}: {self.event_id}"


class InboxFailureQuerySet(models.QuerySet["InboxFailure"]):
    def parked(self) -> InboxFailureQuerySet:
        return self.filter(parked_at__isnull=False)

    def failing(self) -> InboxFailureQuerySet:
        """Events that failed at least once and are still being redelivered (or
        were later handled: a success does not erase the failure record)."""
        return self.filter(parked_at__isnull=True)


class InboxFailure(models.Model):
    """A consumer's failed deliveries of one event, and the dead letter once parked.

    Written outside the handler's (rolled back) transaction, so the count
    survives the failure. It is how ``run_outbox_consumer --max-deliveries``
    counts deliveries on brokers that do not count them; once the count is
    reached the message body is kept here (``parked_at`` set) and the message
    leaves the queue.
    """

    id = models.BigAutoField(primary_key=True)
    consumer = models.CharField(_("consumer"), max_length=255)
    event_id = models.UUIDField(_("event id"))
    queue = models.CharField(_("queue"), max_length=255, blank=True, default="")
    event_type = models.CharField(_("event type"), max_length=255, blank=True, default="")
    attempts = models.IntegerField(_("failed deliveries"), default=0)
    last_error = models.TextField(_("last error"), blank=True, default="")
    body = models.TextField(_("body"), blank=True, default="")
    headers = models.JSONField(_("headers"), default=dict, blank=True, encoder=DjangoJSONEncoder)
    first_failed_at = models.DateTimeField(_("first failed at"), db_default=Now(), editable=False)
    last_failed_at = models.DateTimeField(_("last failed at"), db_default=Now())
    parked_at = models.DateTimeField(_("parked at"), null=True, blank=True)

    objects = InboxFailureQuerySet.as_manager()

    class Meta:
        verbose_name = _("inbox failure")
        verbose_name_plural = _("inbox failures")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "event_id"], name="inbox_failure_consumer_event_uniq"
            ),
            models.CheckConstraint(
                condition=models.Q(attempts__gte=0), name="inbox_failure_attempts_gte_0"
            ),
        ]
        indexes = [
            models.Index(fields=["last_failed_at"], name="inbox_failure_last_idx"),
            models.Index(
                fields=["parked_at"],
                name="inbox_failure_parked_idx",
                condition=models.Q(parked_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        state = "parked" if self.parked_at else f"{self.attempts} failed"
        return f"{self.consumer}: {self.event_id} [{state}]"


class InboxSequence(models.Model):
    """The last sequence a consumer handled of one ordering key of an ordered
    destination: the inbox's guard of per-key order (docs/ordering.md).

    ``start_sequence``: the sequences up to it count as handled without an inbox row
    (set by :func:`~django_outbox.inbox.start_positions`, and by the migration that
    added it): a copy of one of them is a duplicate. Past it, an event at or below
    ``last_sequence`` is a duplicate only if the inbox has its event id; another event
    claiming a handled sequence is a conflict (docs/ordered-consumption.md)."""

    id = models.BigAutoField(primary_key=True)
    consumer = models.CharField(_("consumer"), max_length=255)
    destination = models.CharField(_("destination"), max_length=255)
    ordering_key = models.CharField(_("ordering key"), max_length=255)
    last_sequence = models.BigIntegerField(_("last sequence"), default=0)
    start_sequence = models.BigIntegerField(_("start sequence"), default=0)
    updated_at = models.DateTimeField(_("updated at"), db_default=Now())

    class Meta:
        verbose_name = _("inbox sequence")
        verbose_name_plural = _("inbox sequences")
        constraints = [
            models.UniqueConstraint(
                fields=["consumer", "destination", "ordering_key"],
                name="inbox_sequence_key_uniq",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.consumer}: {self.destination} {self.ordering_key} at {self.last_sequence}"


class TaskStatus(models.TextChoices):
    """Where a task of :class:`django_outbox.tasks.OutboxTaskBackend` is; the values
    are those of Django's ``django.tasks.TaskResultStatus``."""

    READY = "READY", _("Ready")
    """Enqueued (its outbox row committed) and not yet started by a worker."""
    RUNNING = "RUNNING", _("Running")
    """A worker started it; its outcome is not committed yet."""
    FAILED = "FAILED", _("Failed")
    """It raised: ``errors`` holds the exception class and traceback. Final."""
    SUCCESSFUL = "SUCCESSFUL", _("Successful")
    """It returned: ``return_value`` holds the value as JSON. Final."""


#: The states a task ends in; retention deletes these once ``TASK_RESULT_RETENTION`` passed.
TASK_FINISHED = (TaskStatus.SUCCESSFUL, TaskStatus.FAILED)


class TaskResultRecord(models.Model):
    """The stored result of one Django task enqueued through the outbox.

    Written by :class:`~django_outbox.tasks.OutboxTaskBackend` in the caller's
    transaction (READY, beside the task's outbox row: ``id`` is the event id), and
    by the worker that runs it (RUNNING, then SUCCESSFUL or FAILED, the outcome in
    the same transaction as the task's own writes). ``get_result()`` reads it.
    """

    id = models.UUIDField(_("id"), primary_key=True, editable=False)
    task_path = models.CharField(_("task"), max_length=255)
    backend = models.CharField(_("backend"), max_length=100)
    queue_name = models.CharField(_("queue"), max_length=255)
    priority = models.SmallIntegerField(_("priority"), default=0)
    run_after = models.DateTimeField(_("run after"), null=True, blank=True)
    args = models.JSONField(_("arguments"), default=list, blank=True)
    kwargs = models.JSONField(_("keyword arguments"), default=dict, blank=True)
    status = models.CharField(
        _("status"), max_length=10, choices=TaskStatus.choices, default=TaskStatus.READY
    )
    enqueued_at = models.DateTimeField(_("enqueued at"), db_default=Now(), editable=False)
    started_at = models.DateTimeField(_("started at"), null=True, blank=True)
    last_attempted_at = models.DateTimeField(_("last attempted at"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished at"), null=True, blank=True)
    return_value = models.JSONField(_("return value"), null=True, blank=True)
    errors = models.JSONField(_("errors"), default=list, blank=True)
    worker_ids = models.JSONField(_("worker ids"), default=list, blank=True)

    class Meta:
        verbose_name = _("task result")
        verbose_name_plural = _("task results")
        db_table = "django_outbox_taskresult"
        indexes = [
            # Retention deletes finished results by age; the admin lists the newest first.
            models.Index(
                fields=["finished_at"],
                name="outbox_task_finished_idx",
                condition=models.Q(finished_at__isnull=False),
            ),
            models.Index(fields=["enqueued_at"], name="outbox_task_enqueued_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.task_path} {self.id} [{self.status}]"


class WorkerKind(models.TextChoices):
    """What a :class:`WorkerHeartbeat` row is the heartbeat of."""

    RELAY = "relay", _("Relay")
    """A relay (``run_outbox_relay``) of the database the row is in."""
    CONSUMER = "consumer", _("Consumer")
    """An inbox consumer (``run_outbox_consumer``) whose inbox is in that database."""


class WorkerHeartbeat(models.Model):
    """The last sign of life of one relay or consumer process, written by a thread of
    the process every ``HEARTBEAT_INTERVAL`` seconds (:mod:`django_outbox.workers.heartbeat`),
    and once more when it stops cleanly. Read by ``outbox_status``, ``outbox_health``, the
    health view and the admin, which judge a row live, stale or dead by the age of its
    last beat counted in its own ``interval``.
    """

    id = models.BigAutoField(primary_key=True)
    #: Drawn by the process when it starts: its row's key. Two processes never share a
    #: row, even with one ``host:pid`` (containers on the host's network, pid 1).
    process = models.UUIDField(_("process"), unique=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(_("kind"), max_length=16, choices=WorkerKind.choices)
    #: ``host:pid`` of the process (a relay's ``worker``, as written into claimed rows).
    worker = models.CharField(_("worker"), max_length=255)
    #: The alias of the database it serves, as the process names it.
    database = models.CharField(_("database"), max_length=100)
    #: A consumer's name and queue (``name@queue``); empty for a relay.
    name = models.CharField(_("name"), max_length=512, blank=True, default="")
    started_at = models.DateTimeField(_("started at"))
    beat_at = models.DateTimeField(_("last beat"))
    #: Seconds between its beats: a row is judged by its own cadence.
    interval = models.FloatField(_("interval"))
    #: A relay's last batch that claimed rows; a consumer's last message.
    last_batch_at = models.DateTimeField(_("last batch"), null=True, blank=True)
    #: Set by a clean stop; a process that died leaves it empty.
    stopped_at = models.DateTimeField(_("stopped at"), null=True, blank=True)
    #: Totals since the process started (a relay: claimed, published, failed, abandoned,
    #: ...; a consumer: received, handled, duplicates, failed, ...).
    counts = models.JSONField(_("counts"), default=dict, blank=True)

    class Meta:
        verbose_name = _("relay or consumer")
        verbose_name_plural = _("relays and consumers")
        db_table = "django_outbox_heartbeat"
        ordering = ("kind", "worker")
        # Readers list the latest beats first; retention deletes the oldest.
        indexes = [models.Index(fields=["beat_at"], name="outbox_heartbeat_beat_idx")]

    def __str__(self) -> str:
        return f"{self.kind} {self.worker}" + (f" ({self.name})" if self.name else "")


class OutboxSample(models.Model):
    """The outbox's backlog at the start of one minute, and what was published in the
    minute before it: the admin's chart of the last hour. One row per minute and
    database, taken by whichever relay beats first in that minute."""

    taken_at = models.DateTimeField(_("taken at"), primary_key=True)
    pending = models.IntegerField(_("pending"))
    processing = models.IntegerField(_("processing"))
    failed = models.IntegerField(_("failed"))
    #: Rows whose ``published_at`` falls in the minute before ``taken_at``.
    published = models.IntegerField(_("published in the minute before"))
    #: Seconds the oldest due row had waited; NULL when nothing was due.
    oldest_due_age = models.FloatField(_("oldest due age"), null=True, blank=True)

    class Meta:
        verbose_name = _("outbox sample")
        verbose_name_plural = _("outbox samples")
        db_table = "django_outbox_sample"
        ordering = ("taken_at",)

    def __str__(self) -> str:
        return f"{self.taken_at:%Y-%m-%d %H:%M} pending={self.pending}"
