"""run_outbox_consumer against real RabbitMQ and Redis, writing through the inbox on PostgreSQL."""

from __future__ import annotations

import json
import pickle
import re
import signal
import time
import uuid

import kombu
import pytest
from django.db import transaction
from django.db.models.functions import Now

from django_outbox import ReceivedEvent, stage
from django_outbox.consumer import InboxConsumer
from django_outbox.models import InboxFailure, InboxMessage, OutboxMessage
from tests.support import (
    AMQP_URL,
    REDIS_URL,
    broker_connection,
    delete_queue,
    drain_raw,
    manage,
    publish_raw,
    rabbitmqctl,
    refused_port,
    run_relay,
    running,
    services,
    stage_events,
    start_command,
    stop,
    unique_destination,
    wait_until,
)
from tests.testapp.models import Delivery

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.disrupts]

SUMMARY = re.compile(
    r"received (?P<received>\d+): handled (?P<handled>\d+), duplicates (?P<duplicates>\d+), "
    r"ignored (?P<ignored>\d+), failed (?P<failed>\d+), parked (?P<parked>\d+), "
    r"rejected (?P<rejected>\d+) in [\d.]+s \((?P<rate>\d+) messages/s while busy\)"
)


@pytest.fixture
def destination():
    name = unique_destination("c")
    yield name
    delete_queue(name)


#: The handler and inbox name most tests consume with.
RECORD = ("--handler", "tests.testapp.handlers.record", "--consumer", "audit")


def start_consumer(queue: str, *args: str):
    return start_command("run_outbox_consumer", "--queue", queue, *args)


def run_consumer(queue: str, *args: str, timeout: float = 300, **outbox) -> dict[str, int]:
    """Run the consumer until the queue has been quiet for 3 s; returns its summary counts."""
    result = manage(
        "run_outbox_consumer",
        "--queue",
        queue,
        "--idle-timeout",
        "3",
        *args,
        timeout=timeout,
        **outbox,
    )
    assert result.returncode == 0, result.stderr
    match = SUMMARY.fullmatch(result.stdout.strip())
    assert match, result.stdout
    return {key: int(value) for key, value in match.groupdict().items()}


def republish_everything() -> None:
    """Make the relay publish every event again, as a crashed relay would."""
    OutboxMessage.objects.update(
        status=OutboxMessage.Status.PENDING, available_at=Now(), published_at=None
    )


def expected(received: int, **counts: int) -> dict[str, int]:
    base = {"handled": 0, "duplicates": 0, "ignored": 0, "failed": 0, "parked": 0, "rejected": 0}
    return {"received": received, **base, **counts}


def without_rate(summary: dict[str, int]) -> dict[str, int]:
    return {key: value for key, value in summary.items() if key != "rate"}


@pytest.mark.slow
def test_two_thousand_events_end_to_end_then_all_again_as_duplicates(destination):
    staged = stage_events(2000, destination)
    run_relay("--drain")
    first = run_consumer(destination, *RECORD)
    assert without_rate(first) == expected(2000, handled=2000)
    assert Delivery.objects.count() == 2000
    assert set(map(str, Delivery.objects.values_list("event_id", flat=True))) == set(staged)

    republish_everything()
    run_relay("--drain")
    second = run_consumer(destination, *RECORD)
    assert without_rate(second) == expected(2000, duplicates=2000)
    assert Delivery.objects.count() == 2000
    assert InboxMessage.objects.filter(consumer="audit").count() == 2000
    print(
        f"consumer with the inbox on PostgreSQL: {first['rate']} messages/s (new events), "
        f"{second['rate']} messages/s (duplicates)"
    )


def test_a_failing_event_is_redelivered_then_parked_and_bad_messages_are_rejected(destination):
    dead = f"{destination}.dead"
    # A broker policy dead-letters what the consumer rejects into `dead`.
    policy = f"dlx-{destination}"
    rabbitmqctl(
        "set_policy",
        policy,
        f"^{re.escape(destination)}$",
        f'{{"dead-letter-exchange": "", "dead-letter-routing-key": "{dead}"}}',
        "--apply-to",
        "queues",
    )
    try:
        with broker_connection() as connection:
            from kombu import Queue

            Queue(dead, durable=True)(connection.channel()).declare()
        stage_events(20, destination)
        from django.db import transaction

        with transaction.atomic():
            poison = stage("test.event", {"fail": True, "n": -1}, destination=destination)
        run_relay("--drain")
        publish_raw(
            destination,
            pickle.dumps({"n": 1}),
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={"event_id": str(uuid.uuid4())},
        )
        publish_raw(
            destination,
            b"{not json",
            content_type="application/json",
            content_encoding="utf-8",
            headers={"event_id": str(uuid.uuid4())},
        )
        publish_raw(
            destination, b'{"n": 1}', content_type="application/json", content_encoding="utf-8"
        )

        summary = run_consumer(
            destination,
            *RECORD,
            "--max-deliveries",
            "3",
        )
        assert without_rate(summary) == expected(26, handled=20, failed=2, parked=1, rejected=3)
        assert Delivery.objects.count() == 20
        failure = InboxFailure.objects.get()
        assert (failure.consumer, failure.event_id, failure.attempts) == (
            "audit",
            poison.event_id,
            3,
        )
        assert failure.parked_at is not None
        assert failure.last_error == f"RuntimeError: handler refuses event {poison.event_id}"
        assert json.loads(failure.body) == {"fail": True, "n": -1}
        assert failure.headers["event_type"] == "test.event"
        assert not InboxMessage.objects.filter(event_id=poison.event_id).exists()
        # Nothing is left in the queue; the broker dead-lettered the parked and rejected ones.
        assert drain_raw(destination) == []
        dead_letters = wait_until(lambda: drain_raw(dead), timeout=10, what="dead letters")
        assert len(dead_letters) == 4
        assert str(poison.event_id) in {m.headers.get("event_id") for m in dead_letters}
    finally:
        rabbitmqctl("clear_policy", policy)
        delete_queue(dead)


def test_a_handler_decorated_with_inbox_handler_lends_its_consumer_name(destination):
    stage_events(10, destination)
    run_relay("--drain")
    summary = run_consumer(destination, "--handler", "tests.testapp.handlers.decorated")
    assert without_rate(summary) == expected(10, handled=10)
    assert InboxMessage.objects.filter(consumer="decorated").count() == 10


def test_a_handler_with_event_types_acks_other_events_as_ignored(destination):
    with transaction.atomic():
        placed = [stage("order.placed", {"n": n}, destination=destination) for n in range(2)]
        shipped = stage("order.shipped", {"n": 2}, destination=destination)
    run_relay("--drain")
    summary = run_consumer(destination, "--handler", "tests.testapp.handlers.bill")
    assert without_rate(summary) == expected(3, handled=2, ignored=1)
    handled = {row.event_id for row in placed}
    assert set(Delivery.objects.values_list("event_id", flat=True)) == handled
    assert set(InboxMessage.objects.values_list("event_id", flat=True)) == handled
    assert not InboxFailure.objects.filter(event_id=shipped.event_id).exists()
    assert queue_depth(destination) == 0  # acked, not left behind nor requeued


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (
            ["--handler", "tests.testapp.handlers.record"],
            "--consumer is required: handler 'tests.testapp.handlers.record' is not decorated "
            "with @inbox_handler",
        ),
        (
            ["--handler", "tests.testapp.handlers.nope", "--consumer", "c"],
            "cannot import handler 'tests.testapp.handlers.nope': Module "
            '"tests.testapp.handlers" does not define a "nope" attribute/class',
        ),
        (
            ["--handler", "tests.testapp.handlers.not_callable", "--consumer", "c"],
            "handler 'tests.testapp.handlers.not_callable' is a int, not a callable",
        ),
        (
            ["--handler", "tests.testapp.handlers.decorated", "--consumer", "other"],
            "handler 'tests.testapp.handlers.decorated' is decorated with "
            "@inbox_handler('decorated'); --consumer 'other' disagrees (drop --consumer or "
            "make them match)",
        ),
        (
            ["--handler", "tests.testapp.handlers.decorated", "--database", "other"],
            "handler 'tests.testapp.handlers.decorated' is decorated with "
            "@inbox_handler(using='default'); --database 'other' disagrees (drop --database or "
            "make them match)",
        ),
    ],
)
def test_bad_handler_options_are_one_line_errors(args, error):
    result = manage("run_outbox_consumer", "--queue", "q", *args)
    assert result.returncode == 1
    assert result.stderr.strip() == f"CommandError: {error}"


def test_a_queue_declared_with_other_arguments_is_a_clear_error(destination):
    with broker_connection() as connection:
        from kombu import Queue

        Queue(destination, durable=True, queue_arguments={"x-max-length": 5})(
            connection.channel()
        ).declare()
    result = manage(
        "run_outbox_consumer",
        "--queue",
        destination,
        "--handler",
        "tests.testapp.handlers.record",
        "--consumer",
        "c",
    )
    assert result.returncode == 1
    # The relay's wording (DeclareRefused): the queue, the broker's reason, the fix.
    assert result.stderr.startswith(
        f"CommandError: the broker refused to declare queue '{destination}': Queue.declare: "
        f"(406) PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue '{destination}'"
    )
    assert result.stderr.rstrip().endswith(
        "; make the route's queue_arguments in OUTBOX['ROUTES'] match the existing queue, "
        "or delete it"
    )


@pytest.mark.slow
def test_sigterm_finishes_the_message_in_hand_and_loses_nothing(destination):
    stage_events(2000, destination)
    run_relay("--drain")
    consumer = start_consumer(destination, *RECORD, "--prefetch", "50")
    with running(consumer) as ended:
        wait_until(lambda: Delivery.objects.count() >= 200, timeout=120, what="200 handled")
    assert "SIGTERM: stopping after the message in hand" in ended.err
    handled = int(SUMMARY.fullmatch(ended.out.strip())["handled"])
    assert Delivery.objects.count() == handled < 2000
    # The unacked prefetch went back to the queue: a second run handles exactly the rest.
    rest = run_consumer(destination, *RECORD)
    assert rest["handled"] == 2000 - handled
    assert Delivery.objects.count() == 2000


@pytest.mark.slow
def test_sigkill_mid_stream_then_restart_handles_each_event_once(destination):
    stage_events(2000, destination)
    run_relay("--drain")
    consumer = start_consumer(destination, *RECORD)
    wait_until(lambda: Delivery.objects.count() >= 300, timeout=120, what="300 handled")
    consumer.send_signal(signal.SIGKILL)
    consumer.communicate(timeout=30)
    killed_at = Delivery.objects.count()
    rest = run_consumer(destination, *RECORD)
    # Messages handled but not acked before the kill come again and are skipped.
    assert rest["handled"] == 2000 - killed_at
    assert Delivery.objects.count() == 2000
    assert Delivery.objects.values("event_id").distinct().count() == 2000


@pytest.mark.slow
def test_the_consumer_rides_out_a_broker_restart(destination):
    stage_events(500, destination)
    run_relay("--drain")
    consumer = start_consumer(destination, *RECORD)
    wait_until(lambda: Delivery.objects.count() == 500, timeout=120, what="first 500 handled")
    services("restart", "rabbitmq")
    stage_events(500, destination)
    run_relay("--drain")
    with running(consumer) as ended:
        wait_until(lambda: Delivery.objects.count() == 1000, timeout=180, what="all 1000 handled")
    assert ended.err.count("broker unreachable") == 1
    assert ended.err.count("broker reachable again") == 1


def test_redis_end_to_end_with_duplicates(destination):
    staged = stage_events(300, destination)
    run_relay("--drain", BROKER_URL=REDIS_URL)
    first = run_consumer(destination, *RECORD, BROKER_URL=REDIS_URL)
    assert without_rate(first) == expected(300, handled=300)
    republish_everything()
    run_relay("--drain", BROKER_URL=REDIS_URL)
    second = run_consumer(destination, *RECORD, BROKER_URL=REDIS_URL)
    assert without_rate(second) == expected(300, duplicates=300)
    assert set(map(str, Delivery.objects.values_list("event_id", flat=True))) == set(staged)
    delete_queue(destination, url=REDIS_URL)


# -- failing handlers: backoff, crashes, replay ---------------------------------------


def declare_queue(queue: str, url: str = AMQP_URL) -> None:
    """Declare ``queue`` as the consumer will (a durable queue), so that a raw publish to
    it is kept before the consumer starts."""
    with broker_connection(url) as connection:
        kombu.Queue(queue, durable=True)(connection.channel()).declare()


def queue_depth(queue: str, url: str = AMQP_URL) -> int:
    """Messages ready in ``queue`` (not counting those a consumer holds unacked)."""
    with broker_connection(url) as connection:
        return kombu.Queue(queue, channel=connection.channel()).queue_declare(passive=True)[1]


@pytest.mark.parametrize("url", [AMQP_URL, REDIS_URL], ids=["rabbitmq", "redis"])
def test_default_backoff_rides_out_a_three_second_downstream_outage(destination, url, monkeypatch):
    """Every delivery fails for 3 s: with the default backoff (about 1, 2, 4 s between
    deliveries) no event reaches --max-deliveries 5, so none is parked."""
    staged = stage_events(20, destination)
    run_relay("--drain", BROKER_URL=url)
    monkeypatch.setenv("TESTAPP_FAIL_FOR", "3")
    summary = run_consumer(
        destination,
        "--handler",
        "tests.testapp.handlers.flaky",
        "--consumer",
        "audit",
        BROKER_URL=url,
    )
    assert summary["parked"] == 0
    assert summary["handled"] == 20
    assert summary["failed"] >= 20  # each event failed at least once and was retried
    assert not InboxFailure.objects.parked().exists()
    assert sorted(map(str, Delivery.objects.values_list("event_id", flat=True))) == sorted(staged)
    if url == REDIS_URL:
        delete_queue(destination, url=REDIS_URL)


def test_a_stop_requeues_the_messages_held_for_backoff_at_once(destination, monkeypatch):
    stage_events(5, destination)
    run_relay("--drain")
    monkeypatch.setenv("TESTAPP_FAIL_FOR", "3600")
    consumer = start_consumer(
        destination,
        "--handler",
        "tests.testapp.handlers.flaky",
        "--consumer",
        "audit",
        "--retry-delay",
        "600",
        "--retry-max-delay",
        "600",
    )
    wait_until(lambda: InboxFailure.objects.count() == 5, timeout=60, what="five failures counted")
    assert queue_depth(destination) == 0  # all five held unacked, none due for 10 minutes
    started = time.monotonic()
    code, out, err = stop(consumer, signal.SIGTERM)
    assert code == 0, err
    assert time.monotonic() - started < 30  # not the 600 s of the delay
    assert int(SUMMARY.fullmatch(out.strip())["failed"]) == 5, err
    assert queue_depth(destination) == 5
    assert not InboxFailure.objects.parked().exists()


def test_a_message_that_kills_every_consumer_is_parked_after_max_deliveries(destination):
    """The handler SIGKILLs its own process on the poison: restarted in a loop, the
    consumer counts the broker's redeliveries and parks the poison without running
    it once three deliveries were made; the other events are each handled once."""
    stage_events(5, destination)
    with transaction.atomic():
        poison = stage("test.event", {"kill": True}, destination=destination)
    stage_events(5, destination)
    run_relay("--drain")
    args = ("--handler", "tests.testapp.handlers.killer", "--consumer", "audit")
    kills = 0
    for _ in range(10):
        result = manage(
            "run_outbox_consumer",
            "--queue",
            destination,
            *args,
            "--max-deliveries",
            "3",
            "--idle-timeout",
            "2",
        )
        if result.returncode != -signal.SIGKILL:
            break
        kills += 1
    assert result.returncode == 0, result.stderr
    # Delivery 1 (not yet marked redelivered) and deliveries 2-4 (counted 1-3) ran the
    # handler and killed it; delivery 5 found 3 deliveries made and parked it unrun.
    assert kills == 4
    assert "parked (not run: a delivery was never acknowledged" in result.stderr
    failure = InboxFailure.objects.get()
    assert (failure.event_id, failure.attempts) == (poison.event_id, 3)
    assert failure.last_error.startswith("a delivery was never acknowledged")
    assert failure.parked_at is not None
    assert json.loads(failure.body) == {"kill": True}
    assert Delivery.objects.count() == 10
    assert Delivery.objects.values("event_id").distinct().count() == 10
    assert queue_depth(destination) == 0


@pytest.mark.parametrize(
    ("body", "content_type"),
    [(b'{"n": 1}', "application/data"), (b'{"n": 1}', "application/text")],
)
def test_a_raw_or_text_message_is_rejected_not_handled(destination, body, content_type):
    """kombu lets its raw content types through ``accept=["json"]`` as bytes; the
    consumer accepts application/json only."""
    declare_queue(destination)
    publish_raw(
        destination,
        body,
        content_type=content_type,
        content_encoding="binary",
        headers={"event_id": str(uuid.uuid4())},
    )
    result = manage("run_outbox_consumer", "--queue", destination, *RECORD, "--idle-timeout", "2")
    assert result.returncode == 0, result.stderr
    summary = SUMMARY.fullmatch(result.stdout.strip()).groupdict()
    assert without_rate({key: int(value) for key, value in summary.items()}) == expected(
        1, rejected=1
    )
    assert (
        f"rejected a message from {destination} that is not an outbox event (InvalidMessage: "
        f"content type '{content_type}' is not application/json: it was not published by an "
        "outbox relay)"
    ) in result.stderr
    assert Delivery.objects.count() == 0
    assert not InboxFailure.objects.exists()
    assert queue_depth(destination) == 0


def test_a_payload_object_with_a_type_key_reaches_the_handler_as_sent(destination):
    """kombu's JSON decoder turns {"__type__": "datetime", "__value__": ...} into a
    datetime (and "decimal" into a Decimal); the consumer hands over plain JSON."""
    payload = {
        "when": {"__type__": "datetime", "__value__": "2020-01-01T00:00:00"},
        "amount": {"__type__": "decimal", "__value__": "1.50"},
    }
    with transaction.atomic():
        event_id = stage("order.placed", payload, destination=destination).event_id
    run_relay("--drain")
    received: list[ReceivedEvent] = []
    consumer = InboxConsumer(destination, received.append, "types")
    consumer.run(idle_timeout=2)
    assert [(event.event_id, event.payload) for event in received] == [(event_id, payload)]


def test_a_consumer_runs_again_after_an_idle_run(destination):
    """Each run keeps its own state (a ConsumerRun): a second run of one consumer after an
    idle one consumes again, its totals added to the first's."""
    handled: list[ReceivedEvent] = []
    consumer = InboxConsumer(destination, handled.append, "audit")
    assert consumer.run(idle_timeout=1).received == 0  # declares the queue; idle: done
    stage_events(2, destination)
    run_relay("--drain")
    stats = consumer.run(idle_timeout=2)
    assert (stats.received, stats.handled, len(handled)) == (2, 2, 2)


def redeliver(queue: str) -> None:
    """Take the first message of ``queue`` without acking it and drop the connection, as
    a consumer that died would: the broker delivers it again, marked redelivered."""
    with broker_connection() as connection:
        assert kombu.Queue(queue, channel=connection.channel()).get(no_ack=False) is not None


def test_a_redelivered_event_already_handled_is_a_duplicate_not_a_failed_delivery(destination):
    """The handler failed twice, then succeeded and committed, and the consumer died
    before its ack: the redelivery is acked as a duplicate, neither counted nor parked."""
    with transaction.atomic():
        event_id = stage("test.event", {"n": 1}, destination=destination).event_id
    run_relay("--drain")
    InboxMessage.objects.create(consumer="audit", event_id=event_id)
    InboxFailure.objects.create(
        consumer="audit", event_id=event_id, queue=destination, attempts=3, last_error="E: x"
    )
    redeliver(destination)
    handled: list[ReceivedEvent] = []
    consumer = InboxConsumer(destination, handled.append, "audit", max_deliveries=3)
    stats = consumer.run(idle_timeout=2)
    assert (stats.duplicates, stats.parked, stats.failed, handled) == (1, 0, 0, [])
    failure = InboxFailure.objects.get()
    assert (failure.attempts, failure.parked_at, failure.last_error) == (3, None, "E: x")
    assert queue_depth(destination) == 0


@pytest.mark.parametrize("url", [AMQP_URL, REDIS_URL], ids=["rabbitmq", "redis"])
def test_a_parked_message_keeps_its_body_whatever_its_content_encoding(destination, url):
    """A latin-1 body decodes (the consumer honours content_encoding); the body kept
    when it is parked is that same text, not its bytes read as UTF-8."""
    declare_queue(destination, url)
    publish_raw(
        destination,
        '{"name": "café"}'.encode("latin-1"),
        url=url,
        content_type="application/json",
        content_encoding="latin-1",
        headers={"event_id": str(uuid.uuid4())},
    )
    seen: list[object] = []

    def fail(event: ReceivedEvent) -> None:
        seen.append(event.payload)
        raise ConnectionError("downstream")

    consumer = InboxConsumer(destination, fail, "audit", max_deliveries=1, url=url)
    stats = consumer.run(idle_timeout=2)
    assert (stats.parked, seen) == (1, [{"name": "café"}])
    assert json.loads(InboxFailure.objects.get().body) == {"name": "café"}


def test_sigterm_stops_a_consumer_whose_broker_went_silent(destination):
    """Unsubscribing and closing wait for the broker's replies, but not for good: a
    network that drops everything does not keep a stopping consumer from exiting."""
    from tests.integration.test_silent_broker import BROKER, FreezableProxy, sigterm_while_silent

    declare_queue(destination)
    proxy = FreezableProxy(BROKER)
    consumer = start_command(
        "run_outbox_consumer", "--queue", destination, *RECORD, BROKER_URL=proxy.url
    )
    try:
        wait_until(
            lambda: "consuming" in (consumer.stderr.readline() or ""),
            timeout=60,
            what="the consumer to subscribe",
        )
        _, err, took = sigterm_while_silent(proxy, consumer)
        assert consumer.returncode == 0, err
        # Each wait gives up after CONNECT_TIMEOUT (5 s): the one in hand, then the close.
        # Unbounded, the consumer never exited.
        assert took < 30, f"exited {took:.1f}s after SIGTERM:\n{err}"
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.communicate()
        proxy.close()


# -- --idle-timeout without a broker ----------------------------------------------------


@pytest.mark.parametrize(
    ("url", "masked", "error"),
    [
        (
            "amqp://guest:s3cret-pw@127.0.0.1:{port}//",
            "amqp://guest:***@127.0.0.1:{port}//",
            "ConnectionRefusedError: [Errno 111] Connection refused",
        ),
        (
            "redis://:s3cret-pw@127.0.0.1:{port}/0",
            "redis://:***@127.0.0.1:{port}/0",
            "ConnectionError: Error 111 connecting to 127.0.0.1:{port}. Connection refused.",
        ),
    ],
    ids=["rabbitmq", "redis"],
)
def test_idle_timeout_gives_up_on_a_broker_that_is_down(url, masked, error):
    port = refused_port()
    result = manage(
        "run_outbox_consumer",
        "--queue",
        "q",
        *RECORD,
        "--idle-timeout",
        "2",
        BROKER_URL=url.format(port=port),
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"CommandError: gave up after 2s without a broker: {masked.format(port=port)} "
        f"unreachable ({error.format(port=port)})"
    )
    assert without_rate(SUMMARY.fullmatch(result.stdout.strip()).groupdict()) == {
        key: str(value) for key, value in expected(0).items()
    }
    assert "s3cret-pw" not in result.stdout + result.stderr


def test_idle_timeout_gives_up_on_a_filesystem_broker_without_its_folder(tmp_path):
    folder = str(tmp_path / "missing")
    options = {
        "data_folder_in": folder,
        "data_folder_out": folder,
        "control_folder": str(tmp_path / "control"),
    }
    result = manage(
        "run_outbox_consumer",
        "--queue",
        "q",
        *RECORD,
        "--idle-timeout",
        "1",
        "--skip-checks",  # else E012 stops it before it starts
        BROKER_URL="filesystem://",
        BROKER_TRANSPORT_OPTIONS=options,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "CommandError: gave up after 1s without a broker: filesystem:// unreachable "
        f"(FileNotFoundError: [Errno 2] No such file or directory: {folder!r})"
    )


def test_without_idle_timeout_a_consumer_waits_for_a_broker_that_is_down():
    consumer = start_command(
        "run_outbox_consumer",
        "--queue",
        "q",
        *RECORD,
        BROKER_URL=f"amqp://guest:guest@127.0.0.1:{refused_port()}//",
    )
    first = consumer.stderr.readline()  # blocks until the consumer has met the outage
    assert first.startswith("broker unreachable ([Errno 111] Connection refused)"), first
    time.sleep(3)  # over the first backoffs (1, 2 s): still trying
    assert consumer.poll() is None
    returncode, out, err = stop(consumer)
    assert returncode == 0, err
    assert "gave up" not in err
    assert SUMMARY.fullmatch(out.strip()), out


@pytest.mark.slow
def test_idle_timeout_gives_up_when_rabbitmq_stops_after_messages_were_handled(destination):
    stage_events(20, destination)
    run_relay("--drain")
    # Idle for 15 s while connected would exit 0: longer than stopping RabbitMQ takes.
    consumer = start_consumer(destination, *RECORD, "--idle-timeout", "15")
    try:
        wait_until(lambda: Delivery.objects.count() == 20, timeout=120, what="20 handled")
        services("stop", "rabbitmq")
        try:
            out, err = consumer.communicate(timeout=120)
        finally:
            services("start", "rabbitmq")
    finally:
        if consumer.poll() is None:
            stop(consumer, signal.SIGKILL)
    assert consumer.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("CommandError: gave up after 15s without a broker: amqp://guest:***@"), (
        err
    )
    summary = SUMMARY.fullmatch(out.strip())
    assert summary and summary["handled"] == "20", out
