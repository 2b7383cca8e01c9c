"""The claim on real PostgreSQL: due rows oldest first, rows another session holds
locked skipped without waiting for them.

A second, independent psycopg session holds a row lock (``SELECT ... FOR UPDATE``
in an open transaction), as a relay in the middle of its own claim would. The
claim under test runs with ``lock_timeout`` set on its session, so a claim that
waited for the lock would fail with PostgreSQL's lock-timeout error instead of
hanging the test.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from django_outbox import db
from django_outbox.envelope import ClaimedMessage
from django_outbox.models import OutboxMessage
from tests.factories import OutboxMessageFactory

pytestmark = pytest.mark.django_db(transaction=True)

Status = OutboxMessage.Status
Claim = Callable[[int, uuid.UUID], list[ClaimedMessage]]


def _production(limit: int, token: uuid.UUID) -> list[ClaimedMessage]:
    return db.claim("default", limit=limit, lease_seconds=30, worker="w", token=token)


def _production_unordered(limit: int, token: uuid.UUID) -> list[ClaimedMessage]:
    """The claim a relay whose settings order no route sends between its whole claims."""
    return db.claim(
        "default", limit=limit, lease_seconds=30, worker="w", token=token, ordered=False
    )


def _portable(limit: int, token: uuid.UUID) -> list[ClaimedMessage]:
    return db._claim_portable("default", limit, 2**62, 30, "w", token)  # no byte bound


@pytest.fixture(
    params=[_production, _production_unordered, _portable],
    ids=["postgresql", "postgresql-unordered", "portable"],
)
def claim(request) -> Claim:
    return request.param


@pytest.fixture
def other_session() -> Iterator[psycopg.Connection]:
    """A second session on the test database, not Django's."""
    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "server_side_binding"):
        params.pop(django_only, None)
    with psycopg.connect(**params) as session:
        yield session


@pytest.fixture
def no_lock_waits() -> Iterator[None]:
    """Make any lock wait of Django's session fail after 2 s instead of blocking."""
    with connection.cursor() as cursor:
        cursor.execute("SET lock_timeout = '2s'")
    yield
    with connection.cursor() as cursor:
        cursor.execute("RESET lock_timeout")


def _rows(using: str = "default") -> dict[str, OutboxMessage]:
    """Rows created in this order (so ids ascend down the list), due at other times."""
    now = timezone.now()
    ago = lambda minutes: now - dt.timedelta(minutes=minutes)  # noqa: E731
    spec = {
        "pending_10": {"available_at": ago(10)},
        "pending_30": {"available_at": ago(30)},
        "failed_due": {"status": Status.FAILED, "attempts": 1, "available_at": ago(20)},
        "lease_expired": {
            "status": Status.PROCESSING,
            "available_at": ago(40),
            "locked_until": ago(40),
            "locked_by": "dead-relay:1",
            "lease_token": uuid.uuid4(),
        },
        "pending_30_later_id": {"available_at": ago(30)},
        "failed_not_due": {"status": Status.FAILED, "attempts": 1, "available_at": ago(-60)},
        "lease_live": {
            "status": Status.PROCESSING,
            "available_at": ago(-1),
            "locked_until": ago(-1),
            "lease_token": uuid.uuid4(),
        },
        "published": {"published": True, "available_at": ago(90)},
        "abandoned": {"status": Status.ABANDONED, "available_at": ago(90)},
        "oldest_locked": {"available_at": ago(50)},
    }
    rows = {name: OutboxMessageFactory.build(**fields) for name, fields in spec.items()}
    for row in rows.values():
        row.save(using=using)
    return rows


def test_claim_skips_a_row_another_session_holds_and_takes_the_oldest_first(
    claim, other_session, no_lock_waits
):
    rows = _rows()
    name_of = {row.pk: name for name, row in rows.items()}
    token = uuid.uuid4()
    with other_session.transaction():
        other_session.execute(
            "SELECT id FROM django_outbox_outboxmessage WHERE id = %s FOR UPDATE",
            [rows["oldest_locked"].pk],
        )
        # The three oldest due rows that are not locked, ties on available_at by id;
        # returned in id order.
        first = claim(3, token)
        assert [name_of[m.id] for m in first] == [
            "pending_30",
            "lease_expired",
            "pending_30_later_id",
        ]
        # Then one at a time: the next oldest.
        assert [name_of[m.id] for m in claim(1, token)] == ["failed_due"]
        assert [name_of[m.id] for m in claim(1, token)] == ["pending_10"]
        # Nothing else is due but the locked row, and the claim does not wait for it.
        assert claim(10, token) == []
        assert OutboxMessage.objects.get(pk=rows["oldest_locked"].pk).status == Status.PENDING
    # The lock is released: the row is claimable again.
    assert [name_of[m.id] for m in claim(10, token)] == ["oldest_locked"]

    claimed = OutboxMessage.objects.filter(lease_token=token)
    assert set(claimed.values_list("status", flat=True)) == {Status.PROCESSING}
    assert claimed.count() == 6
    assert not claimed.filter(locked_until__lte=timezone.now()).exists()
    assert set(claimed.values_list("locked_by", flat=True)) == {"w"}
    untouched = ["failed_not_due", "lease_live", "published", "abandoned"]
    for name in untouched:
        row = OutboxMessage.objects.get(pk=rows[name].pk)
        assert (row.status, row.lease_token) == (rows[name].status, rows[name].lease_token), name


def test_the_claimed_messages_carry_the_rows_columns(claim):
    row = OutboxMessageFactory(
        payload={"b": 1, "a": [1, "x"]}, headers={"tenant": "t1"}, ordering_key="k1", attempts=2
    )
    (message,) = claim(5, uuid.uuid4())
    assert (message.id, message.event_id, message.event_type, message.destination) == (
        row.pk,
        row.event_id,
        row.event_type,
        row.destination,
    )
    assert (message.headers, message.ordering_key, message.attempts) == ({"tenant": "t1"}, "k1", 2)
    assert json.loads(message.payload) == {"b": 1, "a": [1, "x"]}
    assert message.created_at == OutboxMessage.objects.get(pk=row.pk).created_at


def test_rows_sharing_their_headers_get_equal_dicts_of_their_own(claim):
    """The claim decodes each distinct headers text once; a message whose headers a
    transport changes changes no other message's."""
    shared = {"traceparent": f"00-{'a' * 32}-{'b' * 16}-01", "tenant": "t1"}
    for _ in range(3):
        OutboxMessageFactory(headers=shared)
    OutboxMessageFactory(headers={"tenant": "t2"})
    OutboxMessageFactory(headers={})
    first, second, third, other, empty = claim(10, uuid.uuid4())
    assert first.headers == second.headers == third.headers == shared
    assert (other.headers, empty.headers) == ({"tenant": "t2"}, {})
    first.headers["tenant"] = "changed"
    empty.headers["x"] = 1
    assert second.headers == third.headers == shared
    assert claim(10, uuid.uuid4()) == []  # (claimed already)
    assert OutboxMessageFactory(headers={}) and claim(10, uuid.uuid4())[0].headers == {}


@pytest.mark.parametrize("headers", ["[1]", '"text"', "null", "3"])
def test_headers_that_are_no_object_come_back_as_stored(claim, headers):
    """A row written around stage() (raw SQL) may hold headers that are no JSON object:
    the claim returns them as they are, for that message's publish to fail alone."""
    OutboxMessageFactory()
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {OutboxMessage._meta.db_table} SET headers = %s::jsonb", [headers])
    (message,) = claim(5, uuid.uuid4())
    assert message.headers == json.loads(headers)


@pytest.mark.parametrize("use_tz", [True, False])
def test_the_claimed_created_at_is_the_stored_one_to_the_microsecond(claim, settings, use_tz):
    """The claim sends ``created_at`` as microseconds since the epoch: it comes back as
    Django reads the column, aware in UTC with ``USE_TZ``, naive in ``TIME_ZONE`` without."""
    settings.USE_TZ, settings.TIME_ZONE = use_tz, "America/Chicago"
    row = OutboxMessageFactory()
    OutboxMessage.objects.filter(pk=row.pk).update(
        created_at=dt.datetime(2026, 3, 8, 8, 30, 1, 999_999, tzinfo=dt.UTC)  # DST starts
    )
    stored = OutboxMessage.objects.get(pk=row.pk).created_at
    (message,) = claim(5, uuid.uuid4())
    assert (message.created_at, message.created_at.tzinfo) == (stored, stored.tzinfo)
    expected = "2026-03-08T08:30:01.999999+00:00" if use_tz else "2026-03-08T03:30:01.999999"
    assert message.created_at.isoformat() == expected


@pytest.mark.django_db(transaction=True, databases=["lite"])
def test_the_portable_claim_on_sqlite_takes_the_oldest_due_rows_first():
    """SQLite has no SKIP LOCKED (one relay per database); the order is the same."""
    rows = _rows("lite")
    name_of = {row.pk: name for name, row in rows.items()}
    token = uuid.uuid4()

    def claim(limit: int) -> list[str]:
        return [name_of[m.id] for m in db._claim_portable("lite", limit, 2**62, 30, "w", token)]

    assert claim(3) == ["pending_30", "lease_expired", "oldest_locked"]  # in id order
    assert claim(1) == ["pending_30_later_id"]
    assert claim(1) == ["failed_due"]
    assert claim(1) == ["pending_10"]
    assert claim(10) == []
    claimed = OutboxMessage.objects.using("lite").filter(lease_token=token)
    assert set(claimed.values_list("status", flat=True)) == {Status.PROCESSING}
    assert claimed.count() == 6


def _show_synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0])


def test_an_unordered_claim_skips_its_own_wal_flush_but_never_a_callers_or_a_whole_claims():
    """Alone (the relay's case), the unordered claim's implicit transaction commits without
    waiting for its WAL flush; the whole claim (ordered rows: their lease must be durable
    before they are published) and a claim inside a caller's transaction (whose commit it
    would make unflushed) wait for it; the session's setting is unchanged throughout."""
    from django.db import transaction
    from django.test.utils import CaptureQueriesContext

    def claimed(**kwargs: bool) -> str:
        token = uuid.uuid4()
        with CaptureQueriesContext(connection) as sent:
            rows = db.claim("default", limit=1, lease_seconds=30, worker="w", token=token, **kwargs)
        assert len(rows) == 1
        return sent.captured_queries[-1]["sql"]

    OutboxMessageFactory.create_batch(3)
    with connection.cursor() as cursor:  # the test settings turn it off for the session
        cursor.execute("SET synchronous_commit = on")
    try:
        assert "SET LOCAL synchronous_commit = off" in claimed(ordered=False)
        assert _show_synchronous_commit() == "on"
        assert "synchronous_commit" not in claimed(ordered=True)
        with transaction.atomic():
            assert "synchronous_commit" not in claimed(ordered=False)
            assert _show_synchronous_commit() == "on"
    finally:
        connection.close()  # back to the test settings' session


def test_a_server_side_binding_cursor_gets_the_unordered_claim_alone():
    """With ``"server_side_binding": True`` Django's cursors use the extended protocol,
    which takes one statement a query: the claim goes without its ``SET LOCAL`` (and
    waits for its flush) instead of failing with "cannot insert multiple commands"."""
    from django.db.backends.postgresql.base import ServerBindingCursor

    OutboxMessageFactory.create_batch(2)
    connection.ensure_connection()
    connection.connection.cursor_factory = ServerBindingCursor
    try:
        token = uuid.uuid4()
        claimed = db.claim(
            "default", limit=5, lease_seconds=30, worker="w", token=token, ordered=False
        )
    finally:
        connection.close()  # a new connection takes the test settings' cursor again
    assert len(claimed) == 2
