"""Kafka: what the relay writes, read by clients nobody here wrote.

Apache Kafka's own console consumer (``org.apache.kafka.tools.consumer.ConsoleConsumer``,
from the jars the cluster runs: scripts/services fetches ``kafka-tools`` with the broker)
and kcat (librdkafka's console client, a Debian package scripts/test installs) each read a
topic the relay published to from its beginning, ``read_committed``. Each must see every
event with its key, its headers and its value exactly where Kafka's Java consumer
(tests/support/KafkaRead.java) found it: same partition, same offset, the partition the
Java client's murmur2 partitioner picks for the key, each key's events in commit order.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess

from django.db import transaction
from django.test.utils import override_settings

from django_outbox import stage
from tests.integration.test_kafka import KAFKA_LIB, KAFKA_URL, drain, new_topic, outbox, read
from tests.integration.test_kafka import pytestmark as kafka_marks

pytestmark = kafka_marks

#: One record as a console tool prints it: (partition, offset) -> key, headers, value.
Records = dict[tuple[int, int], tuple[str | None, dict[str, str | None], str]]

#: Separate a tool's printed fields, and its headers: bytes no key, header or payload here holds.
SEP, HEADER_SEP = "\x1f", "\x1e"

EVENTS, KEYS, PARTITIONS = 160, 40, 4  # k0..k39 fall in all four (murmur2 is fixed)


def console_consumer(topic: str, count: int) -> Records:
    """``count`` records of ``topic`` as Kafka's own console consumer prints them."""
    bootstrap = KAFKA_URL.partition("://")[2]
    formatting = [
        f"{name}={value}"
        for name, value in (
            ("print.partition", "true"),
            ("print.offset", "true"),
            ("print.key", "true"),
            ("print.headers", "true"),
            ("key.separator", SEP),
            ("headers.separator", HEADER_SEP),
        )
    ]
    command = [
        "java", "-cp", f"{KAFKA_LIB}/*", "org.apache.kafka.tools.consumer.ConsoleConsumer",
        "--bootstrap-server", bootstrap, "--topic", topic, "--from-beginning",
        "--max-messages", str(count), "--timeout-ms", "30000",
        "--isolation-level", "read_committed",
    ]  # fmt: skip
    for pair in formatting:
        command += ["--formatter-property", pair]
    output = run(command)
    records: Records = {}
    for line in output.split("\n"):  # not splitlines(): it splits at \x1e too
        if not line.startswith("Partition:"):  # a notice of the tool's, not a record
            continue
        partition, offset, headers, key, value = line.split(SEP, 4)
        records[
            (int(partition.removeprefix("Partition:")), int(offset.removeprefix("Offset:")))
        ] = (
            key,
            headers_of(headers.split(HEADER_SEP), ":", null="null"),
            value,
        )
    return records


def kcat(topic: str) -> Records:
    """Every record of ``topic`` as kcat prints it."""
    assert shutil.which("kcat"), (
        "kcat is not installed: apt-get install -y kcat (scripts/test does)"
    )
    bootstrap = KAFKA_URL.partition("://")[2]
    fields = SEP.join(["%p", "%o", "%k", "%h", "%s"])
    output = run(
        ["kcat", "-b", bootstrap, "-C", "-t", topic, "-o", "beginning", "-e", "-q",
         "-X", "isolation.level=read_committed", "-f", fields + "\n"]
    )  # fmt: skip
    records: Records = {}
    for line in output.split("\n"):  # not splitlines(): it splits at \x1e too
        if not line:
            continue
        partition, offset, key, headers, value = line.split(SEP, 4)
        # kcat joins its name=value pairs with commas (no value here holds one).
        records[(int(partition), int(offset))] = (
            key,
            headers_of(headers.split(","), "=", null="NULL"),
            value,
        )
    return records


def headers_of(pairs: list[str], separator: str, null: str) -> dict[str, str | None]:
    """Headers as a tool prints them, each name and value split at the first ``separator``;
    a header without a value (``causation_id`` of an event caused by none) reads ``null``."""
    named = (pair.split(separator, 1) for pair in pairs)
    return {name: None if value == null else value for name, value in named}


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command[0]} exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def test_kafkas_console_consumer_and_kcat_read_every_event_where_javas_client_does():
    topic = new_topic()
    settings_ = outbox(topic, partitions=PARTITIONS, replication_factor=3, ordered=True)
    with override_settings(OUTBOX=settings_):
        with transaction.atomic():
            for n in range(EVENTS):
                stage(
                    "test.event",
                    {"n": n, "text": "naïve, «quoted»"},
                    destination=topic,
                    key=f"k{n % KEYS}",
                    headers={"tenant": "t1"},
                )
        drain()
    java = read(topic, EVENTS)
    assert len(java) == EVENTS
    expected: Records = {
        (r["partition"], r["offset"]): (r["key"], r["headers"], r["value"]) for r in java
    }
    assert all(r["partition"] == r["java_partition"] for r in java)  # murmur2, as Java's
    assert len({r["partition"] for r in java}) == PARTITIONS

    for tool, records in (
        ("console consumer", console_consumer(topic, EVENTS)),
        ("kcat", kcat(topic)),
    ):
        assert records == expected, tool
    # Each key's events in commit order along its partition.
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for _where, (key, headers, value) in sorted(expected.items()):
        assert key == headers["ordering_key"] and headers["tenant"] == "t1"
        by_key[str(key)].append(json.loads(value)["n"])
    assert by_key == {f"k{k}": list(range(k, EVENTS, KEYS)) for k in range(KEYS)}
