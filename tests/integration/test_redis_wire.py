"""The relay's Redis messages (django_outbox/transports/redis_wire.py) on real Redis:
exactly the JSON kombu's own producer writes, read by kombu's consumers and by the
InboxConsumer; and what a batch meets: a routing key no queue is bound to, a header
kombu's JSON cannot encode, a Redis that goes away while the pipeline runs."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import kombu
import pytest
import redis
from kombu.utils.json import JSONEncoder

from django_outbox.conf.routes import Route
from django_outbox.consumer import InboxConsumer
from django_outbox.envelope import CONTENT_ENCODING, CONTENT_TYPE, ClaimedMessage, ReceivedEvent
from django_outbox.exceptions import BrokerRefusesWrites
from django_outbox.transports.base import Failure, unroutable
from django_outbox.transports.declare import binding_key, declare
from django_outbox.transports.kombu import RedisTransport
from tests.integration.test_silent_broker import FreezableProxy
from tests.support import (
    REDIS_URL,
    delete_redis_keys,
    publish_as_kombu,
    redis_maxmemory,
    redis_read_only,
    redis_unable_to_persist,
    unique_destination,
)

#: A delivery tag in a message's JSON: the one part that differs from kombu's own.
DELIVERY_TAG = re.compile(rb'"delivery_tag": "([^"]*)"')


def message(n: int, key: str = "k1", **changes: Any) -> ClaimedMessage:
    claimed = ClaimedMessage(
        id=n,
        event_id=uuid.uuid4(),
        event_type="order.placed",
        destination="orders",
        payload=json.dumps({"n": n, "name": "café ☕"}),
        headers={"tenant": "t1", "note": "ünïcode"},
        ordering_key=key,
        attempts=0,
        created_at=dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC),
    )
    return dataclasses.replace(claimed, **changes)


def batch() -> list[ClaimedMessage]:
    """Messages of every shape the relay sends: plain, ordered (a sequence), a skip
    marker, headers only kombu's JSON encodes, and a second key; most staged at one
    instant (the writer reuses its text), one at the same instant in another zone (a
    different text) and one later."""
    at = message(1).created_at
    return [
        message(1),
        message(2, sequence=7),
        message(3, skipped=True, sequence=8),
        message(4, headers={"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "d": decimal.Decimal(1)}),
        message(5, key="k2"),
        message(6, created_at=at.astimezone(dt.timezone(dt.timedelta(hours=1)))),
        message(7, created_at=at + dt.timedelta(microseconds=1)),
    ]


def routes(name: str) -> dict[str, Route]:
    return {
        "default exchange": Route(name, "", "direct", name, name),
        "direct": Route(name, f"{name}-x", "direct", name, name),
        "topic by key": Route(name, f"{name}-x", "topic", "orders.{key}", name),
    }


@pytest.fixture
def name() -> Iterator[str]:
    """A queue name of the test's own; its Redis keys are deleted afterwards."""
    queue = unique_destination("wire")
    yield queue
    delete_redis_keys(queue)


def lists(name: str) -> dict[bytes, list[bytes]]:
    """The Redis lists whose key holds ``name`` (a queue's, one per priority used), each
    oldest message first, and empty them."""
    client = redis.Redis.from_url(REDIS_URL)
    found = {
        key: client.lrange(key, 0, -1)[::-1]
        for key in client.keys(f"*{name}*")
        if client.type(key) == b"list"
    }
    client.delete(*found, "_")
    client.close()
    return found


def kombu_publish(route: Route, messages: Sequence[ClaimedMessage], options: dict) -> None:
    """What kombu's producer writes for ``messages`` (the relay's publish before it
    wrote Redis's format itself): its own ``Producer.publish``, one message at a time."""
    with kombu.Connection(REDIS_URL, transport_options=options) as connection:
        channel = connection.channel()
        declare(channel, route)
        producer = kombu.Producer(channel, auto_declare=False)
        for claimed in messages:
            publish_as_kombu(producer, route, claimed)


def relay_publish(route: Route, messages: Sequence[ClaimedMessage], **options: Any) -> list:
    transport = RedisTransport(REDIS_URL, options)
    try:
        return transport.publish(route, messages)
    finally:
        transport.close()


@pytest.mark.parametrize("shape", ["default exchange", "direct", "topic by key"])
@pytest.mark.parametrize(
    "options",
    [{}, {"priority_steps": [1, 5]}, {"global_keyprefix": "app:"}],
    ids=["defaults", "priority steps", "key prefix"],
)
def test_the_json_is_kombus_own_to_the_byte_but_the_delivery_tag(name, shape, options):
    """Same lists (a queue's priority list, the key prefix), same messages in the same
    order, byte for byte once the delivery tags (unique per message) are set aside."""
    route, messages = routes(name)[shape], batch()
    assert relay_publish(route, messages, **options) == [None] * len(messages)
    ours = lists(name)
    kombu_publish(route, messages, options)
    theirs = lists(name)
    assert ours.keys() == theirs.keys() and ours
    for key, written in ours.items():
        assert [DELIVERY_TAG.sub(b"", m) for m in written] == [
            DELIVERY_TAG.sub(b"", m) for m in theirs[key]
        ]
    tags = [tag.decode() for ms in ours.values() for m in ms for tag in DELIVERY_TAG.findall(m)]
    assert len(set(tags)) == len(tags) == len(messages)
    assert {uuid.UUID(tag).version for tag in tags} == {4}


def test_each_queue_a_topic_routes_the_key_to_gets_the_message(name):
    route = routes(name)["topic by key"]
    relay_publish(route, [])  # declares the route
    with kombu.Connection(REDIS_URL) as connection:
        exchange = kombu.Exchange(route.exchange, "topic", durable=True)
        kombu.Queue(f"{name}-k2", exchange, routing_key="orders.k2")(connection.channel()).declare()
    messages = batch()
    assert relay_publish(route, messages) == [None] * len(messages)
    found = lists(name)
    ids = {
        key: [json.loads(m)["properties"]["message_id"] for m in ms] for key, ms in found.items()
    }
    assert ids == {
        name.encode(): [str(m.event_id) for m in messages],
        f"{name}-k2".encode(): [str(messages[4].event_id)],
    }


def test_kombus_simple_queue_reads_every_part_of_the_message(name):
    route = routes(name)["topic by key"]
    messages = batch()
    relay_publish(route, messages)
    with kombu.Connection(REDIS_URL) as connection:
        queue = connection.SimpleQueue(name)
        received = [queue.get(timeout=5) for _ in messages]
        for got in received:
            got.ack()
        queue.close()
    for got, sent in zip(received, messages, strict=True):
        assert got.payload == json.loads(sent.wire_payload)
        assert (got.content_type, got.content_encoding) == (CONTENT_TYPE, CONTENT_ENCODING)
        # as kombu's JSON brings them back (a datetime header is a datetime again)
        assert got.headers == kombu.utils.json.loads(kombu.utils.json.dumps(sent.wire_headers()))
        assert got.properties["message_id"] == str(sent.event_id)
        assert (got.properties["delivery_mode"], got.properties["priority"]) == (2, 0)
        assert got.delivery_info["exchange"] == route.exchange
        assert got.delivery_info["routing_key"] == route.routing_key_for(sent.ordering_key)
    assert received[3].headers["at"] == dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.mark.django_db(transaction=True)
def test_the_inbox_consumer_handles_each_event_once_in_order(name):
    route = routes(name)["topic by key"]
    messages = [message(n, headers={"n": n}) for n in range(1, 31)]
    assert relay_publish(route, messages) == [None] * 30
    handled: list[ReceivedEvent] = []
    stats = InboxConsumer(name, handled.append, "wire", url=REDIS_URL).run(idle_timeout=2)
    assert stats.handled == 30
    assert [event.event_id for event in handled] == [m.event_id for m in messages]
    assert [event.payload for event in handled] == [json.loads(m.payload) for m in messages]
    assert [event.headers["n"] for event in handled] == list(range(1, 31))
    assert handled[0].event_type == "order.placed"


def test_a_key_no_queue_is_bound_to_fails_unroutable_and_the_rest_is_sent(name):
    """A direct route whose key comes from the event: its queue is bound for the events
    without a key only."""
    route = Route(name, f"{name}-x", "direct", "{key}", name)
    assert binding_key(route) == ""
    messages = [message(1, key=""), message(2, key="k1"), message(3, key="")]
    outcomes = relay_publish(route, messages)
    assert outcomes == [None, Failure(unroutable(route.exchange, "k1")), None]
    assert outcomes[1].kind == "unroutable"
    written = lists(name)[name.encode()]
    assert [json.loads(m)["properties"]["message_id"] for m in written] == [
        str(messages[0].event_id),
        str(messages[2].event_id),
    ]


def test_a_batch_of_unroutable_keys_only_sends_nothing(name):
    route = Route(name, f"{name}-x", "direct", "{key}", name)
    outcomes = relay_publish(route, [message(1), message(2)])
    assert [outcome.kind for outcome in outcomes] == ["unroutable", "unroutable"]
    assert lists(name) == {}


def test_a_header_kombus_json_cannot_encode_fails_that_message_for_good(name):
    route = routes(name)["topic by key"]
    messages = [message(1), message(2, headers={"bad": object()}), message(3)]
    outcomes = relay_publish(route, messages)
    assert outcomes[0] is None and outcomes[2] is None
    failure = outcomes[1]
    assert (failure.permanent, failure.kind) == (True, "TypeError")
    assert "not JSON serializable" in failure.error
    written = lists(name)[name.encode()]
    assert [json.loads(m)["properties"]["message_id"] for m in written] == [
        str(messages[0].event_id),
        str(messages[2].event_id),
    ]


def test_an_expiring_queue_keeps_its_expiry_renewed_as_kombu_does(name):
    route = dataclasses.replace(
        routes(name)["topic by key"], queue_arguments=(("x-expires", 60_000),)
    )
    assert relay_publish(route, [message(1)]) == [None]
    client = redis.Redis.from_url(REDIS_URL)
    assert 0 < client.pttl(name) <= 60_000
    client.close()


@pytest.mark.parametrize("shape", ["default exchange", "topic by key"])
def test_a_redis_gone_while_the_pipeline_runs_fails_the_whole_batch_and_counts_an_attempt(
    name, shape
):
    """The pipeline was written (on the default exchange; on a topic exchange the read of
    its bindings before it), Redis never answered and then went away: nothing of the
    batch counts as published (the relay retries it: at least once)."""
    upstream = urlsplit(REDIS_URL)
    proxy = FreezableProxy((upstream.hostname or "127.0.0.1", upstream.port or 6379))
    transport = RedisTransport(f"redis://127.0.0.1:{proxy.port}/0")
    route = routes(name)[shape]
    try:
        assert transport.publish(route, [message(1)]) == [None]
        proxy.freeze()  # the batch's bytes go nowhere ...
        threading.Timer(0.5, proxy.close).start()  # ... then its connections are reset
        started = time.monotonic()
        outcomes = transport.publish(route, [message(n) for n in range(2, 12)])
        took = time.monotonic() - started
    finally:
        transport.close()
        proxy.close()
    assert took < 30
    assert len(outcomes) == 10 and all(isinstance(outcome, Failure) for outcome in outcomes)
    assert {(o.permanent, o.counts, o.outage) for o in outcomes} == {(False, True, False)}
    assert "ConnectionError" in outcomes[0].error
    assert len(lists(name)[name.encode()]) == 1  # the first batch only


def test_an_error_reply_fails_its_push_and_leaves_the_connection_in_step(name):
    """An error reply (here WRONGTYPE: the queue's list key holds a string; the batch
    is two LPUSHes of its 501 messages, both refused) fails every message of the
    refused pushes, and the next batch on the same transport is written and counted.
    (The writer reads every reply; redis-py's pool would also drop a connection given
    back with replies unread, so this test cannot tell the two apart.)"""
    route = routes(name)["direct"]
    client = redis.Redis.from_url(REDIS_URL)
    transport = RedisTransport(REDIS_URL)
    later = [message(5), message(6)]
    try:
        assert transport.publish(route, [message(1)]) == [None]  # declares the queue
        client.delete(name)
        client.set(name, "not a list")
        outcomes = transport.publish(route, [message(n, id=n) for n in range(10, 511)])
        client.delete(name)
        assert transport.publish(route, later) == [None, None]
    finally:
        transport.close()
        client.close()
    assert len(outcomes) == 501 and all(isinstance(outcome, Failure) for outcome in outcomes)
    assert "WRONGTYPE" in outcomes[0].error
    written = [json.loads(text)["properties"]["message_id"] for text in lists(name)[name.encode()]]
    assert written == [str(m.event_id) for m in later]


def test_a_refused_push_fails_only_its_own_rows_and_nothing_is_pushed_twice(name):
    """A batch to two lists (the default exchange routes each key to the queue of its
    name), one of them a string (WRONGTYPE): the good list's messages are published,
    the other's fail and count an attempt; their retry (the list still wrong) pushes
    nothing again to the good list. (Before: the whole batch failed though the good
    pushes took effect, and each retry pushed them again.)"""
    good, bad = f"{name}-good", f"{name}-bad"
    route = Route(name, "", "direct", "{key}", None)
    client = redis.Redis.from_url(REDIS_URL)
    client.set(bad, "not a list")
    batch = [message(1, key=good), message(2, key=bad), message(3, key=good), message(4, key=bad)]
    try:
        outcomes = relay_publish(route, batch)
        again = relay_publish(route, [batch[1], batch[3]])
    finally:
        client.delete(bad)
        client.close()
    assert outcomes[0] is None and outcomes[2] is None
    for failure in (outcomes[1], outcomes[3], *again):
        assert isinstance(failure, Failure) and failure.error.startswith("ResponseError: WRONGTYPE")
        assert (failure.permanent, failure.counts, failure.outage) == (False, True, False)
    written = [json.loads(text)["properties"]["message_id"] for text in lists(good)[good.encode()]]
    assert written == [str(batch[0].event_id), str(batch[2].event_id)]


@pytest.mark.disrupts
def test_out_of_memory_after_the_first_push_fails_the_rest_without_an_attempt(name):
    """1,000 messages to one list are two LPUSHes (500 values each at most); Redis, at
    its maxmemory after the first, refuses the second (OOM): the first 500 are
    published, the other 500 are an outage (no attempt counted, its own reason) and are
    in no list. (Before: all 1,000 failed, an attempt each, though 500 were in the list.)"""
    route = routes(name)["direct"]
    payload = json.dumps({"pad": "p" * 500})
    batch = [message(n, id=n, payload=payload) for n in range(1000)]
    transport = RedisTransport(REDIS_URL)
    try:
        # Declares the queue, and tells the size of one message's JSON in the list.
        assert transport.publish(route, [message(1000, payload=payload)]) == [None]
        [text] = lists(name)[name.encode()]
        push = 500 * len(text)  # the first LPUSH's values
        # Room for one LPUSH read and done, not for a second one read besides.
        with redis_maxmemory(margin=push * 3 // 2):
            outcomes = transport.publish(route, batch)
    finally:
        transport.close()
    assert outcomes[:500] == [None] * 500
    failures = outcomes[500:]
    assert all(isinstance(failure, Failure) for failure in failures)
    assert {(f.counts, f.outage, f.error_type) for f in failures} == {
        (False, True, "out_of_memory")
    }
    assert failures[0].error.startswith("the broker is out of memory (Redis maxmemory reached")
    assert "command not allowed when used memory > 'maxmemory'" in failures[0].error
    written = [json.loads(text)["properties"]["message_id"] for text in lists(name)[name.encode()]]
    assert written == [str(m.event_id) for m in batch[:500]]


@pytest.mark.disrupts
def test_a_read_only_redis_is_an_outage_and_its_probe_says_so(name):
    """A Redis demoted to a replica (a Sentinel failover) refuses every write with
    READONLY: the broker's state, not the messages' fault, so an outage as out of memory
    is, no attempt spent, its own reason; the probe a relay checks the broker with says
    read-only until writes are taken again. (Before: an attempt charged per row, and the
    rows abandoned once the failover outlasted their attempts.)"""
    route = routes(name)["default exchange"]
    transport = RedisTransport(REDIS_URL)
    try:
        assert transport.publish(route, [message(0)]) == [None]  # connected, declared
        with redis_read_only():
            outcomes = transport.publish(route, [message(1), message(2)])
            with pytest.raises(BrokerRefusesWrites) as refused:
                transport.check()
        transport.check()  # a master again: up
    finally:
        transport.close()
    assert all(isinstance(failure, Failure) for failure in outcomes)
    assert {(f.counts, f.outage, f.error_type) for f in outcomes} == {  # type: ignore[union-attr]
        (False, True, "read_only")
    }
    assert outcomes[0].error.startswith("the broker is read-only (READONLY: a replica")  # type: ignore[union-attr]
    assert refused.value.condition == "read-only"
    assert str(refused.value).startswith("Redis refuses every write (read-only, READONLY")
    assert len(lists(name)[name.encode()]) == 1


def test_a_redis_unable_to_persist_is_an_outage_and_its_probe_says_so(name, tmp_path):
    """MISCONF: a Redis whose snapshot failed stops writes (redis-py has no class for it:
    its reply code tells it). An outage, no attempt spent, its own reason and fix."""
    route = routes(name)["default exchange"]
    with redis_unable_to_persist(tmp_path) as url:
        transport = RedisTransport(url)
        try:
            (failure,) = transport.publish(route, [message(1)])
            with pytest.raises(BrokerRefusesWrites) as refused:
                transport.check()
        finally:
            transport.close()
    assert isinstance(failure, Failure)
    assert (failure.counts, failure.outage, failure.error_type) == (False, True, "cannot_persist")
    assert failure.error.startswith("the broker is unable to persist (MISCONF: its last RDB")
    assert refused.value.condition == "unable to persist"
    assert "free its disk or fix its dir's permissions" in str(refused.value)


def test_a_kombu_whose_channel_the_writer_does_not_know_gets_kombus_producer(
    name, monkeypatch, caplog
):
    """The writer reads parts of kombu's Redis channel that are not kombu's public API.
    The installed kombu passes its check; a channel without them does not. Another kombu
    version cannot be installed beside this one, so the test makes the check fail with a
    stand-in (the one patch of this file): the relay then logs it once and publishes
    through kombu's producer, which writes the same lists and JSON (but the tag)."""
    from django_outbox.transports.redis_wire import RedisWire

    with kombu.Connection(REDIS_URL) as connection:
        assert RedisWire.unusable(connection.channel()) == ""
    assert RedisWire.unusable(object()).startswith("AttributeError: ")
    monkeypatch.setattr(RedisWire, "unusable", staticmethod(lambda channel: "AttributeError: x"))
    route = routes(name)["direct"]
    messages = batch()
    kombu_publish(route, messages, {})
    expected = lists(name)
    transport = RedisTransport(REDIS_URL)
    try:
        with caplog.at_level("ERROR", logger="django_outbox.transports.kombu"):
            assert transport.publish(route, messages[:2]) == [None] * 2
            assert transport.publish(route, messages[2:]) == [None] * (len(messages) - 2)
    finally:
        transport.close()
    written = lists(name)
    assert {key: [DELIVERY_TAG.sub(b"", m) for m in ms] for key, ms in written.items()} == {
        key: [DELIVERY_TAG.sub(b"", m) for m in ms] for key, ms in expected.items()
    }
    unusable = [
        r for r in caplog.records if getattr(r, "action", "") == "outbox.redis_wire_unusable"
    ]
    assert len(unusable) == 1 and "AttributeError: x" in unusable[0].getMessage()


def test_a_message_whose_text_is_not_ascii_is_sized_in_bytes(name, monkeypatch):
    """The writer counts a message's size in characters, its size in bytes since kombu's
    JSON escapes every character that is not ASCII. A text that is not ASCII (here kombu's
    header encoder with ``ensure_ascii`` off, the one stand-in) is sized in its UTF-8
    bytes: every message reaches Redis whole, and the one after it too."""
    from django_outbox.transports import redis_wire

    monkeypatch.setattr(redis_wire, "_encode_headers", JSONEncoder(ensure_ascii=False).encode)
    messages = [message(1), message(2, headers={"tenant": "t1"}), message(3)]
    assert relay_publish(routes(name)["direct"], messages) == [None] * 3
    written = [json.loads(text) for text in lists(name)[name.encode()]]
    assert [m["properties"]["message_id"] for m in written] == [str(m.event_id) for m in messages]
    assert [m["headers"].get("note") for m in written] == ["ünïcode", None, "ünïcode"]
