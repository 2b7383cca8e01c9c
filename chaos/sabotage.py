"""Deliberately broken guarantees, to show that the audit catches them.

``python -m chaos --sabotage lease`` starts relays whose finalize ignores the
lease token (a relay whose lease was taken over writes anyway: the ORM's ``leased()``
and PostgreSQL's fragment ``lease_held`` both let every row through);
``--sabotage inbox`` starts a consumer without the inbox (every delivery runs the
handler); ``--sabotage parking`` starts a consumer that parks a message at its first
redelivery, as if a consumer kill were the message's fault; ``--sabotage order`` starts
relays whose claim has no per-key gate (the named query ``ordered_gate`` replaced with
``TRUE``), so any due row of an ordered key can be claimed, by any relay, next to its
predecessors. ``--sabotage attempts`` starts relays that count an attempt for every
row they give back unpublished (``Failure.not_attempted`` and ``Failure.broker_down``
made to count), so a memory
alarm or a partition spends attempts; ``--sabotage staging`` starts producers that treat
staging as best effort: when it fails (a full disk) they commit the orders anyway,
without their events; ``--sabotage failover`` starts relays that connect to the first
address of a failover list only, so that they cannot go on while the cluster's first
node (where the runner put the queue's leader) is down; ``--sabotage tasks`` (Django 6)
starts a task worker whose runner has neither guard: no inbox transaction (every delivery
of a task counts as new) and no skip of a task whose result is finished already, so a
task whose message arrives twice runs twice; ``--sabotage heartbeat`` starts relays and
consumers that never write their heartbeat; ``--sabotage frames`` starts relays whose AMQP
frame encoder gives every message of the process one event id (its ``event_id`` header and
message id), as an encoder that mixed up messages' parts would; ``--sabotage due`` starts
relays whose claim takes PROCESSING rows whatever their lease (the named query ``claim_due``
without its ``locked_until`` test, which since the claim became a HOT update is all that
keeps a live lease's rows from the next claim); ``--sabotage oom`` starts relays that do not
know Redis out of memory when they see it (``write_refusal`` of the Redis transport always
None): its refusals are publish failures that count an attempt; ``--sabotage forgery``
starts consumers that verify no signature, so the producers' forged messages are handled;
``--sabotage msgid`` starts relays that publish to NATS JetStream without ``Nats-Msg-Id``
(the transport's header name ``MSG_ID`` replaced with one JetStream does not read), so the
stream cannot drop the copies a relay publishes again; ``--sabotage sync`` (the
``pg-failover`` profile) starts every process with ``synchronous_commit`` local: its
COMMIT returns once the primary's own disk has it, without waiting for the synchronous
standby, so a failover loses commits the producers were told of; ``--sabotage natsorder``
starts relays whose NATS transport sends each ordering key's messages of a batch last first
(its ``_chains`` reversed), each still after the previous one's PubAck, so a key's run of
events reaches the stream backwards; ``--sabotage txrecord`` (the ``kafka`` profile) starts
relays that learn nothing from the Kafka transactions' record topic (``TransactionLog._learn``
skips every record), so neither a restarted relay nor one reclaiming rows knows which of them
a transaction already committed, and the transactional route sends them again;
``--sabotage partition-drop`` (the ``partitioned`` profile) starts relays whose retention
takes every closed range of the partitioned outbox for expired (``Expiry.expired`` always
true: neither its unfinished rows nor its rows' retention keep it), so a range is dropped
as soon as its last id is drawn and its writers let go, rows still to be published in it.
A run with any of them must fail its audit.
Nothing imports this module unless ``CHAOS_SABOTAGE`` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from django.db import transaction

T = TypeVar("T")
KINDS = (
    "lease",
    "inbox",
    "parking",
    "order",
    "attempts",
    "staging",
    "failover",
    "tasks",
    "heartbeat",
    "frames",
    "due",
    "oom",
    "forgery",
    "msgid",
    "sync",
    "delivery",
    "partitioner",
    "acks",
    "natsorder",
    "txrecord",
    "partition-drop",
)


def apply(kind: str) -> None:
    if kind == "lease":
        from django_outbox.models import OutboxQuerySet

        OutboxQuerySet.leased = lambda self, token: self  # type: ignore[method-assign]
        _replace_query("lease_held", "%s IS NOT NULL")  # PostgreSQL's published mark
    elif kind == "inbox":
        from django_outbox.consumer import handling

        handling.process_once = _no_inbox  # type: ignore[assignment]
    elif kind == "order":
        _without_ordered_gate()
    elif kind == "due":
        _replace_query(
            "claim_due",
            "status IN ({claimable}) AND published_at IS NULL "
            "AND abandoned_at IS NULL AND available_at <= {clock}",
        )
    elif kind == "attempts":
        from django_outbox.transports.base import Failure

        for name in ("not_attempted", "broker_down"):
            setattr(Failure, name, _counted(getattr(Failure, name)))
    elif kind == "staging":
        _best_effort()
    elif kind == "failover":
        _first_address_only()
    elif kind == "tasks":
        _unguarded_task_runner()
    elif kind == "heartbeat":
        from django_outbox.workers.heartbeat import Heartbeat

        Heartbeat._write = lambda self, *args, **kwargs: False  # type: ignore[method-assign]
    elif kind == "frames":
        _one_event_id()
    elif kind == "oom":
        from django_outbox.transports import connection, declare, redis_wire

        for module in (connection, declare, redis_wire):  # each module that tells it
            module.write_refusal = lambda exc: None  # type: ignore[attr-defined]
    elif kind == "forgery":
        from django_outbox.consumer import loop as consumer

        consumer._verifying_keys = lambda verify: None  # type: ignore[assignment]
    elif kind == "msgid":
        from django_outbox.transports import nats

        # Read where it is used (header_block): every message
        # then carries the event id under a header JetStream does not dedupe on.
        nats.MSG_ID = "Chaos-Not-Msg-Id"  # type: ignore[misc]
    elif kind == "sync":
        from django.conf import settings

        # Read when the process first connects, after ready(): its sessions' commits are
        # local, whatever the standby's place in synchronous_standby_names.
        options = settings.DATABASES["default"]["OPTIONS"]
        options["options"] = "-c synchronous_commit=local"
    elif kind in ("delivery", "partitioner", "acks"):
        _kafka(kind)
    elif kind == "natsorder":
        _nats_keys_backwards()
    elif kind == "txrecord":
        from django_outbox.transports.kafka_transactions import TransactionLog

        # The record topic is read to its end as ever, its records dropped: no transactional
        # id's latest record is known, at a relay's start (nothing inherited, nothing marked)
        # nor before a batch (nothing the log holds is skipped).
        TransactionLog._learn = lambda self, message: None  # type: ignore[method-assign]
    elif kind == "partition-drop":
        from django_outbox.db.partitions import Expiry

        # Read by droppable() and again, the range locked, by _drop(): both say yes.
        Expiry.expired = property(lambda self: True)  # type: ignore[method-assign,assignment]
    elif kind == "parking":
        from django_outbox.consumer import InboxConsumer

        InboxConsumer.__init__ = _parking_at_once(InboxConsumer.__init__)  # type: ignore[method-assign]
    else:
        raise ValueError(f"CHAOS_SABOTAGE must be one of {', '.join(KINDS)}; got {kind!r}")


def _kafka(kind: str) -> None:
    """The Kafka transport without one of its guarantees: "delivery", a row PUBLISHED
    once its record is handed to librdkafka, without waiting for its delivery report (a
    record that never arrives is lost); "partitioner", keys spread over partitions at
    random instead of murmur2 (one key, several partitions: no order); "acks", a record
    acknowledged by its leader alone (``acks=1``, which librdkafka allows only without
    idempotence), however few replicas are in sync."""
    from django_outbox.transports import kafka

    if kind == "delivery":
        settle = kafka._settle

        def unwaited(producer: Any, timeout: float) -> None:
            producer.poll(0)  # the reports already there, and nothing more

        def unreported(outcomes: list[Any]) -> list[Any]:
            return settle([None if outcome is False else outcome for outcome in outcomes])

        kafka._flush = unwaited  # type: ignore[assignment]
        kafka._settle = unreported  # type: ignore[assignment]
    else:
        one_replica = {"acks": 1, "enable.idempotence": False}
        kafka.REQUIRED.update({"partitioner": "random"} if kind == "partitioner" else one_replica)


def _without_ordered_gate() -> None:
    """Replace the claim's per-key gate, the named query ``ordered_gate``, with ``TRUE``
    (a scrape's blocked keys, built from it too, would count every abandoned ordered row;
    nothing in the chaos run scrapes)."""
    _replace_query("ordered_gate", "TRUE")


def _nats_keys_backwards() -> None:
    """The NATS transport's chains (a key's messages of a batch, sent one after the other,
    each once the previous one's PubAck came back) each reversed: a key's later events
    reach the stream before its earlier ones. Only the NATS transport builds its chains
    there: the other destinations keep their order."""
    from django_outbox.transports import nats

    chains = nats._chains

    def backwards(*args: Any, **kwargs: Any) -> list[Any]:
        return [chain[::-1] for chain in chains(*args, **kwargs)]

    nats._chains = backwards  # type: ignore[assignment]


def _replace_query(name: str, sql: str) -> None:
    """Replace the named query ``name`` of queries.sql with ``sql``, and forget the
    statements built from the named queries once."""
    from django_outbox.db import postgresql, queries

    named = queries._queries()
    if name not in named:
        raise ValueError(f"--sabotage: queries.sql has no {name} query to replace")
    named[name] = sql
    postgresql._claim_sql.cache_clear()
    postgresql._backlog_sql.cache_clear()
    postgresql._finalize_sql.cache_clear()


@contextlib.contextmanager
def _no_inbox(consumer: str, event_id: object, using: str = "default") -> Iterator[bool]:
    """``process_once`` without the mark: every delivery counts as new."""
    with transaction.atomic(using=using):
        yield True


def _unguarded_task_runner() -> None:
    """The Django task runner without its guards: ``process_once`` a plain transaction
    that always runs the task, and no finished result skipped at the start."""
    from django_outbox.tasks import runner as taskrunner

    taskrunner.process_once = _no_inbox  # type: ignore[assignment]
    taskrunner.TASK_FINISHED = ()  # type: ignore[assignment]


def _parking_at_once(init: Callable[..., None]) -> Callable[..., None]:
    """``InboxConsumer.__init__`` with ``max_deliveries=1``: a redelivered message (its
    consumer was killed) is parked before its handler runs."""

    @functools.wraps(init)
    def parking(self: object, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "max_deliveries": 1})

    return parking


def _counted(make: Callable[..., Any]) -> classmethod[Any, ..., Any]:
    """A ``Failure`` constructor for rows not attempted that counts an attempt anyway."""

    @functools.wraps(make)
    def counted(cls: type[Any], *args: Any, **kwargs: Any) -> Any:
        return dataclasses.replace(make(*args, **kwargs), counts=True)

    return classmethod(counted)


def _best_effort() -> None:
    """``stage`` and ``stage_many`` that, when staging fails, let the transaction go on
    and commit: the producer writes its orders with event ids no event has (the dual
    write the outbox exists to prevent). Patched on the package, where the producer
    looks them up (the producer runs as ``__main__``: its own class cannot be patched);
    the Django task's enqueue, which stages too, likewise on :mod:`chaos.djtasks`."""
    import django_outbox

    from .destinations import TASKS_UNAVAILABLE

    stage, stage_many = django_outbox.stage, django_outbox.stage_many

    def one(*args: Any, **kwargs: Any) -> Any:
        return _kept(lambda: stage(*args, **kwargs), lambda: _unsent(1)[0])

    def many(events: Any, *args: Any, **kwargs: Any) -> list[Any]:
        events = list(events)  # a failed call must not have used them up
        return _kept(lambda: stage_many(events, *args, **kwargs), lambda: _unsent(len(events)))

    django_outbox.stage, django_outbox.stage_many = one, many  # type: ignore[assignment]
    if TASKS_UNAVAILABLE is None:
        from . import djtasks

        enqueue = djtasks.enqueue
        djtasks.enqueue = lambda order: _kept(lambda: enqueue(order), lambda: "")


def _kept(call: Callable[[], T], fallback: Callable[[], T]) -> T:
    """``call()`` in a savepoint; when the database fails it, its rollback and
    ``fallback()``, the transaction going on."""
    from django.db import DatabaseError

    try:
        with transaction.atomic():
            return call()
    except DatabaseError as exc:
        print(f"staging failed, orders kept: {exc}".splitlines()[0], file=sys.stderr, flush=True)
        return fallback()


def _unsent(size: int) -> list[Any]:
    """Rows as staging returns them, with event ids no event has."""
    from django_outbox.models import OutboxMessage

    return [OutboxMessage(event_id=uuid.uuid4()) for _ in range(size)]


def _first_address_only() -> None:
    from django_outbox.transports import kombu as transport

    connect = transport.open_connection

    def first_only(url: str, options: Any, **kwargs: Any) -> Any:
        return connect(url.split(";")[0], options, **kwargs)

    transport.open_connection = first_only  # type: ignore[assignment]


def _one_event_id() -> None:
    """Every message the relay's RabbitMQ frames carry gets one event id of the process:
    the consumer's inbox handles the first and takes the others for its copies."""
    from django_outbox.transports.amqp_frames import PublishFrames

    same = str(uuid.uuid4())
    message = PublishFrames.message

    def mixed(self: PublishFrames, method: bytes, body: bytes, headers: Any, _: str) -> bytes:
        return message(self, method, body, {**headers, "event_id": same}, same)

    PublishFrames.message = mixed  # type: ignore[method-assign]
