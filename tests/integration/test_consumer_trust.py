"""The consumer trusts nothing it reads from a queue (issue 39): messages forged by anyone
who can publish to a consumer's queue, put on real RabbitMQ, cannot park a real event early
(a broker header the broker did not set), take a real event's place in its key's sequence,
inflate a compressed body in the consumer's memory, or pass for a relay's message when
signatures are verified."""

from __future__ import annotations

import bz2
import json
import re
import threading
import uuid
from pathlib import Path
from typing import Any

import kombu
import pytest
from django.db import connections, transaction
from django.test import override_settings

from django_outbox import ReceivedEvent, stage
from django_outbox.consumer import InboxConsumer
from django_outbox.envelope import CONTENT_TYPE
from django_outbox.exceptions import InvalidEvent, OutboxConfigurationError
from django_outbox.models import InboxFailure
from django_outbox.ops.checks import check_settings
from django_outbox.relay import Relay
from django_outbox.signing import Keyring, key_id
from tests.integration.test_ordered_consumption import event_id, publish
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    broker_connection,
    delete_queue,
    drain_raw,
    publish_raw,
    run_relay,
    start_command,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp.models import Delivery

pytestmark = [pytest.mark.django_db(transaction=True)]


class Handler:
    """Remembers the event ids it ran for; fails the first ``fail`` calls."""

    def __init__(self, fail: int = 0) -> None:
        self.ran: list[uuid.UUID] = []
        self.fail = fail

    def __call__(self, event: ReceivedEvent) -> None:
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the downstream is down")
        self.ran.append(event.event_id)


def forge(queue: str, payload: Any, url: str = AMQP_URL, **headers: Any) -> uuid.UUID:
    """Publish to ``queue`` what anyone with publish rights can: an outbox-looking
    message with the headers given and a fresh event id unless given."""
    headers.setdefault("event_id", str(uuid.uuid4()))
    headers.setdefault("event_type", "order.placed")
    publish_raw(
        queue,
        json.dumps(payload),
        url,
        content_type=CONTENT_TYPE,
        content_encoding="utf-8",
        headers=headers,
        message_id=headers["event_id"],
    )
    return uuid.UUID(headers["event_id"])


def consume(queue: str, handler: Handler, **options: Any) -> InboxConsumer:
    options = {"retry_delay": 0.05, "retry_max_delay": 0.2, **options}
    consumer = InboxConsumer(queue, handler, "trust", **options)
    consumer.run(idle_timeout=2)
    return consumer


@pytest.fixture(params=["classic", "quorum"])
def queue(request):
    """A queue of either type, declared by its route."""
    name = unique_destination("trust")
    routes = {name: {"queue": name, "queue_type": request.param}}
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "ROUTES": routes}):
        InboxConsumer(name, Handler(), "trust").run(idle_timeout=0.1)  # declares it
        yield name
    delete_queue(name)


# -- item 3: headers the broker sets are believed only where it sets them ------------


def test_a_forged_delivery_count_does_not_park_an_event_after_one_failure(queue):
    """x-delivery-count 40 from the publisher: on a classic queue the broker never sets
    it, on a quorum queue it leaves a publisher's in place on the first delivery. The
    event that fails once is retried and handled, not parked."""
    event_id = forge(queue, {"n": 1}, **{"x-delivery-count": 40})
    handler = Handler(fail=1)
    stats = consume(queue, handler, max_deliveries=5).stats
    assert (stats.failed, stats.parked, stats.handled) == (1, 0, 1)
    assert handler.ran == [event_id]
    assert not InboxFailure.objects.parked().exists()


@pytest.mark.parametrize(
    "name",
    [
        "x-delivery-count",
        "x-death",
        "x-first-death-queue",
        "x-last-death-reason",
        "x-received-from",
        "x-shovelled-timestamp",
        "CC",
        "BCC",
        "compression",
        "outbox_signature",
    ],
)
def test_stage_refuses_a_header_a_broker_or_kombu_interprets(name):
    with transaction.atomic(), pytest.raises(InvalidEvent) as refused:
        stage("order.placed", {"n": 1}, destination="orders", headers={name: "1"})
    assert str(refused.value) == (
        f"event 'order.placed': headers [{name!r}] are reserved for the relay, kombu and "
        "the brokers and cannot be given"
    )


# -- item 2: on an ordered route, a duplicate is the same event id -----------------


@pytest.fixture
def ordered():
    name = unique_destination("trusto")
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "DEFAULT_ORDERED": True}):
        InboxConsumer(name, Handler(), "trust").run(idle_timeout=0.1)  # declares it
        yield name
    delete_queue(name)


def forge_in_order(queue: str, key: str, sequence: int, **headers: Any) -> uuid.UUID:
    """A forged event of an ordered route: a real key, a sequence, a fresh event id."""
    headers = {"destination": queue, "ordering_key": key, "sequence": sequence, **headers}
    return forge(queue, None if headers.get("skipped") else {"forged": True}, **headers)


def conflicts() -> dict[uuid.UUID, str]:
    return dict(InboxFailure.objects.parked().values_list("event_id", "last_error"))


def consume_for_at_most(queue: str, handler: Handler, seconds: float) -> InboxConsumer:
    """:func:`consume`, stopped after ``seconds`` if its queue never goes idle (a message
    requeued for ever); in a thread, which closes its database connection."""
    consumer = InboxConsumer(queue, handler, "trust", retry_delay=0.05, retry_max_delay=0.2)

    def run() -> None:
        try:
            consumer.run(idle_timeout=2)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="consumer")
    thread.start()
    thread.join(seconds)
    consumer.stop.set()
    thread.join(30)
    return consumer


@pytest.mark.parametrize("header", ["ordering_key", "destination", "long ordering_key"])
def test_a_key_postgresql_cannot_store_is_refused_and_the_next_event_handled(
    ordered, header, caplog
):
    """A forged ordered event whose key or destination holds a NUL (which PostgreSQL can
    neither store nor compare), or a key longer than the inbox stores: rejected in one
    line, not taken for a database outage and requeued for ever; the events behind it
    are handled."""
    if header == "destination":
        forged = forge_in_order(ordered, "k", 1, destination=f"{ordered}\x00")
    else:
        forged = forge_in_order(ordered, "k\x00" if header == "ordering_key" else "k" * 256, 1)
    real = [(f"r{n}", 1) for n in range(3)]
    publish(ordered, real)
    handler = Handler()
    stats = consume_for_at_most(ordered, handler, 30).stats
    assert (stats.rejected, stats.handled) == (1, len(real)), stats
    assert handler.ran == [uuid.UUID(event_id(ordered, key, n)) for key, n in real]
    name = "ordering_key" if "ordering_key" in header else "destination"
    rejected = [r for r in caplog.records if getattr(r, "action", "") == "inbox.rejected"]
    (line,) = [record.getMessage() for record in rejected]
    assert f"event {forged}: its {name} header cannot key the inbox's sequences" in line
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]


def test_a_forged_event_claiming_a_handled_sequence_is_parked_and_the_real_one_handled(
    ordered,
):
    """a1 is handled; then a copy of a1 under another event id, and a1's own event id
    claiming sequence 2, come before the real a2: both are conflicts, parked, never
    acked as duplicates or handled; the real a2 is handled."""
    publish(ordered, [("a", 1)])
    handler = Handler()
    consume(ordered, handler)
    a1 = uuid.UUID(event_id(ordered, "a", 1))
    other = forge_in_order(ordered, "a", 1)
    reused = forge_in_order(ordered, "a", 2, event_id=str(a1))
    publish(ordered, [("a", 2)])
    stats = consume(ordered, handler).stats
    assert handler.ran == [a1, uuid.UUID(event_id(ordered, "a", 2))]
    assert (stats.parked, stats.duplicates, stats.handled) == (2, 0, 1)
    assert conflicts() == {
        other: "sequence conflict: sequence 1 of key 'a' was handled already as another event",
        reused: "sequence conflict: this event was handled already, not at sequence 2 of key 'a'",
    }


def test_the_real_event_behind_a_forged_one_is_parked_not_acked_as_a_duplicate(ordered):
    """A forged a1 and a forged skip marker b1 come first: without signatures nothing
    tells them from the relay's, so they take sequence 1; the real a1 and b1 are then
    parked as conflicts (kept for an operator, logged), not acked away as duplicates.
    A real duplicate is still acked as one."""
    forge_in_order(ordered, "a", 1)
    forge_in_order(ordered, "b", 1, skipped=True)
    publish(ordered, [("a", 1), ("b", 1), ("a", 2), ("b", 2), ("a", 2)])
    handler = Handler()
    stats = consume(ordered, handler).stats
    real = {(key, n): uuid.UUID(event_id(ordered, key, n)) for key in "ab" for n in (1, 2)}
    assert conflicts() == {
        real[
            "a", 1
        ]: "sequence conflict: sequence 1 of key 'a' was handled already as another event",
        real[
            "b", 1
        ]: "sequence conflict: sequence 1 of key 'b' was handled already as another event",
    }
    assert real["a", 2] in handler.ran and real["b", 2] in handler.ran
    assert real["a", 1] not in handler.ran
    assert (stats.parked, stats.duplicates) == (2, 1)  # the second copy of a2


# -- item 1: a compressed body is refused, never inflated ---------------------------

BOMB_BYTES = 200 * 2**20


def bz2_bomb(size: int = BOMB_BYTES) -> bytes:
    """``size`` zero bytes in bzip2, compressed a mebibyte at a time (185 bytes or so)."""
    compressor = bz2.BZ2Compressor(9)
    chunk = bytes(2**20)
    parts = [compressor.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join(parts) + compressor.flush()


def queue_exists(queue: str) -> bool:
    with broker_connection() as connection:
        try:
            kombu.Queue(queue, channel=connection.channel()).queue_declare(passive=True)
        except connection.channel_errors:
            return False
    return True


def peak_rss_bytes(pid: int) -> int:
    """The peak resident set of process ``pid`` so far (``VmHWM``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    (kib,) = re.findall(r"^VmHWM:\s+(\d+) kB$", status, re.MULTILINE)
    return int(kib) * 1024


def test_a_compression_bomb_is_refused_uninflated_and_the_next_event_is_handled():
    """185 bytes of bzip2 with kombu's compression header, 200 MB inflated: the consumer
    process refuses it without inflating it (its peak memory stays well below the bomb's
    size) and handles the real event that follows."""
    queue = unique_destination("bomb")
    bomb = bz2_bomb()
    assert len(bomb) < 1000
    consumer = start_command(
        "run_outbox_consumer",
        "--queue",
        queue,
        "--handler",
        "tests.testapp.handlers.record",
        "--consumer",
        "trust",
    )
    try:
        wait_until(lambda: queue_exists(queue), timeout=30, what="the consumer's queue")
        headers = {"event_id": str(uuid.uuid4()), "event_type": "order.placed"}
        publish_raw(
            queue,
            bomb,
            content_type=CONTENT_TYPE,
            content_encoding="utf-8",
            headers={**headers, "compression": "application/x-bz2"},
        )
        with transaction.atomic():
            real = stage("order.placed", {"n": 1}, destination=queue).event_id
        run_relay("--drain")
        wait_until(
            lambda: Delivery.objects.filter(event_id=real).exists(),
            timeout=30,
            what="the real event handled",
        )
        peak = peak_rss_bytes(consumer.pid)
    finally:
        _code, _output, errors = stop(consumer)
        delete_queue(queue)
    assert peak < BOMB_BYTES / 2, f"the consumer peaked at {peak / 2**20:.0f} MiB"
    assert (
        f"rejected a message from {queue} that is not an outbox event (InvalidMessage: the "
        "message has a compression header ('application/x-bz2'), and an outbox relay never "
        "compresses: its body is not inflated); the broker's dead-letter policy applies"
    ) in errors
    assert Delivery.objects.count() == 1


# -- item 4: signed envelopes -------------------------------------------------------

OLD_KEY, NEW_KEY = "k" * 32 + "-old", "k" * 32 + "-new"


def relay_signed(url: str = AMQP_URL, **outbox: Any) -> None:
    """Drain the outbox through the in-process relay, signing with NEW_KEY."""
    with override_settings(OUTBOX={"BROKER_URL": url, "SIGNING_KEYS": [NEW_KEY], **outbox}):
        with Relay() as relay:
            totals = relay.run(threading.Event(), drain=True)
    assert totals.failed == totals.abandoned == 0


def verifying(url: str = AMQP_URL, **outbox: Any):
    """Settings of a consumer that verifies with the new key and the old one."""
    keys = [OLD_KEY, NEW_KEY]  # the consumer's order does not matter: all verify
    return override_settings(OUTBOX={"BROKER_URL": url, "SIGNING_KEYS": keys, **outbox})


@pytest.mark.parametrize("url", [AMQP_URL, REDIS_URL], ids=["rabbitmq", "redis"])
def test_signed_events_are_handled_and_forged_or_altered_ones_parked(url):
    """The relay signs on its hand-built AMQP frames and Redis writer alike; a verifying
    consumer handles its events and parks an unsigned message, a copy of a signed one
    with another body, and one signed with a key it does not have."""
    queue = unique_destination("signed")
    with transaction.atomic():
        staged = [stage("order.placed", {"n": n}, destination=queue, key="k") for n in (1, 2)]
    relay_signed(url)
    first = drain_raw(queue, url)[0]  # both taken: the queue is empty again
    try:
        with transaction.atomic():
            real = stage("order.placed", {"n": 3}, destination=queue, key="k").event_id
        relay_signed(url)
        signed = dict(first.headers)
        unsigned = forge(queue, {"n": 1}, url=url)
        altered = forge(queue, {"n": 1000}, url=url, **signed)  # the body of event 1 changed
        other = {**signed, "event_id": str(uuid.uuid4())}
        other["outbox_signature"] = sign_with("z" * 40, other, {"n": 1})
        unknown = forge(queue, {"n": 1}, url=url, **other)
        handler = Handler()
        with verifying(url):
            stats = consume(queue, handler, verify_signatures=True).stats
    finally:
        delete_queue(queue, url)
    assert handler.ran == [real]
    assert stats.parked == 3
    errors = conflicts()
    assert errors[unsigned] == "unsigned: the message has no outbox_signature header"
    assert errors[altered] == (
        f"the signature (key id {key_id(NEW_KEY.encode())}) does not match: the message was altered"
    )
    assert errors[unknown].startswith(f"signed with key id {key_id(b'z' * 40)!r}, which is none")
    assert altered == staged[0].event_id


def sign_with(key: str, headers: dict[str, Any], payload: Any) -> str:
    """The signature ``key`` makes of an event with ``headers`` and ``payload``."""
    event = ReceivedEvent.from_wire(payload, headers)
    return Keyring([key.encode()]).sign(event.envelope(json.dumps(payload).encode()))


def test_a_forged_event_on_an_ordered_route_is_parked_and_the_real_one_handled(ordered):
    """With signatures verified, the forged a1 of the test above is parked before it
    reaches its key's turn, and the real a1 and a2 are handled in sequence."""
    forged = forge_in_order(ordered, "a", 1)
    with transaction.atomic():
        real = [stage("order.placed", {"n": n}, destination=ordered, key="a") for n in (1, 2)]
    relay_signed(DEFAULT_ORDERED=True)
    handler = Handler()
    with verifying(DEFAULT_ORDERED=True):
        stats = consume(ordered, handler, verify_signatures=True).stats
    assert handler.ran == [row.event_id for row in real]
    assert conflicts() == {forged: "unsigned: the message has no outbox_signature header"}
    assert (stats.parked, stats.handled) == (1, 2)


def test_verification_without_keys_is_refused_in_one_line():
    with (
        override_settings(OUTBOX={"BROKER_URL": AMQP_URL}),
        pytest.raises(OutboxConfigurationError) as refused,
    ):
        InboxConsumer("orders", Handler(), "trust", verify_signatures=True)
    assert str(refused.value) == (
        "signatures are to be verified, but OUTBOX['SIGNING_KEYS'] is empty: give it the "
        "keys the relays sign with"
    )


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        (
            "s3cret-s3cret-s3cret-s3cret-s3cret",
            "must be a list of keys (str or bytes; the first signs, all verify); got str",
        ),
        (["s3cret"], "key 1 is 6 bytes long, under 32: make one with secrets.token_urlsafe(32)"),
        ([NEW_KEY, 42], "key 2 is a int, not str or bytes"),
        ([NEW_KEY, NEW_KEY.encode()], "key 2 is key 1 again"),
    ],
)
def test_bad_signing_keys_are_a_system_check_error_that_shows_no_key(keys, error):
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "SIGNING_KEYS": keys}):
        (problem,) = check_settings()
    assert (problem.id, problem.msg) == ("django_outbox.E035", f'OUTBOX["SIGNING_KEYS"] {error}.')
    assert "s3cret" not in problem.msg + problem.hint and NEW_KEY not in problem.msg


def test_verify_signatures_without_keys_is_a_system_check_error():
    with override_settings(OUTBOX={"BROKER_URL": AMQP_URL, "VERIFY_SIGNATURES": True}):
        (problem,) = check_settings()
    assert (problem.id, problem.msg) == (
        "django_outbox.E036",
        'OUTBOX["VERIFY_SIGNATURES"] is on, but OUTBOX["SIGNING_KEYS"] is empty: a consumer '
        "would park every message.",
    )


def test_messages_crafted_to_break_the_signature_check_are_refused_and_the_consumer_goes_on():
    """Each of these once raised out of a verifying consumer (an unacked message that
    crashed it again at every restart): a key that is not text, a signature that is not
    ASCII (hmac.compare_digest raised TypeError), a body whose codec yields text UTF-8
    cannot hold. Now they are parked, and the real event behind them handled."""
    queue = unique_destination("crafted")
    try:
        with transaction.atomic():
            real = stage("order.placed", {"n": 1}, destination=queue).event_id
        relay_signed()
        (signed,) = drain_raw(queue)  # the relay's headers, to copy a real key id
        kid = signed.headers["outbox_signature"].split(":")[1]
        not_text = forge(queue, {"n": 2}, ordering_key=7)
        not_ascii = forge(queue, {"n": 3}, outbox_signature=f"v1:{kid}:é")
        surrogate = uuid.uuid4()
        publish_raw(
            queue,
            b'{"n": "\\ud800"}',
            content_type=CONTENT_TYPE,
            content_encoding="unicode_escape",
            headers={"event_id": str(surrogate), "event_type": "order.placed"},
        )
        publish_raw(  # the real event, after them
            queue,
            signed.body,
            content_type=CONTENT_TYPE,
            content_encoding="utf-8",
            headers=signed.headers,
            message_id=signed.properties["message_id"],
        )
        handler = Handler()
        with verifying():
            stats = consume(queue, handler, verify_signatures=True).stats
    finally:
        delete_queue(queue)
    assert handler.ran == [real]
    assert (stats.parked, stats.rejected, stats.handled) == (3, 0, 1)
    errors = conflicts()
    assert (
        errors[not_text]
        == errors[surrogate]
        == ("unsigned: the message has no outbox_signature header")
    )
    assert errors[not_ascii] == "the outbox_signature header is not v1:<key id>:<hex HMAC-SHA256>"


def test_a_refused_copy_never_replaces_a_parked_events_body_and_is_stored_bounded():
    """Anyone can put a parked event's id on a message: its unsigned copy is refused
    and parked, but the real event's record keeps its own body (what
    outbox_replay_parked would send); and a refused message's body is kept up to
    MAX_PAYLOAD_BYTES, not as large as a publisher makes it."""
    queue = unique_destination("parked")
    try:
        with transaction.atomic():
            real = stage("order.placed", {"n": 1}, destination=queue).event_id
        relay_signed()
        with verifying():  # fails its two deliveries: parked with its own body
            consume(queue, Handler(fail=99), verify_signatures=True, max_deliveries=2)
        record = InboxFailure.objects.get(event_id=real)
        assert record.parked_at is not None and json.loads(record.body) == {"n": 1}
        forge(queue, {"n": "forged"}, event_id=str(real))
        large = forge(queue, {"filler": "x" * 5000})
        with verifying(MAX_PAYLOAD_BYTES=1000):
            stats = consume(queue, Handler(), verify_signatures=True).stats
    finally:
        delete_queue(queue)
    assert stats.parked == 2
    record.refresh_from_db()
    assert json.loads(record.body) == {"n": 1}
    assert not record.last_error.startswith("unsigned")
    assert len(InboxFailure.objects.get(event_id=large).body.encode()) == 1000


# -- issue 39 review: an exception that cannot be printed --------------------------


class Unprintable(Exception):
    """A library's exception whose ``__str__`` raises."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")


def test_a_handler_exception_that_cannot_be_printed_is_a_counted_failure(queue):
    """The consumer writes a handler's exception as text (stored, logged): one whose
    ``__str__`` raises is counted, then parked at max_deliveries with its class named,
    and the next event is handled."""
    bad, good = forge(queue, {"n": 1}), forge(queue, {"n": 2})
    ran: list[uuid.UUID] = []

    def handler(event: ReceivedEvent) -> None:
        if event.event_id == bad:
            raise Unprintable()
        ran.append(event.event_id)

    stats = consume(queue, handler, max_deliveries=2).stats
    assert ran == [good]
    assert (stats.failed, stats.parked, stats.handled) == (1, 1, 1)  # then parked
    assert conflicts() == {bad: "Unprintable: <exception str() failed>"}


# -- issue 39 review: a Redis message kombu cannot read ----------------------------


def kombu_redis_json(queue: str, **changes: Any) -> str:
    """kombu's Redis message JSON of an outbox-looking event, with ``changes``: anyone
    who can LPUSH to a queue's list writes all of it, properties and headers too."""
    event_id = str(uuid.uuid4())
    message = {
        "body": "eyJuIjogMX0=",  # {"n": 1}
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"event_id": event_id, "event_type": "order.placed"},
        "properties": {
            "body_encoding": "base64",
            "delivery_info": {"exchange": "", "routing_key": queue},
            "delivery_mode": 2,
            "delivery_tag": str(uuid.uuid4()),
            "priority": 0,
            "message_id": event_id,
        },
        **changes,
    }
    return json.dumps(message)


@pytest.mark.parametrize(
    "changes",
    [{"headers": ["a", "list"]}, {"headers": "text"}, {"properties": "text"}, {"body": 12}],
    ids=["headers-list", "headers-text", "properties-text", "body-number"],
)
def test_a_redis_message_kombu_cannot_read_is_rejected_and_the_next_event_handled(changes, caplog):
    """kombu raised building such a message (AttributeError, TypeError), out of the
    consumer's run: run_outbox_consumer exited. Now it is rejected in one line, gone from
    the list and from kombu's unacked hash, and the event behind it is handled."""
    import redis

    queue = unique_destination("trustredis")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        with override_settings(OUTBOX={"BROKER_URL": REDIS_URL}):
            InboxConsumer(queue, Handler(), "trust").run(idle_timeout=0.1)  # declares it
            client.lpush(queue, kombu_redis_json(queue, **changes))
            good = forge(queue, {"n": 2}, url=REDIS_URL)
            handler = Handler()
            stats = consume(queue, handler).stats
        assert handler.ran == [good]
        assert (stats.rejected, stats.handled) == (1, 1)
        assert client.llen(queue) == 0 and client.hlen("unacked") == 0
        rejected = [r for r in caplog.records if getattr(r, "action", "") == "inbox.rejected"]
        (line,) = [record.getMessage() for record in rejected]
        assert "InvalidMessage: kombu cannot read it as a message (" in line
    finally:
        client.delete(queue)
        client.close()


def test_a_redis_item_that_is_not_json_is_rejected_and_the_next_event_handled(caplog):
    """kombu parses a Redis list item before any message exists: one that is not JSON (or
    not UTF-8) raised out of the consumer's run, and run_outbox_consumer exited."""
    import redis

    queue = unique_destination("trustredis")
    client = redis.Redis.from_url(REDIS_URL)
    try:
        with override_settings(OUTBOX={"BROKER_URL": REDIS_URL}):
            InboxConsumer(queue, Handler(), "trust").run(idle_timeout=0.1)  # declares it
            client.lpush(queue, b"not json {")
            client.lpush(queue, b"\xff\xfe")
            good = forge(queue, {"n": 2}, url=REDIS_URL)
            handler = Handler()
            stats = consume(queue, handler).stats
        assert handler.ran == [good]
        assert (stats.received, stats.rejected, stats.handled) == (3, 2, 1)
        assert client.llen(queue) == 0 and client.hlen("unacked") == 0
        rejected = [r for r in caplog.records if getattr(r, "action", "") == "inbox.rejected"]
        lines = [record.getMessage() for record in rejected]
        assert len(lines) == 2 and all("that is not even JSON (" in line for line in lines)
    finally:
        client.delete(queue)
        client.close()
