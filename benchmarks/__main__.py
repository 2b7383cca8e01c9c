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
import sys
import time
from pathlib import Path
from typing import Any

from . import raw
from .report import GATED, table, verdicts
from .services import Services, drop_database, recreate_database, worker_env


@dataclasses.dataclass(frozen=True)
class Profile:
    """How much each scenario does."""

    raw_each: int  # messages published with a confirm each
    raw_batch: int  # messages of the batch-confirm, no-confirm and Redis pipeline ceilings
    relay: int  # the backlog one relay drains (RSS and SQL are measured on it)
    relay_2proc: int
    redis_raw: int  # messages of the kombu Redis ceiling
    redis_relay: int
    staging_rounds: int
    stage_many: int  # events per stage_many / stage() loop transaction
    retained: int  # PUBLISHED rows kept for the second claim measurement
    claim_rows: int  # rows claimed per claim measurement
    e2e_seconds: float
    batch_size: int = 500
    e2e_rate: float = 200.0


PROFILES = {
    "ci": Profile(
        raw_each=1_000,
        raw_batch=10_000,
        relay=10_000,
        relay_2proc=10_000,
        redis_raw=2_000,
        redis_relay=10_000,
        staging_rounds=300,
        stage_many=200,
        retained=100_000,
        claim_rows=5_000,
        e2e_seconds=5,
    ),
    "full": Profile(
        raw_each=10_000,
        raw_batch=100_000,
        relay=200_000,
        relay_2proc=100_000,
        redis_raw=10_000,
        redis_relay=100_000,
        staging_rounds=2_000,
        stage_many=500,
        retained=1_000_000,
        claim_rows=25_000,
        e2e_seconds=30,
    ),
}


def measure(profile: Profile, services: Services, profile_dir: Path | None) -> dict[str, Any]:
    import django

    env = worker_env(services)
    os.environ.update(env)
    recreate_database(services.database_url)
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from . import scenarios

    amqp, redis, batch = services.amqp_url, services.redis_url, profile.batch_size
    figures: dict[str, Any] = {}

    def step(name: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {name}", file=sys.stderr, flush=True)

    step("RabbitMQ ceilings")
    figures["raw_confirm_each_msgs_per_s"] = raw.confirm_each(amqp, profile.raw_each)
    figures["raw_confirm_batch_msgs_per_s"] = raw.confirm_batch(amqp, profile.raw_batch, batch)
    figures["raw_no_confirm_msgs_per_s"] = raw.no_confirm(amqp, profile.raw_batch)
    step(f"relay to RabbitMQ, {profile.relay} events")
    one = scenarios.relay_drain(
        env, amqp, profile.relay, processes=1, batch_size=batch, tag="rabbitmq",
        profile_dir=profile_dir,
    )  # fmt: skip
    figures["relay_rabbitmq_ev_per_s"] = one["events_per_s"]
    figures["relay_vs_raw"] = one["events_per_s"] / figures["raw_confirm_batch_msgs_per_s"]
    figures["rss_start_mb"] = one["rss_start_mb"]
    figures["rss_growth_mb"] = one["rss_growth_mb"]
    figures["sql_per_event"] = one["sql_per_event"]
    figures["sql_statements"] = one["statements"]
    figures["sql_transactions"] = one["transactions"]
    step(f"two relays to RabbitMQ, {profile.relay_2proc} events")
    two = scenarios.relay_drain(
        env, amqp, profile.relay_2proc, processes=2, batch_size=batch, tag="rabbitmq2",
        profile_dir=None,
    )  # fmt: skip
    figures["relay_2proc_ev_per_s"] = two["events_per_s"]
    step("Redis ceilings")
    figures["raw_redis_msgs_per_s"] = raw.kombu_redis(redis, profile.redis_raw)
    figures["raw_redis_pipeline_msgs_per_s"] = raw.redis_pipeline(redis, profile.raw_batch, batch)
    step(f"relay to Redis, {profile.redis_relay} events")
    to_redis = scenarios.relay_drain(
        env, redis, profile.redis_relay, processes=1, batch_size=batch, tag="redis",
        profile_dir=profile_dir,
    )  # fmt: skip
    figures["relay_redis_ev_per_s"] = to_redis["events_per_s"]
    figures["redis_vs_raw"] = to_redis["events_per_s"] / figures["raw_redis_msgs_per_s"]
    figures["redis_vs_pipeline"] = (
        to_redis["events_per_s"] / figures["raw_redis_pipeline_msgs_per_s"]
    )
    step("staging")
    figures.update(scenarios.staging(profile.staging_rounds, profile.stage_many))
    step(f"claim with 1k and {profile.retained} retained rows")
    figures["retained_rows"] = profile.retained
    figures.update(scenarios.claim_growth(profile.retained, profile.claim_rows, batch))
    step(f"end to end at {profile.e2e_rate:g} events/s for {profile.e2e_seconds:g}s")
    figures.update(
        scenarios.end_to_end(env, amqp, rate=profile.e2e_rate, seconds=profile.e2e_seconds)
    )
    from django.db import connections

    connections.close_all()
    drop_database(services.database_url)
    return figures


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
    with Services() as services:
        figures = measure(profile, services, args.pyinstrument)
    figures = {
        "profile": args.profile,
        **figures,
        "batch_size": profile.batch_size,
        "relay_events": profile.relay,
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": load,
        "elapsed_s": time.monotonic() - started,
    }
    results = verdicts(figures)
    print(table(figures, results))
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))
    missed_gates = [name for name in GATED if not results[name]]
    return 1 if args.gate and missed_gates else 0


if __name__ == "__main__":
    sys.exit(main())
