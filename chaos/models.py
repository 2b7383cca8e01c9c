"""The chaos suite's tables: the business rows, what the consumer handled, the
events rolled back on purpose, and what the Django tasks did. None has a unique
constraint on ``event_id`` (or a task's ``result_id``), so that a duplicate shows up in
the audit instead of being stopped by an index."""

from __future__ import annotations

from django.db import models


class Order(models.Model):
    """A business row; committed with its one event, or not at all."""

    producer = models.PositiveSmallIntegerField()
    event_id = models.UUIDField(db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"order {self.pk}"


class Handled(models.Model):
    """One row per run of the consumer's handler (written inside the inbox's transaction)."""

    event_id = models.UUIDField(db_index=True)
    pid = models.IntegerField()
    handled_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"handled {self.event_id}"


class Forged(models.Model):
    """A message a producer put on the consumer's queue itself, as anyone with publish
    rights can (:mod:`chaos.producer`): unsigned, or signed with a key no relay has. The
    consumer verifies signatures, so it must park every one and handle none."""

    event_id = models.UUIDField(db_index=True)

    def __str__(self) -> str:
        return f"forged {self.event_id}"


class RolledBack(models.Model):
    """An event staged and then rolled back on purpose (written after the rollback)."""

    class Kind(models.TextChoices):
        TRANSACTION = "transaction"
        SAVEPOINT = "savepoint"

    event_id = models.UUIDField()
    kind = models.CharField(max_length=20, choices=Kind.choices)

    def __str__(self) -> str:
        return f"rolled back ({self.kind}) {self.event_id}"


class BrokerCopy(models.Model):
    """How many copies of an event RabbitMQ received: filled at the end of a run from
    the tap queue, which is bound beside the consumer's queue and read by no one
    while the run lasts."""

    event_id = models.UUIDField(primary_key=True)
    copies = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"{self.event_id} x{self.copies}"


class Violation(models.Model):
    """A write to the outbox that breaks the relay's rules, recorded by triggers the
    chaos migration puts on the outbox table:

    * ``set_back``: a PUBLISHED row put back into another state (only an operator's
      requeue may do that, and the chaos suite requeues nothing);
    * ``stale_write``: a relay finalizing a row leased to another relay (the lease
      token exists to stop exactly that);
    * ``stale_delete``: the same, by a relay that deletes the rows the broker confirmed
      (``PUBLISHED_RETENTION`` 0), recorded by the trigger of migration 0006.
    """

    kind = models.CharField(max_length=20)
    event_id = models.UUIDField()
    old_status = models.CharField(max_length=20)
    new_status = models.CharField(max_length=20)
    locked_by = models.CharField(max_length=255)  # the row's lease holder before the write
    writer = models.CharField(max_length=255)  # the application_name of the writing process
    at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.kind} {self.event_id}: {self.old_status} -> {self.new_status}"


class OrderedCopy(models.Model):
    """A message of the ordered destination as the tap queue held it: ``position`` is its
    place in the tap (the order a first consumer receives it in), filled at the end of a
    run with its ``destination``, ``ordering_key`` and ``sequence`` headers."""

    position = models.PositiveIntegerField(primary_key=True)
    event_id = models.UUIDField()
    destination = models.CharField(max_length=255)
    ordering_key = models.CharField(max_length=255)
    sequence = models.BigIntegerField()

    def __str__(self) -> str:
        return f"{self.ordering_key} #{self.sequence} at {self.position}"


class TaskEffect(models.Model):
    """One row per run of the Django task (:mod:`chaos.djtasks`) that committed: written
    in the task's transaction, with its outcome."""

    result_id = models.UUIDField(db_index=True)  # the task's TaskResultRecord id
    order = models.UUIDField()  # the event id of the order it was enqueued with
    attempt = models.PositiveSmallIntegerField()
    pid = models.IntegerField()
    ran_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"task {self.result_id} attempt {self.attempt}"


class Committed(models.Model):
    """An event whose transaction's COMMIT returned to its producer, as the producer
    recorded it outside the database (a file it fsyncs after each commit: the
    ``pg-failover`` profiles, :mod:`chaos.failover`), loaded at the end of a run. What
    the application was told is committed, compared with what the promoted standby has."""

    event_id = models.UUIDField(db_index=True)
    producer = models.PositiveSmallIntegerField()

    def __str__(self) -> str:
        return f"committed {self.event_id}"
