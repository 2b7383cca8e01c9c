"""A chaos producer: commits business rows with their events until SIGTERM.

    python -m chaos.producer --index N --seed S --rate EVENTS_PER_S --destination D \
        --ordered D2 --keys K [--tasks] [--committed FILE]

Each transaction stages one event (``stage``), a few, or a burst (``stage_many``),
with one ``Order`` per event (and after about 3% of the committed ones, a forged message
goes to the consumer's queue: see :meth:`Producer._forge`). Half of the transactions
stage to ``D``, keyless; the
other half to the ordered destination ``D2``, each event with one of ``K`` keys drawn
at random (so one transaction may hold several events of a key). About 10% of
transactions roll back after staging, and about 5% roll back a savepoint holding one
more order and event (to the same destination); the ids of
rolled-back events are written to ``RolledBack`` after the rollback. With ``--tasks``
(Django 6), each transaction also enqueues one Django task (:mod:`chaos.djtasks`) for
its first order, rolled back with it or committed with it; with ``--keyless``, every
transaction stages keyless events to ``D``; with ``D2`` the same as ``D`` (an ordered
route, which refuses a keyless event), every transaction stages keyed events there. A database
outage (the fault injector restarts PostgreSQL) is waited out: the transaction in
hand is simply lost or committed, and the business table says which. With
``--committed FILE`` (the ``pg-failover`` profiles), the event ids of each transaction
whose COMMIT returned are appended to ``FILE`` and fsynced before the next transaction:
what the application was told, kept where a failover cannot take it back.
"""

from __future__ import annotations

import argparse
import os
import queue
import random
import signal
import sys
import threading
import time
from typing import Any

import django

ROLLBACK_RATE = 0.10
SAVEPOINT_RATE = 0.05
ORDERED_SHARE = 0.5
#: Of the committed transactions, the share after which the producer also forges a message.
FORGE_RATE = 0.03
#: The sequence of a forged event of an ordered key: far ahead of any real one, so that a
#: consumer that does not verify (``--sabotage forgery``) holds it back instead of letting
#: it take a real event's place (which would leave that one unhandled, the run undrained).
FORGED_SEQUENCE = 10**9
#: A key no relay signs with.
FORGER_KEY = b"the-forger's-own-key-of-32-bytes-or-more"


class Rollback(Exception):
    """Raised on purpose to roll a block back."""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--destination", required=True)
    parser.add_argument("--ordered", required=True, help="the ordered destination")
    parser.add_argument("--keys", type=int, required=True, help="its ordering keys")
    parser.add_argument("--tasks", action="store_true", help="a Django task per transaction")
    parser.add_argument("--committed", help="a file for the event ids of each COMMIT returned")
    parser.add_argument(
        "--keyless", action="store_true", help="no transaction to the ordered destination"
    )
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chaos.settings")
    django.setup()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    producer = Producer(
        args.index,
        random.Random(args.seed * 1000 + args.index),
        args.destination,
        ordered=(args.ordered, args.keys),
        tasks=args.tasks,
        committed=args.committed,
        keyless=args.keyless,
    )
    started = time.monotonic()
    while not stop.is_set():
        staged = producer.run_one()
        # Pace to the rate on average; bursts are followed by a longer pause.
        behind = producer.events / args.rate - (time.monotonic() - started)
        stop.wait(max(0.0, behind) if staged else 0.5)
    print(producer.summary(), flush=True)
    return 0


class Producer:
    def __init__(
        self,
        index: int,
        rng: random.Random,
        destination: str,
        *,
        ordered: tuple[str, int],
        tasks: bool = False,
        committed: str | None = None,
        keyless: bool = False,
    ) -> None:
        self.index = index
        #: Where the event ids of each returned COMMIT go (None: nowhere).
        self.told = open(committed, "a", encoding="ascii") if committed else None
        self.rng = rng
        self.destination = destination
        self.ordered, self.keys = ordered
        share = 1.0 if self.ordered == destination else ORDERED_SHARE
        self.ordered_share = 0.0 if keyless else share
        self.tasks = tasks
        self.events = self.committed = self.rolled_back = self.outages = 0
        self.tasks_committed = self.tasks_rolled_back = 0
        self.forger: Forger | None = None

    def run_one(self) -> bool:
        """One transaction; False when the database was unreachable."""
        from django.db import DatabaseError, connection

        try:
            self._transaction()
        except DatabaseError as exc:
            self.outages += 1
            print(f"database error, waiting: {exc}".splitlines()[0], file=sys.stderr, flush=True)
            connection.close()
            return False
        return True

    def _size(self) -> int:
        draw = self.rng.random()
        if draw < 0.5:
            return 1
        if draw < 0.95:
            return self.rng.randint(2, 20)
        return self.rng.randint(100, 300)  # a burst: relays fall behind and claim full batches

    def _transaction(self) -> None:
        from django.db import transaction

        from .models import RolledBack

        size = self._size()
        rollback = self.rng.random() < ROLLBACK_RATE
        savepoint = self.rng.random() < SAVEPOINT_RATE
        ordered = self.rng.random() < self.ordered_share
        staged: list[str] = []
        undone: list[str] = []
        try:
            with transaction.atomic():
                staged = self._stage(size, ordered=ordered)
                if self.tasks:
                    self._enqueue(staged[0])
                if savepoint:
                    try:
                        with transaction.atomic():
                            undone = self._stage(1, ordered=ordered)
                            raise Rollback
                    except Rollback:
                        pass
                if rollback:
                    raise Rollback
        except Rollback:
            undone_kinds = [(e, RolledBack.Kind.SAVEPOINT) for e in undone]
            undone_kinds += [(e, RolledBack.Kind.TRANSACTION) for e in staged]
            RolledBack.objects.bulk_create(
                RolledBack(event_id=e, kind=kind) for e, kind in undone_kinds
            )
            self.rolled_back += len(undone_kinds)
            self.tasks_rolled_back += int(self.tasks)
        else:
            if undone:
                RolledBack.objects.bulk_create(
                    RolledBack(event_id=e, kind=RolledBack.Kind.SAVEPOINT) for e in undone
                )
                self.rolled_back += len(undone)
            self.committed += len(staged)
            self._record(staged)
            self.tasks_committed += int(self.tasks)
            if self.rng.random() < FORGE_RATE:
                self._forge()
        self.events += size

    def _record(self, committed: list[str]) -> None:
        """Append the event ids of a transaction whose COMMIT returned to the producer's
        file, on disk (fsync) before the next transaction begins."""
        if self.told is not None:
            self.told.write("".join(f"{event_id}\n" for event_id in committed))
            self.told.flush()
            os.fsync(self.told.fileno())

    def _forge(self) -> None:
        """Forge one message for the consumer's queue, as anyone who can publish there
        could: keyless, or of an ordered key; unsigned, or signed with a key no relay
        has. Recorded in ``Forged`` first, so the audit knows it whether or not it got
        there; :class:`Forger` publishes it."""
        import json
        import uuid

        from django_outbox.envelope import ReceivedEvent
        from django_outbox.signing import SIGNATURE_HEADER, Keyring

        from .models import Forged

        event_id = uuid.uuid4()
        Forged.objects.create(event_id=event_id)
        headers: dict[str, Any] = {"event_id": str(event_id), "event_type": "chaos.order"}
        if self.rng.random() < ORDERED_SHARE:
            key = f"account-{self.rng.randrange(self.keys):02d}"
            headers.update(destination=self.ordered, ordering_key=key, sequence=FORGED_SEQUENCE)
        body = json.dumps({"producer": self.index, "forged": True})
        if self.rng.random() < 0.5:
            envelope = ReceivedEvent.from_wire(None, headers).envelope(body.encode())
            headers[SIGNATURE_HEADER] = Keyring([FORGER_KEY]).sign(envelope)
        if self.forger is None:
            self.forger = Forger()
            self.forger.start()
        self.forger.messages.put((body, headers))

    @staticmethod
    def _enqueue(order: str) -> None:
        """Enqueue the Django task of ``order`` in the transaction in hand."""
        from . import djtasks  # Django 6 only

        djtasks.enqueue(order)

    def _stage(self, size: int, *, ordered: bool) -> list[str]:
        """Stage ``size`` events and their orders in the current transaction: to the
        ordered destination, each with a key, or keyless to the other."""
        from django_outbox import stage, stage_many

        from .models import Order

        def event(n: int) -> dict[str, Any]:
            payload = {"producer": self.index, "n": self.events + n}
            if not ordered:
                return {"payload": payload, "destination": self.destination}
            key = f"account-{self.rng.randrange(self.keys):02d}"
            return {"payload": payload, "destination": self.ordered, "key": key}

        if size == 1:
            rows = [stage("chaos.order", **event(0))]
        else:
            rows = stage_many({"event_type": "chaos.order", **event(n)} for n in range(size))
        Order.objects.bulk_create(Order(producer=self.index, event_id=row.event_id) for row in rows)
        return [str(row.event_id) for row in rows]

    def summary(self) -> str:
        return (
            f"producer {self.index}: committed {self.committed} events, rolled back "
            f"{self.rolled_back}, database outages {self.outages}; Django tasks committed "
            f"{self.tasks_committed}, rolled back {self.tasks_rolled_back}"
        )


class Forger(threading.Thread):
    """Publishes a producer's forged messages to the consumer's queue, through the default
    exchange, from a thread of its own: a broker that is down or blocks publishers (the
    memory alarm) holds up this thread, never the producer. A broker fault loses the
    message in hand (nothing retries a forgery); those still queued die with the process."""

    def __init__(self) -> None:
        super().__init__(name="forger", daemon=True)
        self.messages: queue.SimpleQueue[tuple[str, dict[str, Any]]] = queue.SimpleQueue()

    def run(self) -> None:
        import amqp
        import kombu
        from django.conf import settings

        from .destinations import QUEUE

        while True:
            body, headers = self.messages.get()
            try:
                with kombu.Connection(settings.OUTBOX["BROKER_URL"], connect_timeout=2) as c:
                    c.Producer().publish(
                        body,
                        routing_key=QUEUE,  # the default exchange: the consumer's queue alone
                        content_type="application/json",
                        content_encoding="utf-8",
                        headers=headers,
                        message_id=headers["event_id"],
                        delivery_mode=2,
                    )
            except (kombu.exceptions.KombuError, amqp.exceptions.AMQPError, OSError) as exc:
                print(f"forged message lost: {exc}".splitlines()[0], file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
