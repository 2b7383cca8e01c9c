"""The fault injector: one method per kind of fault, each returning what it saw.

Faults are injected one at a time. Each waits for the system to recover before
the next: recovery is the time from the fault until every order committed before
it ended has been handled by the consumer. A fault after which no such order is
handled for ``recovery_timeout`` seconds fails the run.

Kills are aimed. The injector freezes the process (SIGSTOP), looks at what it
holds (outbox rows under its lease; for the consumer and the task worker, its
transaction in ``pg_stat_activity``), and either kills it there or lets it go on
(SIGCONT) and tries again. So the facts logged are what the process held when it died.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from benchmarks.services import Services

from . import broker, cluster, disk, failover, jetstream, kafka
from . import database as db
from .destinations import TASKS_UNAVAILABLE
from .logs import lease_lost_rows, lines
from .processes import Proc
from .proxy import Proxy

if TYPE_CHECKING:
    from .disk import Disk

T = TypeVar("T")
KINDS = (
    "relay_kill",
    "relay_stop",
    "rabbitmq_restart",
    "postgres_restart",
    "postgres_crash",
    "consumer_kill",
    "memory_alarm",
    "redis_oom",
    "net_delay",
    "net_partition",
    "disk_full",
    *cluster.KINDS,
    *jetstream.KINDS,
    *(("task_worker_kill",) if TASKS_UNAVAILABLE is None else ()),
)
#: Faults only a profile of their own schedules (never drawn at random): pg_failover
#: needs the standby that its profiles start (chaos.failover).
SCHEDULED_ONLY = (failover.KIND,)
POLL = 0.005  # seconds between looks at the outbox while aiming a relay fault
#: What relay_kill aims at, kill after kill: a relay between publish and finalize (rows
#: the consumer handled; NATS rows in the stream), and one holding rows at all. The kafka
#: profile aims at Kafka rows the consumer handled (read from the topic): "kafka", and
#: "transactional", rows of the transactional route the consumer handled (committed in a
#: Kafka transaction, not yet marked).
AIMS = ("held", "handled", "stored")
MAX_TRIES = 50  # freezes of a process before a fault lands wherever it is
#: Faults after which a relay may have given a batch up: a finalize that failed (the
#: database down or its disk full) leaves its rows PROCESSING under the relay's name until
#: their lease expires, and the relay holds them no more.
DATABASE_FAULTS = frozenset({"postgres_restart", "postgres_crash", "disk_full"})


class NotRecovered(Exception):
    """The system did not recover from a fault in time: the run fails. ``fault`` is
    the fault, when it was injected (not when a fault method itself gave up)."""

    fault: Fault | None = None


@dataclasses.dataclass(frozen=True)
class Done:
    """What a fault method did: to whom, when it ended, how to describe it once the
    system recovered, the rows a relay held when signalled, (a zombie) how many
    of them it did not report as lease lost, the attempts spent on rows while a broker
    or network fault lasted, (a full disk) the order ids committed meanwhile, and (a
    cluster node's restart, a NATS node's kill) 1 when the runner's event was not
    published while the node was down, and (a relay kill) how many of the rows it held
    were NATS rows already in the stream, and how many Kafka rows the consumer had
    already handled, of them how many the transactional route's; (two Kafka brokers
    down) how many events staged then were
    published before they were back; and (a failover with asynchronous replication)
    the last order id before the promoted node's own: an order up to it may have been
    handled on the lost primary alone, its message acknowledged, and never be handled
    again (the audit measures it), so neither the recovery nor the drain waits for those."""

    target: str
    ended: float
    facts: Callable[[], str]
    held_ids: list[int] = dataclasses.field(default_factory=list)
    unreported: int = 0
    spent: int = 0
    orders: tuple[int, int] | None = None
    stranded: int = 0
    stored: int = 0
    tolerated: int = 0
    in_topic: int = 0
    transactional: int = 0
    short: int = 0


@dataclasses.dataclass(frozen=True)
class Fault:
    """A fault injected: its kind, when (seconds since the run started), how long
    the system took to recover, what was seen, and what the fault method did."""

    kind: str
    at: float
    recovery: float
    facts: str
    done: Done

    @property
    def target(self) -> str:
        return self.done.target

    def line(self) -> str:
        return (
            f"[{self.at:7.1f}s] {self.kind:<24} {self.target:<9} "
            f"recovered in {self.recovery:5.1f}s: {self.facts}"
        )


class Injector:
    def __init__(
        self,
        *,
        relays: list[Proc],
        consumer: Proc,
        services: Services,
        rng: random.Random,
        lease: float,
        started: float,
        proxy: Proxy,
        disk: Disk,
        task_worker: Proc | None = None,
        zombie: Proc | None = None,
        replication: str = "",
        aims: tuple[str, ...] | None = None,
    ) -> None:
        self.aims = aims or AIMS
        self.proxy = proxy
        #: The profile's replication ("sync", "async"; "": no standby): chaos.failover.
        self.replication = replication
        #: The relay relay_kill kills and relay_stop stops (None: one at random each time).
        self.zombie = zombie
        self.task_worker = task_worker
        self.disk = disk
        self.relays = relays
        self.consumer = consumer
        self.services = services
        self.rng = rng
        self.lease = lease
        self.started = started
        self.recovery_timeout = 4 * lease + 90
        self._kills = 0
        self._handled_up_to = 0  # every order up to this id was handled at a recovery
        #: The database's time once the last of the DATABASE_FAULTS recovered.
        self._database_back: dt.datetime | None = None

    def inject(self, kind: str) -> Fault:
        method: Callable[[], Done] = getattr(self, kind)
        at = time.monotonic()
        done = method()
        self._handled_up_to = max(self._handled_up_to, done.tolerated)
        try:
            recovery = self._recovered(at, done.ended)
        except NotRecovered as exc:  # the audit still needs what the fault did
            exc.fault = Fault(kind, at - self.started, time.monotonic() - at, str(exc), done)
            raise
        if kind in DATABASE_FAULTS:
            self._database_back = db.now()
        return Fault(kind, at - self.started, recovery, done.facts(), done)

    def _recovered(self, at: float, ended: float) -> float:
        """Wait until the orders committed before ``ended`` are all handled. On a busy
        machine the consumer may have a backlog to work through, so what fails the
        run is no progress: ``recovery_timeout`` seconds without one more handled."""
        mark = db.last_order()
        left = wait_down(
            lambda: db.unhandled(mark, self._handled_up_to), self.recovery_timeout, since=ended
        )
        if left:
            raise NotRecovered(
                f"{left} orders committed before the fault still unhandled, and "
                f"none handled for {self.recovery_timeout:.0f}s"
            )
        # An order committed later with a lower id (its transaction was longer) is
        # still checked by the audit at the end; here it only matters for timing.
        self._handled_up_to = mark
        return time.monotonic() - at

    # -- the faults ---------------------------------------------------------------

    def relay_kill(self) -> Done:
        """SIGKILL a relay holding a claim, aimed in turn (AIMS): while it holds rows it
        has published but not yet finalized, which the consumer handled (or the task
        worker ran); while it holds NATS rows the stream already has; while it holds
        rows."""
        relay = self.zombie or self.rng.choice(self.relays)
        pid = relay.pid
        self._kills += 1
        aim = self.aims[self._kills % len(self.aims)]
        if aim == "transactional":
            found = self._kill_after_commit(relay)
        else:
            found = self._freeze_relay(relay, aim=aim)
        tries, ids, handled, stored, (in_topic, committed) = found
        relay.kill()  # SIGKILL ends a stopped process too (a no-op on one killed already)
        relay.start()
        if handled or stored:
            moment = (
                f"between publish and finalize: it held {len(ids)} rows, {handled} of them "
                f"already handled by the consumer (or run by the task worker; {in_topic} "
                f"Kafka rows among them, {committed} of the transactional route), "
                f"{stored} NATS rows already in the stream"
            )
        elif ids:
            moment = f"while it held a claim of {len(ids)} rows the consumer had not seen"
        else:
            moment = "while it held no claim"
        facts = f"SIGKILL pid {pid} {moment} (try {tries}); restarted as pid {relay.pid}"
        return Done(
            relay.role,
            time.monotonic(),
            lambda: facts,
            ids,
            stored=stored,
            in_topic=in_topic,
            transactional=committed,
        )

    def relay_stop(self) -> Done:
        """SIGSTOP a relay holding a claim, until another relay has taken all of it
        over (its lease expired), then SIGCONT it: a zombie that must write nothing."""
        relay = self.zombie or self.rng.choice(self.relays)
        worker, log = relay.worker, relay.log
        lost_before = lease_lost_rows(log)
        tries, ids, *_ = self._freeze_relay(relay, aim="held")
        stopped_at = time.monotonic()
        deadline = stopped_at + 3 * self.lease + 60
        while ids and db.still_held(ids, worker):
            if time.monotonic() > deadline:
                relay.signal(signal.SIGCONT)
                raise NotRecovered(f"no relay took over {relay.role}'s rows while it was stopped")
            time.sleep(0.1)
        taken_over = time.monotonic() - stopped_at
        time.sleep(0.5)
        relay.signal(signal.SIGCONT)
        stopped_for = time.monotonic() - stopped_at
        # The zombie finds out when it finalizes: it must report every row as lost.
        deadline = time.monotonic() + 30
        while lease_lost_rows(log) - lost_before < len(ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        reported = lease_lost_rows(log) - lost_before
        facts = (
            f"SIGSTOP pid {relay.pid} holding {len(ids)} rows (try {tries}) for {stopped_for:.1f}s "
            f"(lease {self.lease:g}s); the other relays had taken all of them over after "
            f"{taken_over:.1f}s; after SIGCONT it logged outbox.lease_lost for {reported} rows"
        )
        unreported = max(0, len(ids) - reported)
        return Done(relay.role, time.monotonic(), lambda: facts, ids, unreported)

    def rabbitmq_restart(self) -> Done:
        ended, facts = self._outage("rabbitmq", "outbox.broker_down", "outbox.broker_up")
        return Done("rabbitmq", ended, facts)

    def postgres_restart(self) -> Done:
        # scripts/services stops PostgreSQL with SIGINT: a fast shutdown.
        ended, facts = self._outage("postgres", "outbox.database_down", "outbox.database_up")
        return Done("postgres", ended, facts)

    def postgres_crash(self) -> Done:
        """An immediate shutdown (SIGQUIT, ``scripts/services crash postgres``), then crash
        recovery: what commits had not written their WAL is lost, as in a crash, among
        them the unordered claims of the relay that orders nothing (which do not wait for
        their flush), whose rows must then be claimed and published again."""
        ended, facts = self._outage(
            "postgres", "outbox.database_down", "outbox.database_up", action="crash"
        )
        return Done("postgres", ended, facts)

    def consumer_kill(self) -> Done:
        """SIGKILL the consumer while its handler's transaction is open: it is frozen
        (SIGSTOP) until ``pg_stat_activity`` shows its connection in a transaction."""
        pid = self.consumer.pid
        tries, state, _ = self._freeze_mid_transaction(self.consumer)
        self.consumer.kill()
        self.consumer.start()
        facts = (
            f"SIGKILL pid {pid} frozen with its database connection {state!r} (try {tries}; "
            f"'idle in transaction' or 'active' is mid-handler); restarted as pid "
            f"{self.consumer.pid}"
        )
        return Done(self.consumer.role, time.monotonic(), lambda: facts)

    def task_worker_kill(self) -> Done:
        """SIGKILL the Celery task worker while it runs a Django task (frozen until its
        connection is in a transaction, as the consumer's), then restart it. It has
        recovered once every task enqueued before the kill has finished: RabbitMQ
        redelivers the messages it held (the runner acks late), so the task it was
        running runs again, a second attempt."""
        worker = self.task_worker
        assert worker is not None, "task_worker_kill needs Django's tasks (Django 6)"
        pid, began = worker.pid, time.monotonic()
        tries, state, running = self._freeze_mid_transaction(worker, running=db.running_tasks)
        worker.kill()
        mark = db.now()
        worker.start()
        left = wait_down(lambda: db.unfinished_tasks(mark), self.recovery_timeout)
        if left:
            raise NotRecovered(
                f"{left} tasks enqueued before the kill not finished, and none finished "
                f"for {self.recovery_timeout:.0f}s"
            )
        finished = time.monotonic() - began
        outcome = ", ".join(f"{s} ({n} attempts)" for s, n in db.task_attempts(running))
        facts = (
            f"SIGKILL pid {pid} frozen with its database connection {state!r} (try {tries}); "
            f"restarted as pid {worker.pid}; the task it was running: {outcome or 'none'}; "
            f"every task enqueued before the kill finished after {finished:.1f}s"
        )
        return Done(worker.role, time.monotonic(), lambda: facts)

    def cluster_leader_restart(self) -> Done:
        return self._node_restart(leader_node=True)

    def cluster_follower_restart(self) -> Done:
        return self._node_restart(leader_node=False)

    def _node_restart(self, *, leader_node: bool) -> Done:
        target, ended, facts, failover = cluster.node_restart(
            self.services, self.rng, leader_node=leader_node
        )
        return Done(target, ended, facts, stranded=int(failover is None))

    def nats_node_kill(self) -> Done:
        return jetstream.node_kill(self)

    def nats_leader_move(self) -> Done:
        return jetstream.leader_move(self)

    def nats_down(self) -> Done:
        return jetstream.cluster_down(self)

    def kafka_broker_kill(self) -> Done:
        return kafka.broker_kill(self)

    def kafka_broker_freeze(self) -> Done:
        return kafka.broker_freeze(self)

    def kafka_down(self) -> Done:
        return kafka.cluster_down(self)

    def kafka_isr_below_min(self) -> Done:
        return kafka.isr_below_min(self)

    def memory_alarm(self) -> Done:
        return broker.memory_alarm(self)

    def redis_oom(self) -> Done:
        return broker.redis_oom(self)

    def net_delay(self) -> Done:
        return broker.net_delay(self)

    def net_partition(self) -> Done:
        return broker.net_partition(self)

    def disk_full(self) -> Done:
        return disk.disk_full(self)

    def pg_failover(self) -> Done:
        return failover.pg_failover(self)

    # -- helpers --------------------------------------------------------------------

    def _freeze(
        self,
        proc: Proc,
        look: Callable[[], T],
        wanted: Callable[[T], object],
        *,
        before: Callable[[], None],
        settle: float = 0.0,
    ) -> tuple[int, T]:
        """SIGSTOP ``proc`` and ``look`` at it (after ``settle`` seconds) until what it
        sees is ``wanted``, letting it go on (SIGCONT) and calling ``before`` between
        tries; after MAX_TRIES it stays frozen wherever it is. Returns the tries and
        what was seen last; ``proc`` is left stopped."""
        tries = 0
        while True:
            tries += 1
            before()
            proc.signal(signal.SIGSTOP)
            time.sleep(settle)
            seen = look()
            if wanted(seen) or tries == MAX_TRIES:
                return tries, seen
            proc.signal(signal.SIGCONT)

    def _freeze_mid_transaction(
        self, proc: Proc, *, running: Callable[[], list[str]] | None = None
    ) -> tuple[int, str | None, list[str]]:
        """Freeze ``proc`` while ``pg_stat_activity`` shows its connection in a
        transaction (its handler or task running) and, with ``running``, while that names
        something (the task worker's RUNNING tasks: not in the transaction that starts
        one). Returns the tries, the state seen last and what ``running`` named."""

        def look() -> tuple[str | None, list[str]]:
            return db.backend_state(proc.application_name), running() if running else []

        def wanted(seen: tuple[str | None, list[str]]) -> bool:
            state, names = seen
            return state in ("idle in transaction", "active") and (running is None or bool(names))

        tries, (state, names) = self._freeze(
            proc, look, wanted, before=lambda: time.sleep(self.rng.uniform(0, 0.05))
        )
        return tries, state, names

    def _freeze_relay(
        self, relay: Proc, *, aim: str
    ) -> tuple[int, list[int], int, int, tuple[int, int]]:
        """Freeze ``relay`` while it holds a claim: with ``aim`` "handled", rows the
        consumer has already handled (or the task worker run); "stored", NATS rows
        already in the stream; "kafka", Kafka rows the consumer handled; "held", any
        (the transactional route's rows: :meth:`_kill_after_commit`). Returns the tries, the rows it
        holds, how many of them were handled, how many were NATS rows in the stream and
        how many were Kafka rows handled (and of them the transactional route's). Rows it
        claimed before the last of the DATABASE_FAULTS recovered are not counted: they
        may be a batch it gave up, which it would rightly not report as lease lost."""
        worker, since = relay.worker, self._database_back
        wanted = {"handled": "handled", "stored": "nats", "kafka": "kafka_handled"}.get(aim, "ids")

        def holding() -> db.Held:
            return db.held(worker, claimed_after=since, lease=self.lease)

        def look() -> db.Held:
            seen = holding()
            # The stream is read only when it is the aim: a read per look is slow.
            stored = seen.nats if aim == "stored" and self._stored(seen.nats) else []
            return seen._replace(nats=stored)

        def until_it_holds_rows() -> None:
            deadline = time.monotonic() + 10
            field = "nats" if aim == "stored" else "ids"
            while not getattr(holding(), field) and time.monotonic() < deadline:
                time.sleep(POLL)

        tries, (ids, handled, _, in_topic, committed, _) = self._freeze(
            relay,
            look,
            lambda seen: getattr(seen, wanted),
            before=until_it_holds_rows,
            # The consumer catches up with what the relay published (Kafka's fetches wait).
            settle=kafka.SETTLE if aim == "kafka" else 0.05,
        )
        return tries, ids, handled, self._stored(holding().nats), (in_topic, committed)

    def _kill_after_commit(self, relay: Proc) -> tuple[int, list[int], int, int, tuple[int, int]]:
        """SIGKILL ``relay`` between a Kafka commit of the transactional route's rows and
        their mark (a moment too short to freeze it in). At each try, once it holds rows
        of that route, lock its rows (``FOR UPDATE``: its mark waits) for up to
        ``TX_SETTLE`` seconds, until the consumer has handled some of them (their
        transaction committed); then SIGKILL it and end its database sessions (a mark
        waiting for the lock would otherwise run once it is released) before releasing
        them. After MAX_TRIES it is killed wherever it is. Returns what
        :meth:`_freeze_relay` does."""
        worker, since = relay.worker, self._database_back

        def holding() -> db.Held:
            return db.held(worker, claimed_after=since, lease=self.lease)

        for tries in range(1, MAX_TRIES + 1):
            deadline = time.monotonic() + 10
            while not (seen := holding()).transactional and time.monotonic() < deadline:
                time.sleep(POLL)
            with db.rows_locked(seen.ids):
                deadline = time.monotonic() + kafka.TX_SETTLE
                while not (seen := holding()).transactional_handled and time.monotonic() < deadline:
                    time.sleep(0.1)
                if seen.transactional_handled or tries == MAX_TRIES:
                    sessions = relay.application_name
                    relay.kill()
                    db.terminate(sessions)
                    break
        ids, handled, nats, in_topic, committed, _ = seen
        return tries, ids, handled, self._stored(nats), (in_topic, committed)

    def _stored(self, event_ids: list[str]) -> int:
        """How many of ``event_ids`` (of NATS rows) the stream has (none without NATS rows:
        a run without the NATS cluster)."""
        if not event_ids:
            return 0
        return jetstream.stored(self.services.nats_url, event_ids)

    def _outage(
        self, service: str, down: str, up: str, action: str = "restart"
    ) -> tuple[float, Callable[[], str]]:
        """Restart (or crash) ``service``; returns when it ended, and how to describe (once
        the system recovered) which processes logged the outage and the recovery."""
        watched = [*self.relays, self.consumer]
        before = {
            proc.role: (len(lines(proc.log, down)), len(lines(proc.log, up))) for proc in watched
        }
        began = time.monotonic()
        self.services.run(action, service)
        ended = time.monotonic()

        def changes() -> dict[str, tuple[int, int]]:
            """Each process's new (down, up) lines since the restart."""
            return {
                proc.role: (
                    len(lines(proc.log, down)) - before[proc.role][0],
                    len(lines(proc.log, up)) - before[proc.role][1],
                )
                for proc in watched
            }

        def facts() -> str:
            # A process backing off may log its recovery after the events flow again.
            deadline = time.monotonic() + 60
            while any(d > u for d, u in changes().values()) and time.monotonic() < deadline:
                time.sleep(0.5)
            seen = [f"{role} {d}/{u}" for role, (d, u) in changes().items()]
            return (
                f"{service} {'crashed' if action == 'crash' else 'stopped'} and started in "
                f"{ended - began:.1f}s; "
                f"{down}/{up} lines: {', '.join(seen)}"
            )

        return ended, facts


def wait_down(count: Callable[[], int], patience: float, *, since: float | None = None) -> int:
    """Wait until ``count()`` is 0; on a busy machine there may be a backlog to work
    through, so what ends the wait early is no progress: ``patience`` seconds (the first
    counted from ``since``, default now) without ``count()`` going down. Returns what is
    left (0: all done)."""
    left = count()
    deadline = (time.monotonic() if since is None else since) + patience
    while left:
        time.sleep(0.2)
        now_left = count()
        if now_left < left:
            deadline = time.monotonic() + patience
        elif time.monotonic() > deadline:
            return now_left
        left = now_left
    return 0
