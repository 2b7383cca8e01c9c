"""``python -m benchmarks [--profile ci|full] [--gate] [--pyinstrument DIR]``

Starts the services with ``scripts/services`` (and stops the ones it started),
measures the raw broker ceilings and then the relay on the same broker with the
same message, prints a table, and prints as its last line one JSON object.
With ``--gate`` it exits 1 when a deterministic figure misses its goal (timings
never gate). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import raw
from .report import GATED, table, verdicts
from .services import NAMES, Services, drop_database, recreate_database

DATABASE = "outbox_bench"
#: The relay processes of the fairness scenario.
FAIRNESS_RELAYS = 4


def worker_env(services: Services) -> dict[str, str]:
    """The environment of the runner's Django and of every worker it starts."""
    return {
        **os.environ,
        **services.env,
        "DJANGO_SETTINGS_MODULE": "benchmarks.settings",
        "OUTBOX_BENCH_DATABASE_URL": services.database_url,
        "PYTHONUNBUFFERED": "1",
    }


@dataclasses.dataclass(frozen=True)
class Profile:
    """How much each scenario does."""

    rounds: int  # alternations of a raw ceiling and the relay, for the ratios
    round_events: int  # per round: the RabbitMQ batch-confirm ceiling's messages, the relay's
    redis_raw: int  # per round: messages of the kombu Redis ceiling
    redis_relay: int  # per round: events the relay drains to Redis
    raw_each: int  # messages published with a confirm each
    relay: int  # the large backlog one relay drains (RSS and SQL are measured on it)
    relay_2proc: int
    staging_rounds: int
    stage_many: int  # events per stage_many / stage() loop transaction
    retained: int  # PUBLISHED rows kept for the second claim measurement
    retention_rows: int  # expired PUBLISHED rows one retention pass removes (deleted, dropped)
    partitioned_retained: int  # PUBLISHED rows kept for the partitioned outbox's second claim
    claim_rows: int  # rows claimed per claim measurement
    horizon_rows: int  # rows drained by claims with a snapshot held, and without
    horizon_batch: int  # their claims' batch size
    e2e_seconds: float  # at e2e_rate
    e2e_1000_seconds: float  # at 1,000 events/s, e2e_1000_per_commit to a transaction
    e2e_1000_single_seconds: float  # the same, one event a transaction (0: left out)
    ordered_events: int  # per round: events drained unordered, then ordered over 1,000 keys
    hot_key: int  # events of one key drained by one relay
    fairness_events: int  # the backlog four relays drain together (relay_fairness)
    fairness_batch: int  # their batch size: shares move by whole batches
    scheduled: int  # events scheduled a day ahead for the second claim measurement
    scheduled_seconds: float  # events coming due at 1,000 a second for so long
    kafka_events: int  # per round: records of the confluent-kafka ceiling, events of each drain
    #: Commit to a NATS consumer at 1,000 events/s for so long (0: left out).
    nats_e2e_seconds: float
    #: Commit to a Kafka consumer at 1,000 events/s for so long (0: left out).
    kafka_e2e_seconds: float
    batch_size: int = 500
    e2e_rate: float = 200.0
    e2e_1000_per_commit: int = 10
    ordered_keys: int = 1_000


PROFILES = {
    "ci": Profile(
        rounds=3,
        round_events=4_000,
        redis_raw=1_000,
        redis_relay=4_000,
        raw_each=1_000,
        relay=10_000,
        relay_2proc=10_000,
        staging_rounds=300,
        stage_many=200,
        retained=100_000,
        retention_rows=50_000,
        partitioned_retained=100_000,
        claim_rows=5_000,
        horizon_rows=20_000,
        horizon_batch=100,
        e2e_seconds=5,
        e2e_1000_seconds=5,
        e2e_1000_single_seconds=0,
        ordered_events=4_000,
        hot_key=3_000,
        fairness_events=20_000,
        fairness_batch=100,
        scheduled=100_000,
        scheduled_seconds=5,
        kafka_events=4_000,
        nats_e2e_seconds=5,
        kafka_e2e_seconds=5,
    ),
    "full": Profile(
        rounds=5,
        round_events=20_000,
        redis_raw=5_000,
        redis_relay=20_000,
        raw_each=10_000,
        relay=200_000,
        relay_2proc=100_000,
        staging_rounds=2_000,
        stage_many=500,
        retained=1_000_000,
        retention_rows=1_000_000,
        partitioned_retained=10_000_000,
        claim_rows=25_000,
        horizon_rows=200_000,
        horizon_batch=500,
        e2e_seconds=30,
        e2e_1000_seconds=20,
        e2e_1000_single_seconds=20,
        ordered_events=20_000,
        hot_key=20_000,
        fairness_events=100_000,
        fairness_batch=500,
        scheduled=1_000_000,
        scheduled_seconds=20,
        kafka_events=20_000,
        nats_e2e_seconds=20,
        kafka_e2e_seconds=20,
    ),
}


def _step(name: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)


def _rounds(
    rounds: int, ceiling: Callable[[], float], relay: Callable[[], float]
) -> tuple[float, float, list[float]]:
    """Alternate the raw ceiling and the relay ``rounds`` times, so that a noisy spell
    hits a ceiling and the relay measured next to it alike. Returns the median ceiling,
    the median relay rate, and each round's relay/ceiling ratio."""
    ceilings, rates = [], []
    for _ in range(rounds):
        ceilings.append(ceiling())
        rates.append(relay())
    ratios = [rate / top for rate, top in zip(rates, ceilings, strict=True)]
    return statistics.median(ceilings), statistics.median(rates), ratios


def measure(
    profile: Profile, services: Services, profile_dir: Path | None, only: str | None = None
) -> dict[str, Any]:
    import django

    env = worker_env(services)
    os.environ.update(env)
    recreate_database(services.database_url)
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    try:
        if only == "partitioning":
            return _partitioning(profile)
        if only in BROKERS:
            return BROKERS[only](profile, env, _drainer(env, profile))
        return _scenarios(profile, env, services, profile_dir)
    finally:
        from django.db import connections

        connections.close_all()
        drop_database(services.database_url)


def _drainer(env: dict[str, str], profile: Profile) -> Callable[..., Any]:
    """``drain(url, count, tag, processes=1, **options)``: relays draining ``count``
    events to ``url`` (:func:`benchmarks.scenarios.relay_drain`), in batches of the
    profile's size unless ``batch_size`` says otherwise."""
    from . import scenarios

    def drain(url: str, count: int, tag: str, processes: int = 1, **kwargs: Any) -> Any:
        kwargs.setdefault("batch_size", profile.batch_size)
        return scenarios.relay_drain(env, url, count, processes=processes, tag=tag, **kwargs)

    return drain


def _scenarios(
    profile: Profile, env: dict[str, str], services: Services, profile_dir: Path | None
) -> dict[str, Any]:
    from . import horizon, scenarios

    amqp, redis = services.amqp_url, services.redis_url
    figures: dict[str, Any] = {}
    drain = _drainer(env, profile)

    _step("RabbitMQ: a confirm per message; no confirms")
    figures["raw_confirm_each_msgs_per_s"] = raw.confirm_each(amqp, profile.raw_each)
    figures["raw_no_confirm_msgs_per_s"] = raw.no_confirm(amqp, profile.round_events)
    figures.update(_rabbitmq_rounds(profile, amqp, drain))
    _step(f"RabbitMQ: one relay drains {profile.relay} events")
    large = drain(amqp, profile.relay, "rabbitmq-large", profile_dir=profile_dir)
    figures["relay_large_ev_per_s"] = large["events_per_s"]
    figures["rss_start_mb"] = large["rss_start_mb"]
    figures["rss_growth_mb"] = large["rss_growth_mb"]
    figures["sql_per_event"] = large["sql_per_event"]
    figures["sql_statements"] = large["statements"]
    figures["sql_transactions"] = large["transactions"]
    _step(f"RabbitMQ: two relays drain {profile.relay_2proc} events")
    two = drain(amqp, profile.relay_2proc, "rabbitmq2", 2)
    figures["relay_2proc_ev_per_s"] = two["events_per_s"]
    figures.update(_fairness(profile, amqp, drain))
    figures.update(_redis(profile, redis, drain, profile_dir))
    figures.update(_nats(profile, env, drain))
    figures.update(_kafka(profile, env, drain))
    _step("staging")
    figures.update(scenarios.staging(profile.staging_rounds, profile.stage_many))
    _step(f"claim with 1k and {profile.retained} retained rows")
    figures["retained_rows"] = profile.retained
    figures.update(scenarios.claim_growth(profile.retained, profile.claim_rows, profile.batch_size))
    _step(f"claim draining {profile.horizon_rows} rows with a snapshot held open, and without")
    figures.update(horizon.claim_under_held_horizon(profile.horizon_rows, profile.horizon_batch))
    figures.update(_scheduled(profile, env, amqp))
    figures.update(_ordering(profile, amqp, drain))
    figures.update(_telemetry(profile, amqp, drain))
    figures.update(_signing(profile, amqp, drain))
    figures.update(_cloudevents(profile, amqp, redis, drain))
    figures.update(_end_to_end(profile, env, amqp))
    figures.update(_partitioning(profile))  # last: it leaves the outbox table partitioned
    return figures


def _partitioning(profile: Profile) -> dict[str, Any]:
    """Retention of one period's expired rows by row deletion and by a partition dropped,
    and the claim on a partitioned outbox (:mod:`benchmarks.partitioned`). The outbox
    table stays partitioned after it."""
    from . import partitioned

    rows, retained = profile.retention_rows, profile.partitioned_retained
    _step(f"retention of {rows} expired rows: deleted, then a partition dropped")
    figures = partitioned.retention_by_partition(rows)
    _step(f"claim on a partitioned outbox with 1k and {retained} retained rows")
    figures.update(
        partitioned.partitioned_claim_growth(retained, profile.claim_rows, profile.batch_size)
    )
    _step(f"claim draining {profile.horizon_rows} rows of a partitioned outbox, a snapshot held")
    figures.update(partitioned.held_horizon(profile.horizon_rows, profile.horizon_batch))
    return figures


def _scheduled(profile: Profile, env: dict[str, str], amqp: str) -> dict[str, Any]:
    """The claim of due rows with events scheduled a day ahead against the same with
    none (``scheduled_claim_growth``), and how late events coming due at 1,000 a second
    are published (``scheduled_lateness_*``)."""
    from . import scenarios

    _step(f"{profile.rounds} x claim with none and {profile.scheduled} scheduled a day ahead")
    figures: dict[str, Any] = {"scheduled_rows": profile.scheduled}
    figures.update(
        scenarios.scheduled_claim_growth(
            profile.scheduled, profile.claim_rows, profile.batch_size, profile.rounds
        )
    )
    _step(f"events coming due at 1,000/s for {profile.scheduled_seconds:g}s")
    figures.update(
        scenarios.scheduled_lateness(env, amqp, rate=1_000.0, seconds=profile.scheduled_seconds)
    )
    return figures


def _end_to_end(profile: Profile, env: dict[str, str], amqp: str) -> dict[str, Any]:
    """Commit-to-consumer latency at 200 events/s, one event a transaction (figures
    ``e2e_*``), then at 1,000 (``e2e_1000_*``: DESIGN.md's goal is stated at that rate),
    ``e2e_1000_per_commit`` events a transaction, and in the full profile one
    (``e2e_1000_single_*``: more commits than this machine's two cores make)."""
    from . import scenarios

    figures: dict[str, Any] = {}
    for name, rate, seconds, per_commit in (
        ("e2e", profile.e2e_rate, profile.e2e_seconds, 1),
        ("e2e_1000", 1_000.0, profile.e2e_1000_seconds, profile.e2e_1000_per_commit),
        ("e2e_1000_single", 1_000.0, profile.e2e_1000_single_seconds, 1),
    ):
        if not seconds:
            continue
        _step(f"end to end at {rate:g} events/s, {per_commit} a transaction, for {seconds:g}s")
        figures.update(
            scenarios.end_to_end(
                env, amqp, rate=rate, seconds=seconds, name=name, per_commit=per_commit
            )
        )
    return figures


def _rabbitmq_rounds(profile: Profile, amqp: str, drain: Callable[..., Any]) -> dict[str, Any]:
    """The relay to RabbitMQ against the batch-confirm ceiling, alternated over rounds:
    their rates, their CPU per message (the relay process's, all its threads, against
    the raw publisher's thread), and what the relay's drains cost PostgreSQL per event
    (medians of the rounds)."""
    from . import pgcost

    count = profile.round_events
    _step(f"RabbitMQ: {profile.rounds} x (batch-confirm ceiling, relay), {count}")
    ceilings: list[raw.Ceiling] = []
    relays: list[dict[str, Any]] = []

    def ceiling() -> float:
        ceilings.append(raw.confirm_batch(amqp, count, profile.batch_size))
        return ceilings[-1].msgs_per_s

    def relay() -> float:
        relays.append(drain(amqp, count, "rabbitmq"))
        return float(relays[-1]["events_per_s"])

    top, rate, ratios = _rounds(profile.rounds, ceiling, relay)
    relay_cpu = [run["cpu_us_per_event"] for run in relays]
    raw_cpu = [run.cpu_us_per_msg for run in ceilings]
    cpu_ratios = [mine / theirs for mine, theirs in zip(relay_cpu, raw_cpu, strict=True)]
    return {
        "raw_confirm_batch_msgs_per_s": top,
        "relay_rabbitmq_ev_per_s": rate,
        "relay_vs_raw": statistics.median(ratios),
        "relay_vs_raw_rounds": ratios,
        "relay_cpu_us_per_event": statistics.median(relay_cpu),
        "raw_cpu_us_per_msg": statistics.median(raw_cpu),
        "relay_cpu_vs_raw": statistics.median(cpu_ratios),
        "relay_cpu_vs_raw_rounds": cpu_ratios,
        **pgcost.medians(relays),
    }


def _redis(
    profile: Profile, redis: str, drain: Callable[..., Any], profile_dir: Path | None
) -> dict[str, Any]:
    """The relay to Redis against kombu's publish per message and redis-py's pipeline,
    both ceilings measured in every round next to the relay's drains: one keeping the
    PUBLISHED rows (the default), one deleting them at their confirm
    (``PUBLISHED_RETENTION`` 0, figures ``*deleting*``), in turn first."""
    from . import pgcost

    _step(f"Redis: {profile.rounds} x (redis-py pipeline and kombu ceilings, relay x 2)")
    pipelines: list[float] = []
    kept: list[dict[str, Any]] = []
    deleted: list[dict[str, Any]] = []

    def ceilings() -> float:
        pipelines.append(raw.redis_pipeline(redis, profile.redis_relay, profile.batch_size))
        return raw.kombu_redis(redis, profile.redis_raw)

    def relay() -> float:
        for keep in (True, False) if len(kept) % 2 == 0 else (False, True):
            runs = kept if keep else deleted
            runs.append(drain(redis, profile.redis_relay, "redis", keep_published=keep))
        return float(kept[-1]["events_per_s"])

    top, rate, ratios = _rounds(profile.rounds, ceilings, relay)
    if profile_dir is not None:
        drain(redis, profile.redis_relay, "redis", profile_dir=profile_dir)
    return {
        "raw_redis_msgs_per_s": top,
        "relay_redis_ev_per_s": rate,
        "redis_vs_raw": statistics.median(ratios),
        "raw_redis_pipeline_msgs_per_s": statistics.median(pipelines),
        **_per_round("redis_vs_pipeline", kept, pipelines),
        "relay_redis_deleting_ev_per_s": statistics.median(r["events_per_s"] for r in deleted),
        **_per_round("redis_deleting_vs_pipeline", deleted, pipelines),
        **_per_round("deleting_vs_keeping", deleted, [r["events_per_s"] for r in kept]),
        **{f"redis_{k}": v for k, v in pgcost.medians(kept).items()},
        **{f"redis_deleting_{k}": v for k, v in pgcost.medians(deleted).items()},
    }


def _nats(profile: Profile, env: dict[str, str], drain: Callable[..., Any]) -> dict[str, Any]:
    """The relay to NATS JetStream against nats-py alone (:mod:`benchmarks.nats`), and
    its commit-to-consumer latency at 1,000 events/s, when ``OUTBOX_NATS_URL`` names a
    cluster; nothing otherwise."""
    from . import nats

    url = _cluster_url("OUTBOX_NATS_URL", "NATS", "nats")
    if not url:
        return {}
    count = profile.redis_relay
    _step(f"NATS: {profile.rounds} x (nats-py ceilings, relay), {count} events each")
    batch = profile.batch_size
    rounds = []
    for _ in range(profile.rounds):
        ceiling, requests = (
            nats.raw_batches(url, count, batch),
            nats.raw_requests(url, count, batch),
        )
        rounds.append((ceiling, requests, drain(url, count, "nats")))
    return {
        **nats.figures(rounds),
        **_latency("NATS", nats.end_to_end, profile, profile.nats_e2e_seconds, env, url),
    }


def _cluster_url(variable: str, what: str, service: str) -> str:
    """The cluster URL in ``variable``, or "" after a step line saying ``what`` is left
    out and which ``scripts/services`` command starts it."""
    url = os.environ.get(variable, "")
    if not url:
        _step(f"{what}: left out (no {variable}: scripts/services {service} start)")
    return url


def _kafka(profile: Profile, env: dict[str, str], drain: Callable[..., Any]) -> dict[str, Any]:
    """The relay to Kafka against confluent-kafka alone (:mod:`benchmarks.kafka`), a
    transactional route against the plain one, and commit-to-consumer latency at 1,000
    events/s, when ``OUTBOX_KAFKA_URL`` names a cluster; nothing otherwise."""
    from . import kafka

    url = _cluster_url("OUTBOX_KAFKA_URL", "Kafka", "kafka")
    if not url:
        return {}
    count = profile.kafka_events
    _step(f"Kafka: {profile.rounds} x (confluent-kafka ceiling, relay, transactional), {count}")
    rounds = [
        (
            kafka.raw_batches(url, count, profile.batch_size),
            drain(url, count, "kafka"),
            drain(url, count, "kafka-eos", transactional=True),
        )
        for _ in range(profile.rounds)
    ]
    return {
        **kafka.figures(rounds),
        **_latency("Kafka", kafka.end_to_end, profile, profile.kafka_e2e_seconds, env, url),
    }


#: The broker scenarios ``--only`` runs alone (PostgreSQL and that cluster).
BROKERS = {"kafka": _kafka, "nats": _nats}


def _latency(
    what: str,
    end_to_end: Callable[..., dict[str, float]],
    profile: Profile,
    seconds: float,
    env: dict[str, str],
    url: str,
) -> dict[str, float]:
    """Commit to a consumer of broker ``what`` at 1,000 events/s for ``seconds``
    (``end_to_end``: :func:`benchmarks.nats.end_to_end` or its Kafka twin); nothing when
    ``seconds`` is 0."""
    if not seconds:
        return {}
    per_commit = profile.e2e_1000_per_commit
    _step(f"{what}: end to end at 1000 events/s, {per_commit} a transaction, for {seconds:g}s")
    return end_to_end(env, url, rate=1_000.0, seconds=seconds, per_commit=per_commit)


def _per_round(name: str, runs: list[dict[str, Any]], bases: list[float]) -> dict[str, Any]:
    """Figure ``name``: the median over the rounds of each drain's events/s against its
    round's ``bases``, each round's in ``name_rounds``."""
    ratios = [run["events_per_s"] / base for run, base in zip(runs, bases, strict=True)]
    return {name: statistics.median(ratios), f"{name}_rounds": ratios}


def _fairness(profile: Profile, amqp: str, drain: Callable[..., Any]) -> dict[str, Any]:
    """Four relays started together drain one backlog: how evenly they share it."""
    from . import scenarios

    events, batch = profile.fairness_events, profile.fairness_batch
    _step(f"RabbitMQ: four relays drain {events} events in batches of {batch}")
    run = drain(amqp, events, "fairness", FAIRNESS_RELAYS, batch_size=batch)
    return {
        "relay_fairness": scenarios.unfairness(run["published_by_relay"]),
        "relay_fairness_published": run["published_by_relay"],
        "relay_4proc_ev_per_s": run["events_per_s"],
    }


def _telemetry(profile: Profile, amqp: str, drain: Callable[..., Any]) -> dict[str, Any]:
    """The relay to RabbitMQ with metrics and tracing on against the same relay without,
    alternated over rounds (DESIGN.md: at most 5% slower)."""
    _step(f"RabbitMQ: {profile.rounds} x (relay, relay with metrics and tracing)")
    plain, traced, ratios = _rounds(
        profile.rounds,
        lambda: drain(amqp, profile.round_events, "plain")["events_per_s"],
        lambda: drain(amqp, profile.round_events, "telemetry", telemetry=True)["events_per_s"],
    )
    return {
        "relay_plain_ev_per_s": plain,
        "relay_telemetry_ev_per_s": traced,
        "telemetry_vs_plain": statistics.median(ratios),
        "telemetry_vs_plain_rounds": ratios,
    }


def _signing(profile: Profile, amqp: str, drain: Callable[..., Any]) -> dict[str, Any]:
    """The relay to RabbitMQ signing every message against the same relay not signing,
    alternated over rounds, and the CPU of one signature measured in process."""
    from . import scenarios

    _step(f"RabbitMQ: {profile.rounds} x (relay, relay signing each message)")
    plain: list[dict[str, Any]] = []
    signed: list[dict[str, Any]] = []

    def run(runs: list[dict[str, Any]], **options: Any) -> float:
        runs.append(drain(amqp, profile.round_events, "signing", **options))
        return float(runs[-1]["events_per_s"])

    _, rate, _ = _rounds(profile.rounds, lambda: run(plain), lambda: run(signed, signed=True))
    cpu = [
        s["cpu_us_per_event"] - p["cpu_us_per_event"] for p, s in zip(plain, signed, strict=True)
    ]
    return {
        "relay_signed_ev_per_s": rate,
        **_per_round("signed_vs_plain", signed, [p["events_per_s"] for p in plain]),
        "signed_cpu_us_per_event_extra": statistics.median(cpu),
        **scenarios.signing_cost(profile.round_events),
    }


def _cloudevents(
    profile: Profile, amqp: str, redis: str, drain: Callable[..., Any]
) -> dict[str, Any]:
    """The relay in the outbox's envelope against the same relay publishing CloudEvents,
    alternated over rounds: binary and structured mode to RabbitMQ, structured to Redis;
    their rates' ratios per round, and each drain's relay CPU per event (median), which a
    busy machine sways less than the rates."""
    count = profile.round_events
    _step(f"CloudEvents: {profile.rounds} x (RabbitMQ outbox, binary, structured; Redis x 2)")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CLOUDEVENTS_DRAINS}
    for _ in range(profile.rounds):
        for name, (broker, envelope) in CLOUDEVENTS_DRAINS.items():
            url = amqp if broker == "rabbitmq" else redis
            runs[name].append(drain(url, count, f"ce-{name}", envelope=envelope))
    plain = [run["events_per_s"] for run in runs["rabbitmq"]]
    redis_plain = [run["events_per_s"] for run in runs["redis"]]
    cpu = {name: [run["cpu_us_per_event"] for run in done] for name, done in runs.items()}
    return {
        **{f"{name}_cpu_us_per_event": statistics.median(cpu[name]) for name in cpu},
        "relay_cloudevents_binary_ev_per_s": statistics.median(
            run["events_per_s"] for run in runs["rabbitmq_binary"]
        ),
        **_per_round("cloudevents_binary_vs_plain", runs["rabbitmq_binary"], plain),
        **_per_round("cloudevents_structured_vs_plain", runs["rabbitmq_structured"], plain),
        **_per_round("redis_cloudevents_vs_plain", runs["redis_cloudevents"], redis_plain),
    }


#: The drains of :func:`_cloudevents`, in each round's order: name -> (broker, envelope).
CLOUDEVENTS_DRAINS = {
    "rabbitmq": ("rabbitmq", "outbox"),
    "rabbitmq_binary": ("rabbitmq", "cloudevents"),
    "rabbitmq_structured": ("rabbitmq", "cloudevents-structured"),
    "redis": ("redis", "outbox"),
    "redis_cloudevents": ("redis", "cloudevents"),
}


def _ordering(profile: Profile, amqp: str, drain: Callable[..., Any]) -> dict[str, Any]:
    """Ordered against unordered relay throughput (alternated rounds), one hot key's
    rate, and the staging cost of an ordered event against an unordered one."""
    from . import scenarios

    count, keys = profile.ordered_events, profile.ordered_keys
    _step(f"ordered: {profile.rounds} x (unordered, ordered over {keys} keys), {count}")
    ordered_runs = []

    def ordered() -> float:
        ordered_runs.append(drain(amqp, count, "ordered", keys=keys))
        return float(ordered_runs[-1]["events_per_s"])

    plain, rate, ratios = _rounds(
        profile.rounds, lambda: drain(amqp, count, "unordered")["events_per_s"], ordered
    )
    _step(f"ordered: one relay drains {profile.hot_key} events of one key")
    hot = drain(amqp, profile.hot_key, "hot-key", keys=1)
    _step("ordered: staging")
    return {
        "relay_unordered_ev_per_s": plain,
        "relay_ordered_ev_per_s": rate,
        "ordered_vs_unordered": statistics.median(ratios),
        "ordered_vs_unordered_rounds": ratios,
        "ordered_sql_per_event": max(run["sql_per_event"] for run in ordered_runs),
        "hot_key_ev_per_s": hot["events_per_s"],
        **scenarios.ordered_staging(profile.staging_rounds),
    }


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="The outbox benchmark; see docs/benchmarks.md."
    )
    parser.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="ci",
        help="ci: a few minutes; full: 100k+ events, 1M retained rows (default: %(default)r)",
    )
    parser.add_argument(
        "--gate",
        action="store_true",
        help=f"exit 1 if a deterministic figure ({', '.join(GATED)}) misses its goal",
    )
    parser.add_argument(
        "--only",
        choices=["partitioning", *BROKERS],
        default=None,
        help="run these scenarios alone (partitioning: PostgreSQL only; kafka, nats: "
        "PostgreSQL and that cluster; default: all)",
    )
    parser.add_argument(
        "--pyinstrument",
        type=Path,
        metavar="DIR",
        default=None,
        help="profile the single relay drains with pyinstrument into DIR (default: off)",
    )
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    if args.pyinstrument is not None:
        args.pyinstrument.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load = os.getloadavg()[0]
    names = ("postgres",) if args.only else NAMES
    with Services(DATABASE, names=names) as services:
        figures = measure(profile, services, args.pyinstrument, args.only)
    figures = {
        "profile": args.profile,
        **figures,
        "batch_size": profile.batch_size,
        "relay_events": profile.relay,
        "rounds": profile.rounds,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": load,
        "elapsed_s": time.monotonic() - started,
    }
    results = verdicts(figures)
    print(table(figures, results, only=args.only is not None))
    print(json.dumps({name: _rounded(value) for name, value in figures.items()}))
    # A figure --only left out is not measured; in a whole run, a gated figure missing fails.
    missed_gates = [name for name in GATED if not results.get(name, args.only is not None)]
    if args.gate and missed_gates:
        print(f"benchmarks: gate failed: {', '.join(missed_gates)} missed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
