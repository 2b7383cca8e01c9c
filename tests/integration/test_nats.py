"""NATS JetStream (issue 45, the publishing half) on the real three-node cluster
(``scripts/services nats start``; scripts/test starts it for this layer's disrupting
chain): what arrives is read back with nats-py's own JetStream pull subscriber, not with
code of this project.

The relay runs as a subprocess (``run_outbox_relay``) and is killed for real; the
cluster's nodes are killed with SIGKILL and stopped with SIGSTOP (to hold the PubAcks of
a batch back while the test takes its row locks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.core import checks
from django.db import connection, connections, transaction
from django.test import override_settings

from django_outbox import stage
from django_outbox.conf import outbox_settings
from django_outbox.conf.routes import Route
from django_outbox.models import OutboxMessage
from django_outbox.ops.checks import check_brokers, check_routes
from django_outbox.transports.nats import EventLoop, NatsTransport, subject_matches
from tests.support import (
    Producer,
    claimed_message,
    manage,
    refused_port,
    run_relay,
    running,
    services_output,
    stage_events,
    start_relay,
    stop,
    unique_destination,
    wait_until,
)

NATS_URL = os.environ.get("OUTBOX_NATS_URL", "")
SERVERS = [f"nats://{host}" for host in NATS_URL.removeprefix("nats://").split(",")]
nats = pytest.importorskip("nats", reason="nats-py is not installed (the [nats] extra)")

live = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.disrupts,
    pytest.mark.skipif(
        not NATS_URL,
        reason="no NATS cluster: run scripts/services nats start and export its env "
        "(scripts/test does)",
    ),
]

Status = OutboxMessage.Status


# -- reading the stream with nats-py (a client nobody here wrote) ------------------------


def read_stream(stream: str, expected: int, timeout: float = 20) -> list[Any]:
    """Every message of ``stream`` (at least ``expected`` are awaited), through a pull
    consumer of nats-py's, each acked."""

    async def read() -> list[Any]:
        nc = await nats.connect(SERVERS, connect_timeout=2)
        try:
            js = nc.jetstream()
            sub = await js.pull_subscribe(
                ">", durable=f"reader-{uuid.uuid4().hex[:8]}", stream=stream
            )
            got: list[Any] = []
            deadline = asyncio.get_running_loop().time() + timeout
            while asyncio.get_running_loop().time() < deadline:
                try:
                    batch = await sub.fetch(500, timeout=1)
                except TimeoutError:  # (nats-py raises asyncio.TimeoutError too)
                    if len(got) >= expected:
                        break
                    continue
                for message in batch:
                    await message.ack()
                got += batch
            return got
        finally:
            await nc.close()

    return asyncio.run(read())


def stream_info(stream: str) -> Any:
    async def info() -> Any:
        nc = await nats.connect(SERVERS, connect_timeout=2)
        try:
            return await nc.jetstream().stream_info(stream)
        finally:
            await nc.close()

    return asyncio.run(info())


def route_for(destination: str) -> Route:
    found = outbox_settings.route_for(destination)
    assert found is not None
    return found


def create_stream(stream: str, subjects: list[str], **config: Any) -> None:
    """Create ``stream`` (three replicas) with nats-py, ``config`` its other settings."""

    async def create() -> None:
        nc = await nats.connect(SERVERS, connect_timeout=2)
        try:
            js = nc.jetstream()
            await js.add_stream(name=stream, subjects=subjects, num_replicas=3, **config)
        finally:
            await nc.close()

    asyncio.run(create())


def delete_stream(stream: str) -> None:
    async def delete() -> None:
        nc = await nats.connect(SERVERS, connect_timeout=2)
        try:
            await nc.jetstream().delete_stream(stream)
        finally:
            await nc.close()

    asyncio.run(delete())


def stored(stream: str) -> int:
    try:
        return stream_info(stream).state.messages
    except Exception:  # a stream not there yet, or a leader being elected
        return -1


# -- the cluster -----------------------------------------------------------------------


def node_pids() -> dict[int, int]:
    """The running nodes (1-3) and their PIDs, from ``scripts/services nats status``."""
    lines = services_output("nats", "status").splitlines()
    return {
        int(line.split()[2].rstrip(":")): int(line.split()[5])
        for line in lines
        if ": running" in line
    }


@contextlib.contextmanager
def nodes_stopped() -> Iterator[None]:
    """Every node SIGSTOPped (its connections open, nothing answered) until the block ends."""
    pids = list(node_pids().values())
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@pytest.fixture
def route() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """A destination with a stream of three replicas of its own, and the relay's OUTBOX."""
    destination = unique_destination("nats")
    stream = destination.replace("-", "_").upper()
    outbox = {
        "BROKER_URL": None,
        "BROKERS": {"default": {"URL": NATS_URL}},
        "ROUTES": {
            destination: {"subject": f"outbox.{destination}", "stream": stream, "replicas": 3}
        },
        "RETRY_BASE_DELAY": 0.2,
        "RETRY_MAX_DELAY": 1,
        "POLL_INTERVAL": 0.2,
    }
    yield destination, stream, outbox
    assert sorted(node_pids()) == [1, 2, 3], "the test left a node stopped"


def statuses() -> collections.Counter[str]:
    return collections.Counter(OutboxMessage.objects.values_list("status", flat=True))


# -- tests -----------------------------------------------------------------------------


class TestPublishing:
    pytestmark = live

    def test_ids_headers_and_payload_arrive(self, route):
        destination, stream, outbox = route
        with transaction.atomic():
            first = stage(
                "order.placed",
                {"order": 1, "total": "9.50"},
                destination=destination,
                key="order-1",
                headers={"tenant": "acme", "attempt": 2},
            )
        ids = [str(first.event_id), *stage_events(4, destination)]
        run_relay("--drain", **outbox)
        assert statuses() == {Status.PUBLISHED: 5}

        received = read_stream(stream, 5)
        assert [m.headers["Nats-Msg-Id"] for m in received] == ids
        head = received[0]
        assert json.loads(head.data) == {"order": 1, "total": "9.50"}
        assert head.subject == f"outbox.{destination}"
        assert head.headers["event_id"] == ids[0]
        assert head.headers["event_type"] == "order.placed"
        assert head.headers["ordering_key"] == "order-1"
        assert head.headers["correlation_id"] == ids[0]
        assert head.headers["tenant"] == "acme"
        assert head.headers["attempt"] == "2"
        assert head.headers["occurred_at"] == first.created_at.isoformat()
        assert stream_info(stream).config.num_replicas == 3  # created with the route's settings

    def test_an_ordered_route_keeps_each_keys_sequence_in_the_stream(self, route):
        destination, stream, outbox = route
        outbox["ROUTES"][destination]["ordered"] = True
        with override_settings(OUTBOX={**outbox, "ROUTES": outbox["ROUTES"]}):
            stage_events(300, destination, keys=5)
        run_relay("--drain", "--batch-size", "64", **outbox)
        by_key = collections.defaultdict(list)
        for message in read_stream(stream, 300):
            by_key[message.headers["ordering_key"]].append(int(message.headers["sequence"]))
        assert {key: seqs for key, seqs in by_key.items()} == {
            f"k{k}": list(range(1, 61)) for k in range(5)
        }

    def test_an_ordered_keys_events_after_a_failed_one_are_not_sent(self, route):
        """Key a's second event is over max_payload: its third is held back, not sent
        ahead of it (the stream would hold a's events 1 and 3); key b goes on."""
        destination, stream, outbox = route
        outbox["ROUTES"][destination]["ordered"] = True
        big = {"blob": "x" * (1024 * 1024 + 10)}
        with override_settings(OUTBOX={**outbox, "MAX_PAYLOAD_BYTES": 4 * 1024 * 1024}):
            with transaction.atomic():
                for n, payload in enumerate([{"n": 1}, big, {"n": 3}]):
                    stage("e", payload, destination=destination, key="a")
                    stage("e", {"n": n}, destination=destination, key="b")
        manage("run_outbox_relay", "--once", **outbox)
        stored_keys = [
            (m.headers["ordering_key"], int(m.headers["sequence"])) for m in read_stream(stream, 4)
        ]
        assert sorted(stored_keys) == [("a", 1), ("b", 1), ("b", 2), ("b", 3)]
        rows = dict(
            OutboxMessage.objects.filter(ordering_key="a").values_list("sequence", "status")
        )
        assert rows[2] == Status.ABANDONED and rows[3] != Status.PUBLISHED

    def test_an_oversize_message_fails_alone(self, route):
        destination, stream, outbox = route
        big = {"blob": "x" * (1024 * 1024 + 10)}  # over nats-server's max_payload (1 MB)
        with override_settings(OUTBOX={**outbox, "MAX_PAYLOAD_BYTES": 4 * 1024 * 1024}):
            small = stage_events(1, destination)
            with transaction.atomic():
                huge = stage("blob", big, destination=destination)
            small += stage_events(1, destination)
        result = manage("run_outbox_relay", "--drain", **outbox)
        assert result.returncode == 1  # --drain: a row failed
        row = OutboxMessage.objects.get(pk=huge.pk)
        assert row.status == Status.ABANDONED
        assert row.last_error.startswith("MaxPayloadError: the message"), row.last_error
        assert [m.headers["Nats-Msg-Id"] for m in read_stream(stream, 2)] == small

    def test_a_message_whose_headers_take_it_over_max_payload_fails_alone(self, route):
        """The server counts the headers in max_payload (nats-py checks the payload alone):
        a payload just under it with the relay's headers on top fails alone, before it
        is sent, where the server would have closed the connection on it (an outage,
        retried for ever) and the other messages are stored."""
        destination, stream, outbox = route
        blob = "x" * (1024 * 1024 - 60)  # its JSON just under nats-server's max_payload
        with override_settings(OUTBOX={**outbox, "MAX_PAYLOAD_BYTES": 4 * 1024 * 1024}):
            small = stage_events(1, destination)
            with transaction.atomic():
                huge = stage("blob", {"blob": blob}, destination=destination)
            small += stage_events(1, destination)
        assert len(json.dumps({"blob": blob})) < 1024 * 1024  # nats-py alone would send it
        result = manage("run_outbox_relay", "--drain", **outbox)
        assert result.returncode == 1  # --drain: a row failed
        row = OutboxMessage.objects.get(pk=huge.pk)
        assert row.status == Status.ABANDONED
        assert "bytes with its headers) is larger than the server's max_payload" in row.last_error
        assert [m.headers["Nats-Msg-Id"] for m in read_stream(stream, 2)] == small

    def test_a_message_its_stream_refuses_fails_alone_with_the_reason(self, route):
        """A refusal in a PubAck (over the stream's max_msg_size) fails that message alone
        with JetStream's reason, as an attempt (not an outage); the rest are stored."""
        destination, stream, outbox = route
        create_stream(stream, [f"outbox.{destination}"], max_msg_size=1024)
        messages = [claimed_message(n, destination) for n in range(3)]
        messages[1].payload = json.dumps({"blob": "x" * 2000})
        with override_settings(OUTBOX=outbox):
            transport = NatsTransport(NATS_URL, alias="default")
            try:
                outcomes = transport.publish(route_for(destination), messages)
            finally:
                transport.close()
        refused = outcomes[1]
        assert outcomes[0] is None and outcomes[2] is None, outcomes
        assert refused is not None and refused.counts and not refused.outage, refused
        assert refused.error.startswith("JetStream refused the message: "), refused.error
        ids = [m.headers["Nats-Msg-Id"] for m in read_stream(stream, 2)]
        assert ids == [str(messages[0].event_id), str(messages[2].event_id)]

    def test_a_stream_deleted_under_a_connected_relay_makes_its_messages_unroutable(self, route):
        """The stream is gone after the transport checked it: the server answers "no
        responders", and the one probe after the batch tells a missing stream (each
        message unroutable, an attempt) from a stream without a leader (an outage)."""
        destination, stream, outbox = route
        with override_settings(OUTBOX=outbox):
            transport = NatsTransport(NATS_URL, alias="default")
            try:
                first = transport.publish(route_for(destination), [claimed_message(1, destination)])
                delete_stream(stream)
                messages = [claimed_message(n, destination) for n in range(2, 5)]
                outcomes = transport.publish(route_for(destination), messages)
            finally:
                transport.close()
        assert first == [None]
        assert [(o and o.kind, o and o.counts) for o in outcomes] == [("unroutable", True)] * 3
        assert all("is gone" in o.error for o in outcomes if o), outcomes

    def test_a_missing_stream_the_route_may_not_create_waits_without_an_attempt(self, route):
        destination, stream, outbox = route
        outbox["ROUTES"][destination]["create_stream"] = False
        stage_events(2, destination)
        result = manage("run_outbox_relay", "--once", **outbox)
        assert (
            f"JetStream stream {stream!r} of route {destination!r} does not exist" in result.stderr
        )
        assert set(OutboxMessage.objects.values_list("status", "attempts")) == {(Status.FAILED, 0)}

    def test_a_stream_that_does_not_take_the_routes_subject_waits_with_an_error(self, route):
        """The stream exists with other subjects (a wildcard that misses the route's): the
        rows wait without an attempt and the relay says why, not a silent outage."""
        destination, stream, outbox = route
        subjects = [f"{stream}.*", f"{stream}.a.>", f"{destination}.*"]
        create_stream(stream, subjects)
        stage_events(2, destination)
        result = manage("run_outbox_relay", "--once", **outbox)
        assert (
            f"JetStream stream {stream!r} of route {destination!r} takes subjects "
            f"{subjects}, not the route's subject 'outbox.{destination}'" in result.stderr
        ), result.stderr
        assert set(OutboxMessage.objects.values_list("status", "attempts")) == {(Status.FAILED, 0)}

    def test_a_stream_whose_wildcard_takes_the_routes_subject_is_used(self, route):
        destination, stream, outbox = route
        outbox["ROUTES"][destination]["subject"] = f"{stream}.events"
        create_stream(stream, [f"{stream}.*"])
        ids = stage_events(2, destination)
        run_relay("--drain", **outbox)
        assert [m.headers["Nats-Msg-Id"] for m in read_stream(stream, 2)] == ids


class TestFaults:
    pytestmark = live

    def test_a_relay_killed_between_publish_and_mark_leaves_no_duplicate(self, route):
        """The batch's PubAcks are held back (every node SIGSTOPped) until the test has
        locked its claimed rows; then the acks come, the relay's mark waits on the lock,
        and the relay is SIGKILLed there (its database session ended with it). A second
        relay takes the rows over when their lease ends and publishes them again: the
        stream drops them (Nats-Msg-Id)."""
        destination, stream, outbox = route
        outbox["LEASE_SECONDS"] = 9  # PubAcks awaited 3 s; the rows reclaimable after 9 s
        stage_events(1, destination)
        relay = start_relay(**outbox)
        try:
            wait_until(lambda: statuses() == {Status.PUBLISHED: 1}, timeout=30, what="warm-up")
            OutboxMessage.objects.all().delete()
            locker = connections.create_connection("default")
            try:
                with nodes_stopped():
                    ids = stage_events(50, destination)
                    wait_until(
                        lambda: statuses() == {Status.PROCESSING: 50},
                        timeout=2,
                        interval=0.02,
                        what="the batch claimed",
                    )
                    locker.set_autocommit(False)
                    with locker.cursor() as cursor:
                        cursor.execute(
                            f"SELECT id FROM {OutboxMessage._meta.db_table} "
                            "WHERE status = %s FOR SHARE",
                            [Status.PROCESSING],
                        )
                        assert len(cursor.fetchall()) == 50
                # The acks come: the stream holds the batch, the relay's mark waits on the lock.
                wait_until(lambda: stored(stream) == 51, timeout=20, what="the batch stored")
                wait_until(mark_waiting, timeout=20, what="the mark blocked")
                relay.send_signal(signal.SIGKILL)
                relay.communicate(timeout=30)  # (closes its pipes)
                # Its session would finish the waiting UPDATE (and commit it) once the lock
                # is released: PostgreSQL notices a client gone only when it writes to it.
                assert terminate_waiting_marks() == 1
            finally:
                locker.rollback()
                locker.close()
            assert statuses() == {Status.PROCESSING: 50}  # published, never marked
        finally:
            if relay.poll() is None:
                stop(relay)
        again = start_relay(**outbox)
        try:
            wait_until(lambda: statuses() == {Status.PUBLISHED: 50}, timeout=60, what="republished")
        finally:
            code, out, err = stop(again)
        assert code == 0, (out, err)
        assert stored(stream) == 51, "the stream dropped every message it had (Nats-Msg-Id)"
        assert OutboxMessage.objects.filter(attempts__gt=0).count() == 0
        received = [m.headers["Nats-Msg-Id"] for m in read_stream(stream, 51)][1:]
        assert received == ids

    @pytest.mark.slow
    def test_a_node_killed_while_publishing_loses_nothing(self, route):
        destination, stream, outbox = route
        outbox["MAX_ATTEMPTS"] = 1000
        producer = Producer(destination, chunk=20, every=0.05)
        relay = start_relay(**outbox)
        try:
            producer.start()
            wait_until(lambda: stored(stream) >= 200, timeout=60, what="publishing under way")
            leader = stream_info(stream).cluster.leader  # "n1" .. "n3"
            victim = int(leader.removeprefix("n"))
            os.kill(node_pids()[victim], signal.SIGKILL)
            try:
                at = published()
                wait_until(lambda: published() >= at + 300, timeout=60, what="publishing resumed")
            finally:
                services_output("nats", "start-node", str(victim), timeout=120)
            ids = producer.stop()
            wait_until(lambda: published() == len(ids), timeout=120, what="every event published")
        finally:
            producer.stop()
            code, _out, err = stop(relay)
            print(err)
        assert code == 0, err
        received = collections.Counter(
            m.headers["Nats-Msg-Id"] for m in read_stream(stream, len(ids))
        )
        assert set(received) == set(ids), "every committed event is in the stream"
        assert sum(received.values()) == len(ids), "and none twice"
        print(
            f"nats: {len(ids)} events through a SIGKILLed stream leader ({leader}), "
            "0 lost, 0 duplicated"
        )

    def test_the_whole_cluster_down_is_an_outage_that_spends_no_attempt(self, route):
        destination, stream, outbox = route
        outbox["LEASE_SECONDS"] = 6  # PubAcks awaited 2 s
        stage_events(1, destination)
        relay = start_relay(**outbox)
        with running(relay) as ended:
            wait_until(lambda: statuses() == {Status.PUBLISHED: 1}, timeout=30, what="warm-up")
            with nodes_stopped():
                ids = stage_events(20, destination)
                wait_until(
                    lambda: statuses().get(Status.FAILED) == 20, timeout=30, what="the batch failed"
                )
                assert OutboxMessage.objects.filter(attempts__gt=0).count() == 0
            wait_until(lambda: statuses() == {Status.PUBLISHED: 21}, timeout=60, what="published")
        assert "unreachable" in ended.err or "broker_down" in ended.err or "down" in ended.err, (
            ended.err
        )
        assert OutboxMessage.objects.filter(attempts__gt=0).count() == 0
        assert [m.headers["Nats-Msg-Id"] for m in read_stream(stream, 21)][1:] == ids

    def test_a_publish_gives_up_within_the_leases_confirm_budget(self, route):
        """Every node SIGSTOPped before the transport connects (a connection accepted,
        never answered): the publish gives the batch up as an outage at its deadline,
        2 s here, where connecting alone could take 2 s per server and attempt (18 s
        measured before the deadline). The bound asserted, 10 s, leaves a busy machine 8 s
        of slack over the 2 s and still fails the publish without a deadline."""
        destination, _stream, outbox = route
        with override_settings(OUTBOX=outbox):
            transport = NatsTransport(NATS_URL, alias="default", ack_timeout=2)
            messages = [claimed_message(n, destination) for n in range(3)]
            try:
                with nodes_stopped():
                    started = time.monotonic()
                    outcomes = transport.publish(route_for(destination), messages)
                    took = time.monotonic() - started
            finally:
                transport.close()
        assert [(o.outage, o.counts) for o in outcomes] == [(True, False)] * 3, outcomes
        assert took < 10, f"the publish took {took:.1f}s, its budget is 2s"

    def test_an_error_nats_py_does_not_raise_for_the_cluster_is_a_bug_not_an_outage(self, route):
        """A bug cannot be made to order: a subclass stands in for one, raising where the
        stream is checked. It leaves publish() (the relay logs it with its traceback and
        counts an attempt), where it was an outage, retried forever without a word."""
        destination, _stream, outbox = route

        class Buggy(NatsTransport):
            async def _ensure_stream(self, route: Route, jetstream: Any) -> None:
                raise KeyError("a bug")

        with override_settings(OUTBOX=outbox):
            transport = Buggy(NATS_URL, alias="default")
            try:
                with pytest.raises(KeyError, match="a bug"):
                    transport.publish(route_for(destination), [claimed_message(1, destination)])
            finally:
                transport.close()


def terminate_waiting_marks() -> int:
    """End the sessions whose UPDATE of the outbox waits for a lock; how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE wait_event_type = 'Lock' AND query ILIKE %s",
            [f"UPDATE%{OutboxMessage._meta.db_table}%"],
        )
        return cursor.fetchone()[0]


def mark_waiting() -> bool:
    """Whether a session (the relay's) waits for a lock in an UPDATE of the outbox."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query ILIKE %s",
            [f"UPDATE%{OutboxMessage._meta.db_table}%"],
        )
        return cursor.fetchone()[0] > 0


def published() -> int:
    return OutboxMessage.objects.filter(status=Status.PUBLISHED).count()


@pytest.mark.django_db(transaction=True)
def test_a_cluster_refusing_connections_is_an_outage_that_spends_no_attempt():
    """Every address of the URL refuses connections: no attempt spent, no password shown."""
    port = refused_port()
    url = f"nats://outbox:s3cret-pw@127.0.0.1:{port},127.0.0.1:{port}"
    stage_events(3, unique_destination("nats"))
    result = manage(
        "run_outbox_relay", "--once", BROKER_URL=None, BROKERS={"default": {"URL": url}}
    )
    rows = OutboxMessage.objects.values_list("status", "attempts", "last_error")
    assert {(status, attempts) for status, attempts, _ in rows} == {(Status.FAILED, 0)}
    errors = {error for _, _, error in rows}
    assert len(errors) == 1 and "s3cret-pw" not in errors.pop()
    assert "s3cret-pw" not in result.stderr + result.stdout


# -- system checks (no cluster needed) ---------------------------------------------------


def test_jetstream_keys_on_a_rabbitmq_broker_are_an_error():
    outbox = {
        "BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//",
        "ROUTES": {"o": {"subject": "o.x"}},
    }
    with override_settings(OUTBOX=outbox):
        assert check_routes() == [
            checks.Error(
                "Route 'o' has NATS JetStream keys (subject, stream ...), but its broker is "
                "amqp://: they would be ignored.",
                hint="Route it to a nats:// broker, or drop the JetStream keys.",
                id="django_outbox.E070",
            )
        ]


def test_jetstream_keys_on_a_kafka_broker_are_an_error():
    outbox = {"BROKER_URL": "kafka://127.0.0.1:9092", "ROUTES": {"o": {"stream": "O"}}}
    with override_settings(OUTBOX=outbox):
        assert check_routes() == [
            checks.Error(
                "Route 'o' has NATS JetStream keys (subject, stream ...), but its broker is "
                "kafka://: they would be ignored.",
                hint="Route it to a nats:// broker, or drop the JetStream keys.",
                id="django_outbox.E070",
            )
        ]


def test_a_queue_on_a_nats_broker_is_an_error_and_no_exchange_warning():
    outbox = {"BROKER_URL": "nats://127.0.0.1:4222", "ROUTES": {"o": {"queue": "q"}, "p": {}}}
    with override_settings(OUTBOX=outbox):
        assert check_routes() == [
            checks.Error(
                "Route 'o' gives ['queue'], but its broker is nats:// (NATS JetStream), which "
                "publishes to a subject of a stream: they would be ignored.",
                hint='Give the route "subject" and "stream" (each defaults to the destination) '
                "instead.",
                id="django_outbox.E071",
            )
        ]


def test_options_nats_py_does_not_take_are_an_error():
    outbox = {
        "BROKER_URL": None,
        "BROKERS": {"events": {"URL": "nats://127.0.0.1:4222", "OPTIONS": {"tls_hostnme": "x"}}},
    }
    with override_settings(OUTBOX=outbox):
        assert check_brokers() == [
            checks.Error(
                'OUTBOX["BROKERS"]["events"]["OPTIONS"] gives [\'tls_hostnme\'], which '
                "nats-py's connect() does not take: the relay could not connect to this NATS "
                "broker.",
                hint="Give only keyword arguments of nats.connect() there (tls, "
                "user_credentials, token, ...), or drop them.",
                id="django_outbox.E072",
            )
        ]


def test_a_relay_given_options_nats_py_does_not_take_keeps_the_rows_waiting(caplog):
    """The checks skipped: the rows wait (no attempt, not an outage either), and the
    ERROR names the option, where TypeError was an outage retried every second."""
    outbox = {
        "BROKER_URL": None,
        "BROKERS": {"default": {"URL": f"nats://127.0.0.1:{refused_port()}"}},
    }
    with override_settings(OUTBOX=outbox):
        transport = NatsTransport(outbox["BROKERS"]["default"]["URL"], {"tls_hostnme": "x"})
        try:
            outcomes = transport.publish(route_for("o"), [claimed_message(1, "o")])
        finally:
            transport.close()
    [outcome] = outcomes
    assert (outcome.counts, outcome.outage) == (False, False), outcome
    assert "tls_hostnme" in outcome.error
    assert "tls_hostnme" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_run_outbox_consumer_gives_up_on_a_nats_broker_it_cannot_reach_in_one_line():
    """With an idle timeout, a consumer of a NATS cluster that refuses connections gives up
    after that long, the broker's password masked."""
    url = f"nats://outbox:s3cret-pw@127.0.0.1:{refused_port()}"
    result = manage(
        "run_outbox_consumer",
        *("--queue", "orders", "--consumer", "c", "--handler", "tests.testapp.handlers.record"),
        *("--idle-timeout", "2"),
        BROKER_URL=None,
        BROKERS={"default": {"URL": url}},
    )
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "CommandError: gave up after 2s without a broker: "
        f"nats://outbox:***@127.0.0.1:{url.rpartition(':')[2]} unreachable ("
    ), last
    assert "s3cret-pw" not in result.stderr


@pytest.mark.parametrize(
    "pattern, subject, takes",
    [
        ("orders", "orders", True),
        ("orders.*", "orders.eu", True),
        ("orders.*", "orders.eu.x", False),
        ("orders.>", "orders.eu.x", True),
        ("orders.>", "orders", False),
        ("*.eu", "orders.eu", True),
        ("orders", "orders.eu", False),
        ("orders.eu", "orders", False),
    ],
)
def test_a_streams_subjects_match_as_nats_matches_them(pattern, subject, takes):
    assert subject_matches(pattern, subject) is takes


def test_a_hung_event_loop_is_closed_with_its_tasks_cancelled_once_it_returns(caplog):
    """stop() comes while a blocking call holds the loop: its thread is left behind (a
    WARNING says so); once the call returns, the thread cancels the loop's tasks and
    closes the loop, where a stop that gave up on the thread left both open."""
    event_loop = EventLoop()
    release = threading.Event()
    waiting = event_loop.run(_task_waiting_forever(), timeout=5)
    event_loop.loop.call_soon_threadsafe(release.wait)  # the loop hangs here
    try:
        event_loop.stop()
        assert event_loop._thread.is_alive()
        assert "a NATS event loop did not stop" in caplog.text
    finally:
        release.set()
    event_loop._thread.join(timeout=10)
    assert not event_loop._thread.is_alive()
    assert event_loop.loop.is_closed() and waiting.cancelled()


async def _task_waiting_forever() -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(asyncio.sleep(3600))
