"""Run the chaos suite: ``python -m chaos --profile P [--seed N] [--sabotage K]``, P one of
ci, ci-deleting, ci-partitioned and partitioned (chaos.partitioned), kafka (chaos.kafka),
pg-failover, pg-failover-async (chaos.failover) and soak.

Starts (or reuses) PostgreSQL and RabbitMQ with ``scripts/services``, creates the
database ``outbox_chaos`` afresh, and runs producers, relays and a consumer while
the fault injector works through its schedule. Then it stops the producers, lets
the relays and the consumer drain, stops them with SIGTERM, and audits. Exits 0
when every check passes, 1 when one fails, 2 when the run itself broke. Logs and
the facts of every fault are kept in ``.chaos/<run>/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from benchmarks.services import REPO, Services, drop_database, recreate_database

from . import cluster, failover, jetstream, kafka, partitioned, sabotage
from .destinations import (
    CLUSTERED,
    KAFKA,
    KAFKA_ORDERED,
    KAFKA_TRANSACTIONAL,
    NATS,
    NATS_ORDERED,
    ORDERED,
    ORDERED_KEYS,
    TASK_QUEUE,
    TASKS_UNAVAILABLE,
)
from .disk import Disk
from .processes import HOST, Proc, manage, module, worker_env
from .proxy import Proxy

if TYPE_CHECKING:  # imported once Django is set up
    from .audit import Check
    from .faults import Fault, Injector

DATABASE = "outbox_chaos"
DISK_MB = 512  # the outbox table's tmpfs: room for a 30-minute soak's rows
#: The Celery worker that runs the Django tasks (Django 6): one process (solo pool) on
#: their queue; the runner task acks late, so RabbitMQ redelivers what a killed one held.
TASK_WORKER = module(
    "celery",
    *("-A", "chaos.celery_app", "worker", "--pool", "solo", "--queues", TASK_QUEUE),
    *("--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"),
)
#: The consumers' handler and inbox name (for Kafka also its consumer group).
HANDLER = ("--handler", "chaos.handlers.record", "--consumer", "chaos-audit")
#: The transactional Kafka topic's: a group of its own (one topic per group).
TX_HANDLER = (*HANDLER[:3], "chaos-audit-tx")
#: Seconds the drain waits for one more Django task to finish: more than the 30 s after
#: which a worker tries again a task it could not start (its database was restarting).
TASK_PATIENCE = 60.0


@dataclasses.dataclass(frozen=True)
class Profile:
    seconds: float  # how long faults are injected
    schedule: tuple[str, ...]  # faults every run has, in a seeded order
    seed: int | None  # None: a random seed, printed
    producers: int = 3
    rate: float = 40.0  # events per second per producer, on average
    relays: int = 2
    #: The first relay keeps no PUBLISHED row (it deletes each row at its confirm), and
    #: relay_kill and relay_stop always pick it: its rows go to a relay that keeps them,
    #: so a delete it makes as a zombie finds a row to break (the audit's stale_delete).
    deleting: bool = False
    batch_size: int = 100
    lease: float = 5.0
    gap: tuple[float, float] = (1.0, 4.0)  # seconds of quiet between faults
    #: "sync" or "async": the database is the services' PostgreSQL and a streaming
    #: standby of it, every process connected to both (chaos.failover); such a run has
    #: neither the RabbitMQ cluster nor NATS (their producers, consumer and faults), nor
    #: the tmpfs tablespace (a standby on the same machine would replay it onto the
    #: primary's own directory).
    replication: str = ""
    #: False: the producers stage keyless events only (pg-failover-async: the lost
    #: commits' sequence numbers are given again on the promoted node, and the consumer
    #: parks the events that reuse them and holds their keys, so the run cannot drain).
    ordered: bool = True
    #: The outbox partitioned before traffic starts, and the relays' retention making and
    #: dropping ranges every second (chaos.partitioned); such a run has neither the
    #: clusters nor the tmpfs tablespace (the ranges the relays make are created in the
    #: default one, and a partitioned table takes no fillfactor).
    partitioned: bool = False

    @property
    def clusters(self) -> bool:
        """Whether the run has the RabbitMQ cluster and the NATS cluster."""
        return not self.replication and not self.partitioned

    @property
    def tablespace(self) -> bool:
        """Whether the outbox table lives on the tmpfs tablespace (the disk_full fault)."""
        return not self.replication and not self.partitioned

    #: The Kafka cluster, its destinations (a producer, a consumer) and its faults.
    kafka: bool = False
    #: What relay_kill aims at, kill after kill (None: chaos.faults.AIMS).
    aims: tuple[str, ...] | None = None


#: The ci profile's schedule.
CI_FAULTS = (
    *("relay_kill",) * 2,
    "relay_stop",
    "rabbitmq_restart",
    "postgres_restart",
    "postgres_crash",
    "consumer_kill",
    "cluster_leader_restart",
    *jetstream.KINDS,
    "memory_alarm",
    "redis_oom",
    "net_delay",
    "net_partition",
    "disk_full",
    "task_worker_kill",  # left out without Django's tasks (Django 5.2)
)
#: About two and a half minutes: the ci faults that need neither the clusters nor the
#: tmpfs, on an outbox partitioned into ranges of a few hundred ids, which the relays make
#: ahead and drop (after 5 s of retention) while the faults go on (chaos.partitioned).
PARTITIONED = Profile(
    seconds=0,
    schedule=tuple(
        kind for kind in CI_FAULTS if kind not in (*cluster.KINDS, *jetstream.KINDS, "disk_full")
    ),
    seed=20261130,
    rate=20.0,
    partitioned=True,
    aims=("held", "handled"),  # no NATS rows: the third aim's kill needs them
)
PROFILES = {
    # About four minutes: relay kills twice, every other kind of fault once (of the
    # cluster's, the leader's node; the task worker's on Django 6 only; the NATS cluster's
    # three), in an order fixed
    # by the seed (the soak repeats them all). At 20 events/s per producer, so that the
    # one consumer keeps up on a busy 2-core machine and each recovery is the fault's,
    # not a backlog's.
    "ci": Profile(
        seconds=0,
        schedule=CI_FAULTS,
        seed=20261121,
        rate=20.0,
    ),
    # About a minute and a half, after ci: the first relay deletes the rows the broker
    # confirmed (PUBLISHED_RETENTION 0), the second marks them PUBLISHED; the first is
    # killed, stopped as a zombie (its rows taken over by the second) and sees its
    # database crash.
    "ci-deleting": Profile(
        seconds=0,
        schedule=("relay_kill", "relay_stop", "postgres_crash"),
        seed=20261128,
        rate=20.0,
        deleting=True,
    ),
    "partitioned": PARTITIONED,
    # Under a minute: ci-deleting's three faults on the partitioned outbox, short enough
    # for CI beside ci and ci-deleting (42 s on 2026-11-30, 3 ranges dropped with rows).
    "ci-partitioned": dataclasses.replace(
        PARTITIONED, schedule=("relay_kill", "relay_stop", "postgres_crash")
    ),
    # About a minute and a half each: the primary SIGKILLed mid-traffic and its standby
    # promoted (chaos.failover), with synchronous replication (nothing whose COMMIT
    # returned may be lost) or asynchronous (what is lost is measured). Not in ci: the
    # cluster-free run still takes longer than a minute.
    **{
        name: Profile(
            seconds=0,
            schedule=(failover.KIND,),
            seed=20261129,
            rate=20.0,
            replication=mode,
            ordered=mode == "sync",
        )
        for name, mode in (("pg-failover", "sync"), ("pg-failover-async", "async"))
    },
    # The Kafka cluster's faults, apart from ci (the cluster's start and its faults'
    # recoveries would add minutes to CI): a broker SIGKILLed, one frozen, the whole
    # cluster down, two brokers down (in-sync replicas below the minimum), and a relay
    # SIGKILLed twice, holding Kafka rows the consumer already handled (published, not
    # marked): the transactional route's, then the plain routes'.
    # One producer to the single node, at 10 events/s per producer (Kafka's too): on a
    # machine at a load of 20, ci's three at 20 left the one consumer a backlog of
    # thousands, and each recovery waited minutes for it.
    "kafka": Profile(
        seconds=0,
        schedule=("relay_kill", "relay_kill", *kafka.KINDS),
        seed=20261129,
        producers=1,
        rate=10.0,
        kafka=True,
        aims=("kafka", "transactional"),
    ),
    # Thirty minutes: faults drawn at random until time is up. At 25 events/s per
    # producer: at 50 the one consumer handled no more than was committed (about 120
    # events/s each on this 2-core machine), so its backlog, and each recovery, grew with
    # every fault (49, 57, 76, 85 s in a run stopped after six minutes).
    "soak": Profile(seconds=1800, schedule=(), seed=None, rate=25.0, gap=(3.0, 15.0)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    parser.add_argument("--seed", type=int, help="replay a run (default: the profile's)")
    parser.add_argument(
        "--seconds", type=float, help="inject faults for this long (default: the profile's)"
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="events per second per producer (default: the profile's); lower it on a machine "
        "so busy that the consumer cannot keep up, or every recovery waits for its backlog",
    )
    parser.add_argument(
        "--sabotage",
        choices=sabotage.KINDS,
        help="break a guarantee on purpose (relays ignore the lease token, claim without "
        "the per-key gate, count attempts they did not make or use only the first address "
        "of a failover list; the consumer runs without the inbox; producers commit orders "
        "whose staging failed; the task worker runs Django tasks without the inbox; relays "
        "publish to NATS without Nats-Msg-Id or send a key's NATS messages last first; with "
        "--profile kafka, relays mark Kafka rows PUBLISHED without their delivery report, "
        "partition keys at random, take one replica's acknowledgement, or ignore the Kafka "
        "transactions' record (a committed batch sent again); with --profile "
        "pg-failover, every process commits without waiting for the synchronous standby; with "
        "--profile partitioned or ci-partitioned, relays drop closed ranges of the outbox "
        "whatever their rows): "
        "the audit must then fail",
    )
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    if refused := _refused(args.sabotage, profile):
        parser.error(refused)
    if args.seconds is not None:
        profile = dataclasses.replace(profile, seconds=args.seconds)
    if args.rate is not None:
        profile = dataclasses.replace(profile, rate=args.rate)
    seed = args.seed if args.seed is not None else profile.seed
    if seed is None:
        seed = random.SystemRandom().randrange(1, 2**31)
    print(f"chaos: profile {args.profile}, seed {seed}", flush=True)
    clusters = profile.clusters
    with Services(DATABASE, cluster=clusters, nats=clusters, kafka=profile.kafka) as services:
        return Run(args.profile, profile, seed, services, args.sabotage).main()


def _refused(sabotage: str | None, profile: Profile) -> str:
    """Why ``--sabotage`` cannot break its guarantee in a run of ``profile`` ("": it can)."""
    if sabotage == "tasks" and TASKS_UNAVAILABLE is not None:
        return f"--sabotage tasks needs Django's tasks: {TASKS_UNAVAILABLE}"
    if sabotage == "sync" and profile.replication != "sync":
        return "--sabotage sync needs a synchronous standby: --profile pg-failover"
    if sabotage == "partition-drop" and not profile.partitioned:
        return (
            "--sabotage partition-drop needs a partitioned outbox: --profile partitioned "
            "or ci-partitioned"
        )
    return ""


def _outbox(profile: Profile) -> dict[str, object]:
    """Every process's OUTBOX knobs for a run of ``profile`` (chaos.settings reads them)."""
    return {
        "BATCH_SIZE": profile.batch_size,
        "LEASE_SECONDS": profile.lease,
        "RETRY_BASE_DELAY": 0.5,
        "RETRY_MAX_DELAY": 4,
        "MAX_ATTEMPTS": 1000,  # a long outage must not abandon anything
        "POLL_INTERVAL": 0.5,
        **(partitioned.SETTINGS if profile.partitioned else {}),
    }


class Run:
    def __init__(
        self,
        name: str,
        profile: Profile,
        seed: int,
        services: Services,
        sabotage: str | None,
    ) -> None:
        self.name = name
        self.profile = profile
        self.seed = seed
        self.rng = random.Random(seed)
        self.services = services
        self.logs = REPO / ".chaos" / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-{seed}"
        self.logs.mkdir(parents=True)
        self.outbox = _outbox(profile)
        self.replication = (
            failover.Replication(services, profile.replication, DATABASE)
            if profile.replication
            else None
        )
        url = self.replication.url if self.replication else services.database_url
        self.env = worker_env(url, services.env, json.dumps(self.outbox))
        #: The run's Kafka topics (chaos.kafka; "" without Kafka: its routes are off): the
        #: plain routes', and the transactional route's.
        self.topic = f"{kafka.PREFIX}{self.logs.name}" if profile.kafka else ""
        self.tx_topic = f"{self.topic}{kafka.TRANSACTIONAL}" if profile.kafka else ""
        self.env["CHAOS_KAFKA_TOPIC"] = self.topic
        self.env["CHAOS_KAFKA_TX_TOPIC"] = self.tx_topic
        if sabotage:
            self.env["CHAOS_SABOTAGE"] = sabotage
        self.procs: list[Proc] = []
        self.relays: list[Proc] = []
        #: ``host:pid`` of the relays and consumers running at the end, and of those of
        #: them without a live heartbeat then (the audit's heartbeat lines).
        self.beaten: list[str] = []
        self.unbeating: list[str] = []
        self.producers: list[Proc] = []
        self.consumer: Proc  # of chaos.orders: made by _create_processes
        self.task_worker: Proc | None = None  # Django 6: the Celery worker of the tasks
        self.disk = Disk(services.database_url, DISK_MB)
        broker = urlsplit(services.amqp_url)
        self.proxy = Proxy((broker.hostname or "127.0.0.1", broker.port or 5672))
        # The relays reach RabbitMQ through the proxy, for the network faults.
        proxied = broker._replace(
            netloc=broker.netloc.replace(f":{broker.port}", f":{self.proxy.port}")
        )
        self.relay_env = {**self.env, "OUTBOX_BROKER_URL": urlunsplit(proxied)}

    def main(self) -> int:
        recreate_database(self.services.database_url)
        try:
            if self.replication:
                self.replication.start()
            elif self.profile.tablespace:
                self.disk.create()
            return self._run()
        except Exception as exc:
            print(f"chaos: the run broke: {type(exc).__name__}: {exc}", file=sys.stderr)
            print(f"chaos: logs in {self.logs}", file=sys.stderr)
            return 2
        finally:
            for proc in self.procs:
                proc.cleanup()
            self.proxy.close()
            try:
                if self.replication:  # the primary back, alone, before its database goes
                    self.replication.restore()
                drop_database(self.services.database_url)
            finally:
                self.disk.unmount()

    def _setup_django(self) -> None:
        os.environ.update({**self.env, "CHAOS_ROLE": "runner"})
        os.environ.pop("CHAOS_SABOTAGE", None)  # the runner audits honestly
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        from .database import OUTBOX

        if self.profile.partitioned:
            partitioned.prepare()
        elif self.profile.tablespace:
            self.disk.move(OUTBOX)

    def _run(self) -> int:
        self._setup_django()
        from . import audit
        from . import database as db
        from .faults import Injector, NotRecovered

        audit.reset_queues(self.services.amqp_url)
        audit.reset_redis(self.services.redis_url)
        if self.profile.clusters:
            cluster.reset_queues(self.services.cluster_url, audit.EXCHANGE)
            jetstream.reset_stream(self.services.nats_url)
        if self.topic:
            kafka.reset_topics(self.services.kafka_url, [self.topic, self.tx_topic])
        self._create_processes()
        started = time.monotonic()
        for proc in self.procs:
            proc.start()
        injector = Injector(
            relays=self.relays,
            consumer=self.consumer,
            services=self.services,
            rng=self.rng,
            lease=self.profile.lease,
            started=started,
            proxy=self.proxy,
            disk=self.disk,
            task_worker=self.task_worker,
            zombie=self.relays[0] if self.profile.deleting else None,
            replication=self.profile.replication,
            aims=self.profile.aims,
        )
        self._wait(lambda: db.value(f"SELECT count(*) FROM {db.HANDLED}") > 0, 120, "first event")
        faults: list[Fault] = []
        try:
            self._inject(injector, started, faults)
        except NotRecovered as exc:
            print(f"chaos: FAIL: {exc}; the audit shows what is missing", flush=True)
            if exc.fault is not None:
                faults.append(exc.fault)
            self._finish(faults, started, drain=False)
            return 1
        return self._finish(faults, started, drain=True)

    def _relay_env(self, i: int) -> dict[str, str]:
        """Relay ``i``'s environment. Of two relays or more, the last one's settings order
        no route (chaos.settings): it claims unordered rows alone between whole claims,
        without waiting for those claims' WAL flush. In a ``deleting`` profile the first
        one keeps no PUBLISHED row (PUBLISHED_RETENTION 0): it deletes each row the broker
        confirmed (chaos migration 0006 keeps a copy of each deleted row for the audit)."""
        last = i == self.profile.relays > 1
        env = {**self.relay_env, "CHAOS_ORDERS_NOTHING": "1" if last else "0"}
        if self.profile.deleting and i == 1:
            # No retention pass in a run (its first comes at random within the interval,
            # here 30 years): every row this relay deletes is one whose publish was
            # confirmed.
            keep_none = {"PUBLISHED_RETENTION": 0, "CLEANUP_INTERVAL": 10**9}
            env["CHAOS_OUTBOX"] = json.dumps({**self.outbox, **keep_none})
        return env

    def _create_processes(self) -> None:
        """The relays, the consumers, the producers and (Django 6) the task worker."""
        from .audit import DESTINATION

        p = self.profile
        self.relays = [
            self._proc(f"relay-{i}", manage("run_outbox_relay"), self._relay_env(i))
            for i in range(1, p.relays + 1)
        ]
        self.consumer = self._consumer("consumer", DESTINATION)
        destinations = [DESTINATION] * p.producers
        if p.clusters:
            # The cluster's queue has its own consumer and producer (chaos.cluster).
            self._consumer("consumer-cluster", CLUSTERED)
            # After the single node's producers, the cluster's and the NATS cluster's.
            destinations += [CLUSTERED, NATS]
        if self.topic:
            # So has each Kafka topic (chaos.kafka), its consumer group the inbox's name.
            self._kafka_consumer("consumer-kafka", self.topic, HANDLER)
            self._kafka_consumer("consumer-kafka-tx", self.tx_topic, TX_HANDLER)
            destinations += [KAFKA, KAFKA_TRANSACTIONAL]
        self.producers = [
            self._producer(i, destination) for i, destination in enumerate(destinations, 1)
        ]
        self.disk.producer_logs = [producer.log for producer in self.producers]
        if TASKS_UNAVAILABLE is None:
            self.task_worker = self._proc("task-worker", TASK_WORKER)

    def _inject(self, injector: Injector, started: float, faults: list[Fault]) -> None:
        """Inject the profile's schedule, then faults drawn at random until its time is
        up; each one printed and written to faults.log as it recovers. A kind this run
        cannot have (the task worker's, without Django's tasks) is left out."""
        from .faults import KINDS, SCHEDULED_ONLY

        p = self.profile
        kinds = (*KINDS, *(kafka.KINDS if p.kafka else ()))
        schedule = [kind for kind in p.schedule if kind in (*kinds, *SCHEDULED_ONLY)]
        self.rng.shuffle(schedule)
        with (self.logs / "faults.log").open("w") as facts:
            while schedule or time.monotonic() - started < p.seconds:
                time.sleep(self.rng.uniform(*p.gap))
                kind = schedule.pop(0) if schedule else self.rng.choice(kinds)
                fault = injector.inject(kind)
                faults.append(fault)
                print(fault.line(), flush=True)
                facts.write(fault.line() + "\n")
                facts.flush()

    def _finish(self, faults: list[Fault], started: float, *, drain: bool) -> int:
        """Stop the producers, let the relays, the consumers and the task worker drain
        (not after a fault that never recovered: nothing would), stop them, then audit
        and report; 0 on a pass."""
        from . import audit

        faulting = time.monotonic() - started
        drain_started = time.monotonic()
        tolerated = max((fault.done.tolerated for fault in faults), default=0)
        exits = self._drain_and_stop(drain=drain, after=tolerated)
        drained = time.monotonic() - drain_started
        read = self._read_brokers()
        counted = audit.totals(self.task_worker.log if self.task_worker else None)
        results = self._checks(faults)
        if self.profile.replication:
            told = failover.load_committed(
                [self._told(i) for i in range(1, len(self.producers) + 1)]
            )
            print(f"chaos: the producers were told of {told:,} committed events", flush=True)
            results = failover.checks(self.profile.replication, faults, results)
        print(
            f"chaos: faults for {faulting:.0f}s, drained in {drained:.0f}s, {read:,} messages "
            f"read from the tap; SIGTERM exit codes: "
            + ", ".join(f"{role} {code}" for role, code in exits.items()),
            flush=True,
        )
        workers = {f"{HOST}:{pid}": f"{r.role} (pid {pid})" for r in self.relays for pid in r.pids}
        for line in [*audit.relay_fault_copies(faults, workers), *audit.violations()]:
            print(f"chaos: {line}")
        text = audit.report(
            profile=self.name,
            seed=self.seed,
            seconds=time.monotonic() - started,
            faults=faults,
            counted=counted,
            results=results,
        )
        print(text, flush=True)
        (self.logs / "report.txt").write_text(text + "\n")
        failed = [check.name for check in results if not check.ok]
        failed += [f"{role} exited {code}" for role, code in exits.items() if code != 0]
        if failed:
            print(f"chaos: FAIL: {'; '.join(failed)} (logs in {self.logs})", flush=True)
            return 1
        print(f"chaos: PASS (logs in {self.logs})", flush=True)
        return 0

    def _checks(self, faults: list[Fault]) -> list[Check]:
        """The audit's checks of the run's destinations, heartbeats and partitions."""
        from . import audit

        results = audit.checks(faults, self.profile.relays, self.profile.batch_size)
        results += audit.nats_checks(faults) if self.profile.clusters else []
        results += audit.kafka_checks(faults) if self.topic else []
        results += audit.heartbeat_checks(self.unbeating, self.beaten)
        if self.profile.partitioned:
            logs = [proc.log for proc in self.producers]
            results += partitioned.checks([relay.log for relay in self.relays], logs)
        return results

    def _read_brokers(self) -> int:
        """Read what the relays published (the taps, Redis's list, the NATS stream, the
        Kafka topic) into ``BrokerCopy``; returns the messages read."""
        from . import audit

        read = audit.drain_tap(self.services.amqp_url)
        read += audit.drain_redis(self.services.redis_url)
        if self.profile.clusters:
            read += audit.drain_tap(self.services.cluster_url, cluster.QUORUM)
            read += jetstream.read(self.services.nats_url)
        for topic in (self.topic, self.tx_topic) if self.topic else ():
            read += kafka.read(self.services.kafka_url, topic)
        return read

    def _drain_and_stop(self, *, drain: bool, after: int = 0) -> dict[str, int]:
        """Stop the producers; with ``drain``, wait until every event is handled (every
        order after ``after``: see chaos.faults.Done) and every Django task finished; wait
        for late duplicates; stop the relays, the consumers and the task worker with
        SIGTERM. Returns the exit codes of the latter."""
        from . import audit
        from . import database as db
        from .faults import wait_down

        for producer in self.producers:
            if producer.stop() != 0:
                raise RuntimeError(f"{producer.role} exited {producer.exits[-1]}")
        if drain:
            timeout = 4 * self.profile.lease + 120
            self._wait(lambda: db.settled(after), timeout, "the relays and the consumer to drain")
        if drain and self.task_worker is not None:
            left = wait_down(db.unfinished_tasks, TASK_PATIENCE)
            if left:
                print(
                    f"chaos: {left} Django tasks unfinished, none finished for "
                    f"{TASK_PATIENCE:.0f}s; the audit counts them",
                    flush=True,
                )
        time.sleep(2 * self.profile.lease)  # late duplicates (a zombie's batch) reach the tap
        consumers = [proc for proc in self.procs if proc.role.startswith("consumer")]
        workers = [self.task_worker] if self.task_worker is not None else []
        beating = [proc.worker for proc in [*self.relays, *consumers] if proc.alive()]
        self.unbeating = audit.not_live(beating)
        exits = {proc.role: proc.stop() for proc in [*self.relays, *consumers, *workers]}
        self.beaten = beating
        return exits

    def _kafka_consumer(self, role: str, topic: str, handler: tuple[str, ...]) -> None:
        argv = ["--broker", "kafka", "--queue", topic, *handler]
        self._proc(role, manage("run_outbox_consumer", *argv))

    def _consumer(self, role: str, queue: str) -> Proc:
        argv = ["--queue", queue, *HANDLER, "--prefetch", "50"]
        return self._proc(role, manage("run_outbox_consumer", *argv))

    def _producer(self, index: int, destination: str) -> Proc:
        """A producer whose keyless events go to ``destination``, the others to the
        ordered destination (NATS's and Kafka's: their own ordered one, on the same stream
        or topic; Kafka's transactional route is both); the cluster's and NATS's at a
        quarter of the rate (what their faults need, and little more load on the database
        and the one consumer of the ordered destination), Kafka's plain routes at the full
        rate (its faults' profile, which runs at half ci's), its transactional one at half.
        With Django's tasks, each of its transactions enqueues one."""
        share = {CLUSTERED: 4, NATS: 4, KAFKA_TRANSACTIONAL: 2}.get(destination, 1)
        rate = self.profile.rate / share
        ordered = {
            NATS: NATS_ORDERED,
            KAFKA: KAFKA_ORDERED,
            KAFKA_TRANSACTIONAL: KAFKA_TRANSACTIONAL,
        }.get(destination, ORDERED)
        return self._proc(
            f"producer-{index}",
            module(
                "chaos.producer",
                *("--index", str(index), "--seed", str(self.seed)),
                *("--rate", str(rate), "--keys", str(ORDERED_KEYS)),
                *("--destination", destination, "--ordered", ordered),
                *(["--tasks"] if TASKS_UNAVAILABLE is None else []),
                *(["--committed", str(self._told(index))] if self.profile.replication else []),
                *([] if self.profile.ordered else ["--keyless"]),
            ),
        )

    def _told(self, index: int) -> Path:
        """Where producer ``index`` writes what it was told committed, outside the database
        (the pg-failover profiles: chaos.failover)."""
        return self.logs / f"committed-{index}.txt"

    def _proc(self, role: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(role, argv, env or self.env, self.logs)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _wait(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")
            time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
