"""Guarantee 1, atomic staging, against real PostgreSQL transactions.

Tests marked ``transaction=True`` really commit and roll back (pytest-django
truncates the tables afterwards), so they see what another connection would see.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import uuid

import pytest
from django.db import connections, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext, override_settings

from django_outbox import (
    InvalidDestination,
    InvalidEvent,
    NotInTransaction,
    PayloadNotSerializable,
    UnknownDestination,
    event_committed,
    publish_on_success,
    stage,
    stage_many,
)
from django_outbox.models import OutboxMessage
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "other"])


class Boom(Exception):
    pass


@publish_on_success(
    "order.placed",
    destination="orders",
    payload=lambda order, *args, **kwargs: {"order_id": order.pk, "total": order.total},
    key=lambda order, *args, **kwargs: f"order-{order.pk}",
)
def place_order(customer: str, total: str, *, fail: bool = False) -> Order:
    order = Order.objects.create(customer=customer, total=decimal.Decimal(total))
    if fail:
        raise Boom("payment declined")
    return order


def test_decorated_call_commits_business_row_and_event_together():
    order = place_order("ada", "12.50")

    message = OutboxMessage.objects.get()
    assert Order.objects.get() == order
    assert message.event_type == "order.placed"
    assert message.destination == "orders"
    assert message.payload == {"order_id": order.pk, "total": "12.50"}
    assert message.ordering_key == f"order-{order.pk}"
    assert message.status == OutboxMessage.Status.PENDING
    assert message.attempts == 0
    assert isinstance(message.event_id, uuid.UUID)
    # Both times come from the database clock and are set at insert.
    assert message.created_at is not None
    assert message.available_at == message.created_at


def test_raise_inside_decorated_function_stages_nothing():
    with pytest.raises(Boom):
        place_order("ada", "1.00", fail=True)

    assert not Order.objects.exists()
    assert not OutboxMessage.objects.exists()


def test_outer_rollback_takes_the_event_with_it():
    with pytest.raises(Boom), transaction.atomic():
        place_order("ada", "1.00")
        assert OutboxMessage.objects.count() == 1  # visible inside the transaction
        raise Boom

    assert not Order.objects.exists()
    assert not OutboxMessage.objects.exists()


def test_savepoint_rollback_takes_only_its_own_event():
    with transaction.atomic():
        kept = place_order("kept", "1.00")
        try:
            with transaction.atomic():  # a savepoint
                place_order("dropped", "2.00")
                raise Boom
        except Boom:
            pass

    assert list(Order.objects.values_list("customer", flat=True)) == ["kept"]
    assert list(OutboxMessage.objects.values_list("payload", flat=True)) == [
        {"order_id": kept.pk, "total": "1.00"}
    ]


def test_decorator_joins_the_outer_transaction():
    with transaction.atomic():
        place_order("ada", "1.00")
        # Still uncommitted: a second connection does not see the event yet.
        assert _count_from_another_connection() == 0
    assert _count_from_another_connection() == 1


def test_stage_in_autocommit_mode_is_refused_with_the_fix():
    with pytest.raises(NotInTransaction, match=r"inside transaction.atomic\(using='default'\)"):
        stage("order.placed", {"order_id": 1}, destination="orders")
    assert isinstance(NotInTransaction("x"), TransactionManagementError)
    assert not OutboxMessage.objects.exists()


def test_stage_returns_the_saved_row():
    with transaction.atomic():
        row = stage("order.shipped", {"order_id": 7}, destination="orders", key="order-7")
    assert OutboxMessage.objects.get(pk=row.pk).event_id == row.event_id
    assert row.ordering_key == "order-7"


def test_stage_many_writes_a_thousand_events_with_one_insert():
    events = [
        {
            "event_type": "order.placed",
            "payload": {"n": n},
            "destination": "orders",
            "key": f"k{n % 7}",
        }
        for n in range(1000)
    ]
    connection = connections["default"]
    with transaction.atomic(), CaptureQueriesContext(connection) as ctx:
        rows = stage_many(events)

    inserts = [
        q["sql"] for q in ctx.captured_queries if q["sql"].lstrip().upper().startswith("INSERT")
    ]
    assert len(inserts) == 1
    assert len(rows) == 1000
    assert all(row.pk is not None for row in rows)
    assert OutboxMessage.objects.count() == 1000
    assert sorted(OutboxMessage.objects.values_list("payload__n", flat=True)) == list(range(1000))


def test_stage_many_of_nothing_writes_nothing():
    with transaction.atomic(), CaptureQueriesContext(connections["default"]) as ctx:
        assert stage_many([]) == []
    assert [q for q in ctx.captured_queries if "INSERT" in q["sql"]] == []


GOOD_EVENT = {"event_type": "a", "payload": {}, "destination": "d"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({**GOOD_EVENT, "colour": 1}, r"event #1 has unknown keys \['colour'\]"),
        ({"event_type": "a", "payload": {}}, r"event #1 lacks destination"),
        ("not a dict", r"event #1 must be a dict; got str"),
        ({**GOOD_EVENT, "payload": {1j}}, r"the payload of event 'a' is not JSON-serialisable"),
    ],
)
def test_stage_many_rejects_malformed_events_before_writing(bad, message):
    with pytest.raises((InvalidEvent, PayloadNotSerializable), match=message), transaction.atomic():
        stage_many([GOOD_EVENT, bad, GOOD_EVENT])
    assert not OutboxMessage.objects.exists()


def test_django_json_encoder_types_are_accepted_and_stored_as_sent():
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    ident = uuid.UUID("12345678-1234-5678-1234-567812345678")
    with transaction.atomic():
        stage(
            "x.happened",
            {"at": when, "amount": decimal.Decimal("9.99"), "id": ident, "tags": ("a", "b")},
            destination="x",
        )
    assert OutboxMessage.objects.get().payload == {
        "at": "2026-01-02T03:04:05Z",
        "amount": "9.99",
        "id": "12345678-1234-5678-1234-567812345678",
        "tags": ["a", "b"],
    }


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (object(), "Object of type object is not JSON serializable"),
        ({"ids": {1, 2}}, "Object of type set is not JSON serializable"),
        ({"ratio": math.nan}, "Out of range float values are not JSON compliant"),
        ({"blob": b"\x00"}, "Object of type bytes is not JSON serializable"),
    ],
)
def test_unserialisable_payload_fails_in_the_business_transaction(payload, detail):
    @publish_on_success("order.placed", destination="orders", payload=lambda order: payload)
    def create_order() -> Order:
        return Order.objects.create(customer="ada", total=1)

    with pytest.raises(PayloadNotSerializable) as excinfo:
        create_order()

    assert str(excinfo.value).startswith(
        "the payload of event 'order.placed' is not JSON-serialisable: "
    )
    assert detail in str(excinfo.value)
    assert isinstance(excinfo.value, TypeError)
    assert not Order.objects.exists()
    assert not OutboxMessage.objects.exists()


@pytest.mark.parametrize(("mapper", "called"), [("payload", "payload"), ("key", "key")])
def test_a_mapper_that_cannot_take_the_call_says_how_it_is_called(mapper, called):
    # A first-hour slip: payload=lambda order: ... on a function that takes arguments.
    mappers = {"payload": lambda order, customer: {}, mapper: lambda order: "x"}

    @publish_on_success("order.placed", destination="orders", **mappers)
    def create_order(customer: str) -> Order:
        return Order.objects.create(customer=customer, total=1)

    with pytest.raises(TypeError) as excinfo:
        create_order("ada")
    assert str(excinfo.value) == (
        f"@publish_on_success('order.placed') calls {called}= as "
        f"{called}(result, *args, **kwargs), with create_order's return value and the "
        "arguments it was called with; <lambda> cannot take them: too many positional arguments"
    )
    assert not Order.objects.exists()


def test_a_type_error_inside_a_mapper_is_its_own():
    @publish_on_success("order.placed", destination="orders", payload=lambda order: {"n": 1 + "1"})
    def create_order() -> Order:
        return Order.objects.create(customer="ada", total=1)

    with pytest.raises(TypeError, match="unsupported operand"):
        create_order()


@pytest.mark.parametrize(
    "destination", ["", " orders", "or ders", "orders\n", "-x", "x" * 256, None, 12]
)
def test_malformed_destination_is_refused_at_stage_and_at_decoration(destination):
    with pytest.raises(InvalidDestination, match="is malformed"), transaction.atomic():
        stage("a.b", {}, destination=destination)
    with pytest.raises(InvalidDestination, match="is malformed"):
        publish_on_success("a.b", destination=destination, payload=dict)
    assert not OutboxMessage.objects.exists()


@override_settings(
    OUTBOX={"BROKER_URL": "memory://", "DEFAULT_ROUTE": False, "ROUTES": {"orders": {}}}
)
def test_unknown_destination_is_an_error_when_the_default_route_is_off():
    with pytest.raises(UnknownDestination) as excinfo, transaction.atomic():
        stage("a.b", {}, destination="invoices")
    assert str(excinfo.value) == (
        "destination 'invoices' is not in OUTBOX['ROUTES'] and OUTBOX['DEFAULT_ROUTE'] is False: "
        "add a route for it or turn the default route on"
    )
    with transaction.atomic():
        stage("a.b", {}, destination="orders")
    assert OutboxMessage.objects.count() == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"event_type": ""}, "event_type must be a non-empty string"),
        ({"key": ""}, "key must be None or a non-empty string .* got an empty string"),
        ({"key": "k" * 256}, "at most 255 characters; got a string of 256 characters"),
        ({"key": 5}, "key must be None or a non-empty string .* got int"),
        ({"headers": {"event_id": "spoof"}}, r"headers \['event_id'\] are reserved for the relay"),
        ({"headers": {"compression": "gzip"}}, r"headers \['compression'\] are reserved"),
        ({"headers": ["x"]}, "headers must be a dict with non-empty string keys"),
        ({"headers": {"trace": {1, 2}}}, "the headers of event 'a.b' are not JSON|is not JSON"),
        ({"available_at": dt.datetime(2030, 1, 1)}, "must be timezone-aware"),
        ({"available_at": "tomorrow"}, "available_at must be a datetime; got str"),
    ],
)
def test_malformed_arguments_get_specific_errors(kwargs, message):
    arguments = {"event_type": "a.b", "payload": {}, "destination": "d", **kwargs}
    with pytest.raises((InvalidEvent, PayloadNotSerializable), match=message), transaction.atomic():
        stage(arguments.pop("event_type"), arguments.pop("payload"), **arguments)
    assert not OutboxMessage.objects.exists()


def test_user_headers_and_available_at_are_stored():
    later = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    with transaction.atomic():
        stage("a.b", {}, destination="d", headers={"correlation_id": "c-1"}, available_at=later)
    row = OutboxMessage.objects.get()
    assert row.headers == {"correlation_id": "c-1"}
    assert row.available_at == later


def test_decorator_validates_its_arguments_at_decoration_time():
    with pytest.raises(TypeError, match=r"payload=\.\.\.\) must be a callable"):
        publish_on_success("a.b", destination="d", payload={"static": True})
    with pytest.raises(TypeError, match=r"key=\.\.\.\) must be None or a callable"):
        publish_on_success("a.b", destination="d", payload=dict, key="k")
    with pytest.raises(InvalidEvent, match="event_type must be"):
        publish_on_success("", destination="d", payload=dict)

    async def coroutine():
        return None

    with pytest.raises(TypeError, match="cannot wrap the coroutine function"):
        publish_on_success("a.b", destination="d", payload=dict)(coroutine)


def test_decorator_maps_result_and_arguments_to_payload_and_key():
    @publish_on_success(
        "sum.done",
        destination="maths",
        payload=lambda result, a, b, *, scale: {"a": a, "b": b, "scale": scale, "result": result},
        key=lambda result, a, b, *, scale: f"{a}-{b}",
    )
    def add(a: int, b: int, *, scale: int) -> int:
        return (a + b) * scale

    assert add(2, 3, scale=10) == 50
    row = OutboxMessage.objects.get()
    assert row.payload == {"a": 2, "b": 3, "scale": 10, "result": 50}
    assert row.ordering_key == "2-3"
    assert add.__name__ == "add"


def test_using_another_database_stages_there_and_rolls_back_there():
    @publish_on_success(
        "a.b", destination="d", payload=lambda result, n: {"n": result}, using="other"
    )
    def work(n: int) -> int:
        return n

    work(1)
    with pytest.raises(Boom), transaction.atomic(using="other"):
        work(2)
        raise Boom

    assert list(OutboxMessage.objects.using("other").values_list("payload", flat=True)) == [
        {"n": 1}
    ]
    assert not OutboxMessage.objects.using("default").exists()


class Received:
    def __init__(self):
        self.calls = []

    def __call__(self, sender, messages, using, **kwargs):
        self.calls.append(([m.payload for m in messages], using))


@pytest.fixture
def received():
    receiver = Received()
    event_committed.connect(receiver)
    yield receiver
    event_committed.disconnect(receiver)


def test_event_committed_fires_after_the_outermost_commit_only(received):
    with transaction.atomic():
        with transaction.atomic():
            stage("a.b", {"n": 1}, destination="d")
        stage_many([{"event_type": "a.b", "payload": {"n": n}, "destination": "d"} for n in (2, 3)])
        assert received.calls == []  # a released savepoint is not a commit
    assert received.calls == [([{"n": 1}], "default"), ([{"n": 2}, {"n": 3}], "default")]


def test_event_committed_never_fires_on_rollback(received):
    with pytest.raises(Boom), transaction.atomic():
        stage("a.b", {"n": 1}, destination="d")
        raise Boom
    with transaction.atomic():
        try:
            with transaction.atomic():
                stage("a.b", {"n": 2}, destination="d")
                raise Boom
        except Boom:
            pass
    assert received.calls == []


def test_a_failing_receiver_is_logged_and_does_not_reach_the_caller(caplog):
    def broken(**kwargs):
        raise RuntimeError("receiver bug")

    event_committed.connect(broken)
    try:
        with transaction.atomic():
            stage("a.b", {}, destination="d")
    finally:
        event_committed.disconnect(broken)
    assert OutboxMessage.objects.count() == 1
    (record,) = [r for r in caplog.records if r.name == "django_outbox.staging"]
    assert record.action == "outbox.signal_failed"
    assert "receiver bug" in str(record.exc_info[1])


def _count_from_another_connection() -> int:
    """Count outbox rows through a separate psycopg connection (another session)."""
    with _raw_connection() as conn:
        table = OutboxMessage._meta.db_table
        return conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]


def _raw_connection():
    import psycopg

    params = connections["default"].get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    return psycopg.connect(**params, autocommit=True)


def test_commit_sends_notify_and_rollback_does_not():
    with _raw_connection() as listener:
        listener.execute("LISTEN django_outbox")

        with pytest.raises(Boom), transaction.atomic():
            stage("a.b", {}, destination="d")
            raise Boom
        with _raw_connection() as other:
            other.execute("SELECT pg_notify('django_outbox', 'marker')")
        with transaction.atomic():
            stage_many([{"event_type": "a.b", "payload": {}, "destination": "d"}] * 3)

        payloads = [n.payload for n in listener.notifies(timeout=10, stop_after=2)]
    # Notifications arrive in commit order: the rolled-back one never existed,
    # and the committed stage_many sent exactly one.
    assert payloads == ["marker", OutboxMessage._meta.db_table]
