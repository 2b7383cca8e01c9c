"""``run_outbox_consumer`` on a Kafka topic (``django_outbox/consumer/kafka.py``), on the real
three-node KRaft cluster that ``scripts/services kafka start`` runs (``min.insync.replicas=2``;
scripts/test exports ``OUTBOX_KAFKA_URL``). The relay publishes in this process; each
consumer is a real ``manage.py run_outbox_consumer`` process, stopped with real signals,
and the brokers are stopped and killed with real signals too. The file takes about 4.5
minutes (the broker test alone about 2: a node killed and restarted, the whole cluster
stopped and started).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction
from django.test.utils import override_settings

from django_outbox import stage
from django_outbox.models import InboxFailure, OutboxMessage
from django_outbox.relay.loop import Relay
from tests.integration.test_kafka import KAFKA_URL, NEEDS_KAFKA
from tests.support import (
    REPO,
    manage,
    manage_command,
    refused_port,
    relay_env,
    services,
    wait_until,
)
from tests.testapp.models import Delivery

HANDLER = ("--handler", "tests.testapp.handlers.tracked")
SUMMARY = re.compile(
    r"received (?P<received>\d+): handled (?P<handled>\d+), duplicates (?P<duplicates>\d+), "
    r"ignored (?P<ignored>\d+), failed (?P<failed>\d+), parked (?P<parked>\d+), "
    r"rejected (?P<rejected>\d+).*"
)
Status = OutboxMessage.Status

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.kafka,
    pytest.mark.slow,
    # Some stop and kill nodes of the cluster every Kafka test shares.
    pytest.mark.disrupts,
    NEEDS_KAFKA,
]


def routes(topic: str, **route: Any) -> dict[str, Any]:
    """OUTBOX's broker table and routes: the Kafka cluster as the alias "events", and
    ``topic``'s route to it (three replicas)."""
    return {
        "BROKER_URL": None,
        "BROKERS": {
            "default": {"URL": settings.OUTBOX["BROKER_URL"]},
            "events": {"URL": KAFKA_URL},
        },
        "ROUTES": {topic: {"broker": "events", "topic": topic, "replication_factor": 3, **route}},
    }


def relay(topic: str, **route: Any) -> None:
    """Publish every waiting row to ``topic`` (created with ``route``'s partitions)."""
    with override_settings(OUTBOX={**settings.OUTBOX, **routes(topic, **route)}):
        with Relay() as run:

            def settled() -> bool:
                run.run_once()
                waiting = [Status.PENDING, Status.PROCESSING, Status.FAILED]
                return not OutboxMessage.objects.filter(status__in=waiting).exists()

            wait_until(settled, timeout=60, interval=0.05, what="every row published")
    assert not OutboxMessage.objects.exclude(status=Status.PUBLISHED).exists()


@contextlib.contextmanager
def staging(topic: str, **route: Any) -> Iterator[None]:
    """A transaction that stages to ``topic`` as its ``route`` says (an ordered route's
    sequences are given at staging)."""
    with override_settings(OUTBOX={**settings.OUTBOX, **routes(topic, **route)}):
        with transaction.atomic():
            yield


def stage_keyed(topic: str, count: int, keys: int, **route: Any) -> list[str]:
    """Commit ``count`` events to ``topic`` over ``keys`` keys, payload {"n": n}, a user
    header ``tenant``; their event ids."""
    with staging(topic, **route):
        return [
            str(
                stage(
                    "test.event",
                    {"n": n},
                    destination=topic,
                    key=f"k{n % keys}",
                    headers={"tenant": f"t{n % 3}"},
                ).event_id
            )
            for n in range(count)
        ]


def consumer_args(topic: str, group: str, *extra: str) -> list[str]:
    """The options of a consumer of ``topic`` in group ``group`` of that topic (a group
    of its own: consumers of one group id share rebalances whatever their topics)."""
    group = f"{group}-{topic}"
    return ["--broker", "events", "--queue", topic, "--consumer", group, *HANDLER, *extra]


#: The consumers a test started, killed at its end if they still run.
STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_consumer_left_behind() -> Iterator[None]:
    yield
    while STARTED:
        process = STARTED.pop()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def start_consumer(
    topic: str, group: str, *extra: str, env: dict[str, str] | None = None, **route: Any
) -> subprocess.Popen[str]:
    """Start ``run_outbox_consumer`` on ``topic`` as group ``group``, ``env`` on top. Its
    output goes to files, not pipes: a pipe nobody reads while a test waits fills up with
    librdkafka's lines during an outage, and the consumer blocks writing to it."""
    output = tempfile.mkdtemp(prefix="kafka-consumer-")
    with open(f"{output}/out", "w") as out, open(f"{output}/err", "w") as err:
        process = subprocess.Popen(
            manage_command("run_outbox_consumer", *consumer_args(topic, group, *extra)),
            cwd=REPO,
            env={**relay_env(**routes(topic, **route)), **(env or {})},
            stdout=out,
            stderr=err,
            text=True,
        )
    process.output = output  # type: ignore[attr-defined]
    STARTED.append(process)
    return process


def stop(process: subprocess.Popen[str], sig: int = signal.SIGTERM) -> tuple[int, str, str]:
    """Signal ``process`` and wait for it; its exit code, stdout and stderr."""
    process.send_signal(sig)
    code = process.wait(timeout=60)
    output = Path(process.output)  # type: ignore[attr-defined]
    return code, (output / "out").read_text(), (output / "err").read_text()


def run_consumer(
    topic: str, group: str, *extra: str, idle: int = 5, **route: Any
) -> dict[str, int]:
    """Run a consumer until it is idle for ``idle`` seconds; its summary's counts."""
    result = manage(
        "run_outbox_consumer",
        *consumer_args(topic, group, "--idle-timeout", str(idle), *extra),
        **routes(topic, **route),
    )
    assert result.returncode == 0, result.stderr
    return counts(result.stdout)


def counts(out: str) -> dict[str, int]:
    match = SUMMARY.fullmatch(out.strip().splitlines()[-1])
    assert match, out
    return {name: int(value) for name, value in match.groupdict().items()}


def new_topic() -> str:
    return f"consume-{uuid.uuid4().hex[:12]}"


def test_events_are_consumed_once_with_their_keys_and_headers():
    topic = new_topic()
    ids = stage_keyed(topic, 300, keys=30)
    relay(topic, partitions=6)

    first = run_consumer(topic, "g1", partitions=6)
    assert (first["received"], first["handled"], first["duplicates"]) == (300, 300, 0)
    handled = {str(d.event_id): d.consumer.split(" ", 1)[1] for d in Delivery.objects.all()}
    assert handled == {event_id: f"k{n % 30} t{n % 3}" for n, event_id in enumerate(ids)}
    # The offsets were committed: the group reads nothing again.
    again = run_consumer(topic, "g1", partitions=6)
    assert again["received"] == 0


def partition_of(key: str, partitions: int) -> int:
    """The partition Kafka's Java producer (and the relay: ``murmur2_random``) puts ``key`` in:
    ``Utils.murmur2`` of its UTF-8, made positive, modulo ``partitions``."""
    data, m = key.encode(), 0x5BD1E995
    h = (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    whole = len(data) - len(data) % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little") * m & 0xFFFFFFFF
        k = (k ^ k >> 24) * m & 0xFFFFFFFF
        h = (h * m & 0xFFFFFFFF) ^ k
    tail = data[whole:]
    for shift, byte in reversed(list(enumerate(tail))):
        h ^= byte << (8 * shift)
    if tail:
        h = h * m & 0xFFFFFFFF
    h = (h ^ h >> 13) * m & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def handled_n(key: str) -> list[int]:
    """The payload numbers of ``key``'s events, in the order they were handled."""
    return [d.n for d in Delivery.objects.order_by("id") if d.consumer.split(" ")[1] == key]


def test_a_failing_event_pauses_only_its_partition_then_is_parked_and_replayed(tmp_path):
    topic = new_topic()
    failing, other = (
        "kf",
        next(f"o{i}" for i in range(99) if partition_of(f"o{i}", 2) != partition_of("kf", 2)),
    )
    refuse = tmp_path / "refuse"
    refuse.touch()
    with staging(topic):
        bad = stage("test.event", {"n": 0, "fail": True}, destination=topic, key=failing)
        for n in range(1, 6):  # behind it on its partition
            stage("test.event", {"n": n}, destination=topic, key=failing)
    relay(topic, partitions=2)
    env = {"TESTAPP_REFUSE": str(refuse)}
    extra = ("--max-deliveries", "5", "--retry-delay", "2", "--retry-max-delay", "8")
    consumer = start_consumer(topic, "g", *extra, env=env, partitions=2)
    failures = InboxFailure.objects.filter(event_id=bad.event_id, last_error__contains="refuses")
    wait_until(failures.exists, timeout=60, what="a failed delivery", process=consumer)

    # Meanwhile another partition's events are handled; its own partition is paused.
    with staging(topic):
        for n in range(100, 110):
            stage("test.event", {"n": n}, destination=topic, key=other)
    relay(topic, partitions=2)
    wait_until(
        lambda: len(handled_n(other)) == 10,
        timeout=30,
        what="the other partition",
        process=consumer,
    )
    assert failures.get().parked_at is None
    assert handled_n(failing) == []

    # Parked after five deliveries: its partition goes on, in order.
    wait_until(
        lambda: failures.filter(parked_at__isnull=False).exists(),
        timeout=60,
        what="parked",
        process=consumer,
    )
    assert failures.get().attempts == 5
    wait_until(
        lambda: len(handled_n(failing)) == 5,
        timeout=30,
        what="the rest of its partition",
        process=consumer,
    )
    assert handled_n(failing) == [1, 2, 3, 4, 5]

    # Fixed, replayed: handled by the running consumer.
    refuse.unlink()
    replay = manage("outbox_replay_parked", **routes(topic, partitions=2))
    assert replay.returncode == 0, replay.stderr
    wait_until(
        lambda: handled_n(failing)[-1:] == [0],
        timeout=30,
        what="the replayed event",
        process=consumer,
    )
    code, out, err = stop(consumer)
    assert code == 0, err
    summary = counts(out)
    assert (summary["handled"], summary["parked"], summary["failed"]) == (16, 1, 4), out
    assert InboxFailure.objects.get(event_id=bad.event_id).parked_at is None


def test_a_consumer_killed_mid_handler_and_restarted_handles_each_event_once(tmp_path):
    topic = new_topic()
    with staging(topic):
        ids = [
            str(
                stage(
                    "test.event", {"n": n, "block": n == 150}, destination=topic, key=f"k{n % 7}"
                ).event_id
            )
            for n in range(300)
        ]
    relay(topic, partitions=3)
    blocked = tmp_path / "blocked"
    consumer = start_consumer(topic, "g", env={"TESTAPP_BLOCKED": str(blocked)}, partitions=3)
    wait_until(blocked.exists, timeout=60, what="the handler blocked", process=consumer)
    consumer.send_signal(signal.SIGKILL)  # mid-handler, its transaction open
    consumer.wait(timeout=30)
    before = Delivery.objects.count()
    assert 0 < before < 300

    # The group hands the dead one's partitions on after its session timeout (10 s).
    rest = run_consumer(topic, "g", idle=18, partitions=3)  # the handler no longer blocks
    assert rest["handled"] == 300 - before
    assert sorted(str(d.event_id) for d in Delivery.objects.all()) == sorted(ids)


def pids(key: str | None = None) -> collections.Counter[str]:
    return collections.Counter(d.consumer.split(" ")[0] for d in Delivery.objects.all())


def test_two_consumers_of_a_group_share_it_through_rebalances_handling_each_event_once():
    topic = new_topic()
    ids = stage_keyed(topic, 1500, keys=60)
    relay(topic, partitions=6)
    slow = {"TESTAPP_SLEEP": "0.005"}
    first = start_consumer(topic, "g", env=slow, partitions=6)
    wait_until(
        lambda: Delivery.objects.count() >= 200, timeout=60, what="200 handled", process=first
    )
    second = start_consumer(topic, "g", env=slow, partitions=6)  # joins: a rebalance
    wait_until(
        lambda: str(second.pid) in pids(), timeout=60, what="the second one's share", process=second
    )
    code, out, err = stop(first)  # leaves: its partitions go to the second
    assert code == 0, err
    wait_until(
        lambda: Delivery.objects.count() >= 1500, timeout=120, what="every event", process=second
    )
    code, out2, err2 = stop(second)
    assert code == 0, err2
    assert sorted(str(d.event_id) for d in Delivery.objects.all()) == sorted(ids)
    # Each gave its partitions up with their offsets committed: nothing came twice.
    assert counts(out)["duplicates"] == counts(out2)["duplicates"] == 0
    assert counts(out)["handled"] + counts(out2)["handled"] == 1500


def test_per_key_order_holds_across_many_keys_and_a_rebalance():
    topic = new_topic()
    stage_keyed(topic, 2000, keys=100, partitions=6, ordered=True)
    relay(topic, partitions=6, ordered=True)
    slow = {"TESTAPP_SLEEP": "0.002"}
    first = start_consumer(topic, "g", env=slow, partitions=6, ordered=True)
    wait_until(
        lambda: Delivery.objects.count() >= 300, timeout=60, what="300 handled", process=first
    )
    second = start_consumer(topic, "g", env=slow, partitions=6, ordered=True)
    wait_until(
        lambda: Delivery.objects.count() >= 2000, timeout=120, what="every event", process=second
    )
    for process in (first, second):
        code, out, err = stop(process)
        assert code == 0, err
        assert counts(out)["parked"] == 0
    for key in range(100):
        assert handled_n(f"k{key}") == list(range(key, 2000, 100))


def test_on_an_ordered_route_a_parked_event_parks_its_keys_later_ones_and_replay_keeps_order(
    tmp_path,
):
    topic = new_topic()
    same = next(f"o{i}" for i in range(99) if partition_of(f"o{i}", 2) == partition_of("ka", 2))
    refuse = tmp_path / "refuse"
    refuse.touch()
    with staging(topic, partitions=2, ordered=True):
        for n in range(5):
            stage("test.event", {"n": n, "fail": n == 1}, destination=topic, key="ka")
        for n in range(5, 10):  # another key behind them on their partition
            stage("test.event", {"n": n}, destination=topic, key=same)
    relay(topic, partitions=2, ordered=True)
    extra = ("--max-deliveries", "2", "--retry-delay", "0.5", "--retry-max-delay", "1")
    env = {"TESTAPP_REFUSE": str(refuse)}
    consumer = start_consumer(topic, "g", *extra, env=env, partitions=2, ordered=True)
    # Its key's later events cannot come before it on the partition: parked unrun, so
    # the partition goes on instead of waiting for good.
    wait_until(
        lambda: len(handled_n(same)) == 5, timeout=60, what="the partition", process=consumer
    )
    assert handled_n("ka") == [0]
    parked = InboxFailure.objects.filter(parked_at__isnull=False)
    assert parked.count() == 4
    assert parked.filter(last_error__contains="is not handled (parked?)").count() == 3

    refuse.unlink()
    replay = manage("outbox_replay_parked", **routes(topic, partitions=2, ordered=True))
    assert replay.returncode == 0, replay.stderr
    wait_until(
        lambda: len(handled_n("ka")) == 5, timeout=60, what="the replayed ones", process=consumer
    )
    code, out, err = stop(consumer)
    assert code == 0, err
    assert handled_n("ka") == [0, 1, 2, 3, 4]
    assert counts(out)["parked"] == 4


@pytest.fixture
def whole_cluster() -> Iterator[None]:
    """Every node of the cluster running before the test and after it, whatever it did."""
    services("kafka", "start-nodes")
    yield
    services("kafka", "start-nodes")


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def node_pid(n: int) -> int:
    return int((REPO / ".services" / f"k{n}.pid").read_text())


def test_brokers_killed_and_the_cluster_down_while_consuming_lose_nothing(whole_cluster):
    topic = new_topic()
    ids = stage_keyed(topic, 1500, keys=30)
    relay(topic, partitions=3)
    consumer = start_consumer(topic, "g", env={"TESTAPP_SLEEP": "0.01"}, partitions=3)
    wait_until(
        lambda: Delivery.objects.count() >= 100, timeout=60, what="100 handled", process=consumer
    )
    os.kill(node_pid(1), signal.SIGKILL)  # a broker (maybe the group's coordinator) dies
    port = int(KAFKA_URL.partition("://")[2].split(",")[0].rpartition(":")[2])
    wait_until(lambda: not listening(port), timeout=30, what="node 1 gone")
    services("kafka", "start-node", "1")
    wait_until(
        lambda: Delivery.objects.count() >= 600, timeout=120, what="600 handled", process=consumer
    )
    services("kafka", "stop-nodes")  # the whole cluster down ...
    services("kafka", "start-nodes")  # ... and back
    wait_until(
        lambda: Delivery.objects.count() >= 1500, timeout=180, what="every event", process=consumer
    )
    code, _out, err = stop(consumer)
    assert code == 0, err
    assert sorted(str(d.event_id) for d in Delivery.objects.all()) == sorted(ids)
    assert "broker unreachable" in err and "broker reachable again" in err


def test_an_unreachable_cluster_is_waited_for_until_the_idle_timeout():
    url = f"kafka://127.0.0.1:{refused_port()}"
    outbox = {
        "BROKER_URL": None,
        "BROKERS": {"default": {"URL": settings.OUTBOX["BROKER_URL"]}, "events": {"URL": url}},
    }
    result = manage(
        "run_outbox_consumer", *consumer_args("t", "g", "--idle-timeout", "4"), **outbox
    )
    assert result.returncode == 1, result.stderr
    assert f"gave up after 4s without a broker: {url} unreachable" in result.stderr
    assert result.stderr.count("broker unreachable") == 1
