"""The admin on real PostgreSQL: lists, filters, search, escaping, actions, permissions, counts."""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.contrib.messages import get_messages
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_outbox import stage
from django_outbox.db import EXACT_COUNT_LIMIT, RowCount, count_rows
from django_outbox.models import InboxFailure, OutboxMessage, WorkerHeartbeat
from django_outbox.state import status
from tests.factories import InboxMessageFactory, OutboxMessageFactory
from tests.support import as_on_the_table

pytestmark = pytest.mark.django_db

Status = OutboxMessage.Status
CHANGELIST = reverse("admin:django_outbox_outboxmessage_changelist")
HOUR = dt.timedelta(hours=1)


def change_url(row: OutboxMessage) -> str:
    return reverse("admin:django_outbox_outboxmessage_change", args=[row.pk])


def listed(response) -> list[int]:
    assert response.status_code == 200
    return sorted(row.pk for row in response.context["cl"].result_list)


def logged_in(client, *codenames: str):
    """``client`` logged in as a staff user with exactly these django_outbox permissions."""
    user = User.objects.create_user("operator", password="unused", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(content_type__app_label="django_outbox", codename__in=codenames)
    )
    client.force_login(user)
    return client


def run_action(client, action: str, rows):
    return client.post(
        CHANGELIST,
        {"action": action, "_selected_action": [row.pk for row in rows], "index": 0},
    )


def messages_of(response) -> list[tuple[str, str]]:
    return [(m.level_tag, str(m)) for m in get_messages(response.wsgi_request)]


@pytest.fixture
def rows():
    now = timezone.now()
    return {
        "pending": OutboxMessageFactory(event_type="order.placed", destination="orders"),
        "failed": OutboxMessageFactory(
            event_type="order.paid",
            destination="billing",
            status=Status.FAILED,
            attempts=3,
            last_error="ConnectionError: broker went away",
        ),
        "abandoned": OutboxMessageFactory(
            event_type="user.created",
            destination="crm",
            status=Status.ABANDONED,
            attempts=10,
            abandoned_at=now,
            ordering_key="user-7",
        ),
        "published": OutboxMessageFactory(event_type="order.placed", published=True),
        # A relay holds it right now.
        "leased": OutboxMessageFactory(
            event_type="stock.reserved",
            status=Status.PROCESSING,
            locked_until=now + HOUR,
            available_at=now + HOUR,
            lease_token=uuid.uuid4(),
            locked_by="relay-1",
        ),
        # Its relay died an hour ago.
        "expired": OutboxMessageFactory(
            event_type="stock.reserved",
            status=Status.PROCESSING,
            locked_until=now - HOUR,
            available_at=now - HOUR,
            lease_token=uuid.uuid4(),
            locked_by="relay-0",
        ),
    }


def pks(rows, *names: str) -> list[int]:
    return sorted(rows[name].pk for name in names)


# ---------------------------------------------------------------- the list


def test_changelist_shows_every_row_with_badge_age_and_error_excerpt(admin_client, rows):
    response = admin_client.get(CHANGELIST)
    assert listed(response) == sorted(row.pk for row in rows.values())
    html = response.content.decode()
    assert 'class="outbox-status"' in html
    assert ">Failed</span>" in html
    assert "ConnectionError: broker went away" in html
    assert "0\xa0minutes" in html  # age of a row staged just now


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ({"status__exact": "failed"}, ["failed"]),
        ({"status__exact": "processing"}, ["leased", "expired"]),
        ({"event_type": "order.placed"}, ["pending", "published"]),
        ({"destination": "crm"}, ["abandoned"]),
    ],
)
def test_changelist_filters(admin_client, rows, query, expected):
    assert listed(admin_client.get(CHANGELIST, query)) == pks(rows, *expected)


@pytest.mark.parametrize("value", ["bogus", "FAILED", ""])
def test_a_status_the_filter_does_not_know_is_the_list_with_an_error_not_a_500(
    admin_client, rows, value
):
    """As Django's own filters answer a bad value: a redirect to the list with ``e=1``."""
    response = admin_client.get(CHANGELIST, {"status__exact": value})
    assert response.status_code == 302
    assert response.url.endswith("?e=1")


@pytest.mark.parametrize(
    ("model", "params"),
    [
        ("outboxmessage", {"q": "order-\x00"}),
        ("outboxmessage", {"event_type": "order.\x00"}),
        ("outboxmessage", {"destination": "\x00"}),
        ("outboxmessage", {"status__exact": "\x00"}),
        ("inboxmessage", {"q": "billing\x00"}),
        ("inboxmessage", {"consumer": "\x00"}),
        ("inboxfailure", {"q": "order.\x00"}),
        ("inboxfailure", {"consumer": "\x00"}),
        ("taskresultrecord", {"q": "billing.\x00"}),
        ("taskresultrecord", {"queue_name": "\x00"}),
        ("taskresultrecord", {"status__exact": "\x00"}),
    ],
)
def test_a_nul_in_a_search_or_a_filter_is_the_list_with_an_error_not_a_500(
    admin_client, caplog, model, params
):
    """A NUL character (typed, pasted, in a link someone sent) in a filter value or a
    search term: no stored text holds one, and PostgreSQL refuses it in a query (a 500
    before, through the value filters). As Django answers a bad filter value: the list
    with e=1, the refusal logged once, naming the filter."""
    caplog.set_level(logging.INFO, logger="django_outbox")
    response = admin_client.get(reverse(f"admin:django_outbox_{model}_changelist"), params)
    (name,) = params
    if name == "q":  # Django's search form refuses it: the list, with its message
        assert response.status_code == 200
        assert "Null characters are not allowed." in response.content.decode()
    else:
        assert response.status_code == 302
        assert response.url.endswith("?e=1")
    refused = [r.getMessage() for r in caplog.records if r.name == "django_outbox.admin.window"]
    # (an unknown status is the status filter's own refusal)
    logged = name != "q" and (model, name) != ("outboxmessage", "status__exact")
    line = f"admin filter {name} refused: its value holds a NUL character, which no stored text"
    assert refused == [f"{line} can"] * logged


def test_created_at_filter_keeps_todays_rows_and_drops_old_ones(admin_client, rows):
    old = OutboxMessageFactory()
    OutboxMessage.objects.filter(pk=old.pk).update(
        created_at=timezone.now() - dt.timedelta(days=30)
    )
    response = admin_client.get(CHANGELIST)
    assert old.pk in listed(response)
    cl = response.context["cl"]
    (created_at,) = (spec for spec in cl.filter_specs if spec.field_path == "created_at")
    today = next(c["query_string"] for c in created_at.choices(cl) if c["display"] == "Today")
    assert listed(admin_client.get(CHANGELIST + today)) == sorted(row.pk for row in rows.values())


def test_filter_choices_list_the_values_in_use(admin_client, rows):
    html = admin_client.get(CHANGELIST).content.decode()
    for value in ("order.placed", "order.paid", "user.created", "billing", "crm"):
        assert f"={value}" in html, value


def test_a_value_filter_offers_and_lists_the_recent_window_only(admin_client, rows, monkeypatch):
    """Choices and rows come from the newest RECENT_ROWS rows (here the newest two): a
    value seen only in older rows is offered when selected, and lists nothing."""
    from django_outbox.admin import window

    monkeypatch.setattr(window, "RECENT_ROWS", 2)
    response = admin_client.get(CHANGELIST, {"destination": "crm"})
    assert listed(response) == []
    spec = next(s for s in response.context["cl"].filter_specs if s.field_path == "event_type")
    assert spec.lookup_choices == ["stock.reserved"]  # the newest two rows' type
    spec = next(s for s in response.context["cl"].filter_specs if s.field_path == "destination")
    assert "crm" in spec.lookup_choices
    assert listed(admin_client.get(CHANGELIST, {"event_type": "stock.reserved"})) == pks(
        rows, "leased", "expired"
    )


@pytest.mark.parametrize(
    ("term", "expected"),
    [
        ("user-7", ["abandoned"]),  # ordering key, exact, through its index
        ("USER-7", []),  # exact: case matters
        ("user-", []),  # not a start: the whole key
        ("order.placed", []),  # event types are not searched: the filter has them
        ("nothing-like-this", []),
        ("1234", []),  # not a UUID: searches the keys, no error
    ],
)
def test_search_by_ordering_key(admin_client, rows, term, expected):
    assert listed(admin_client.get(CHANGELIST, {"q": term})) == pks(rows, *expected)


def test_search_by_event_id_is_an_exact_uuid_match(admin_client, rows):
    row = rows["failed"]
    assert listed(admin_client.get(CHANGELIST, {"q": str(row.event_id)})) == [row.pk]
    assert listed(admin_client.get(CHANGELIST, {"q": row.event_id.hex.upper()})) == [row.pk]
    assert listed(admin_client.get(CHANGELIST, {"q": str(uuid.uuid4())})) == []


def test_a_quoted_uuid_searches_the_ordering_key(admin_client):
    key = str(uuid.uuid4())
    row = OutboxMessageFactory(ordering_key=key)
    assert listed(admin_client.get(CHANGELIST, {"q": key})) == []
    assert listed(admin_client.get(CHANGELIST, {"q": f'"{key}"'})) == [row.pk]


def test_summary_counts_every_state_and_the_oldest_due_age(admin_client, rows):
    OutboxMessage.objects.filter(pk=rows["pending"].pk).update(
        available_at=timezone.now() - dt.timedelta(hours=3)
    )
    response = admin_client.get(CHANGELIST)
    html = response.content.decode()
    counts = {value: count for value, _label, count in response.context["outbox_summary"]["states"]}
    assert {value: (count.value, count.exact) for value, count in counts.items()} == {
        "pending": (1, True),
        "processing": (2, True),
        "published": (1, True),
        "failed": (1, True),
        "abandoned": (1, True),
    }
    assert '<a href="?status__exact=processing">Processing</a>:' in html
    assert "The oldest due message has waited 3\xa0hours" in html


def test_summary_says_when_nothing_is_due(admin_client):
    OutboxMessageFactory(published=True)
    assert "Nothing is due." in admin_client.get(CHANGELIST).content.decode()


# ---------------------------------------------------------------- the detail page


def test_detail_page_shows_payload_and_headers_escaped_and_pretty(admin_client):
    row = OutboxMessageFactory(
        payload={"note": "<script>alert('payload')</script>", "n": 1},
        headers={"x-evil": '"><img src=x onerror=alert(1)>'},
        last_error="<b>not bold</b>",
    )
    html = admin_client.get(change_url(row)).content.decode()
    assert "<script>alert(" not in html
    assert "<img src=x" not in html
    assert "<b>not bold</b>" not in html
    assert (
        '<pre class="outbox-json">{\n  &quot;n&quot;: 1,\n  &quot;note&quot;: '
        "&quot;&lt;script&gt;alert(&#x27;payload&#x27;)&lt;/script&gt;&quot;\n}</pre>"
    ) in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "&lt;b&gt;not bold&lt;/b&gt;" in html


def test_detail_page_is_read_only_even_for_a_superuser(admin_client, rows):
    row = rows["failed"]
    html = admin_client.get(change_url(row)).content.decode()
    assert "ConnectionError: broker went away" in html
    assert 'name="event_type"' not in html
    assert 'name="_save"' not in html
    admin_client.post(change_url(row), {"event_type": "edited", "status": "pending"})
    row.refresh_from_db()
    assert (row.event_type, row.status) == ("order.paid", Status.FAILED)
    add = reverse("admin:django_outbox_outboxmessage_add")
    assert admin_client.get(add).status_code == 403


def test_only_superusers_delete_and_never_in_bulk(client, admin_client, rows):
    row = rows["pending"]
    delete = reverse("admin:django_outbox_outboxmessage_delete", args=[row.pk])
    logged_in(client, "view_outboxmessage", "delete_outboxmessage", "requeue_outboxmessage")
    assert client.post(delete, {"post": "yes"}).status_code == 403
    choices = dict(admin_client.get(CHANGELIST).context["action_form"].fields["action"].choices)
    assert "delete_selected" not in choices
    assert admin_client.post(delete, {"post": "yes"}).status_code == 302
    assert not OutboxMessage.objects.filter(pk=row.pk).exists()


# ---------------------------------------------------------------- actions and permissions


def test_view_only_staff_sees_no_actions_and_cannot_run_them(client, rows):
    logged_in(client, "view_outboxmessage", "change_outboxmessage")
    response = client.get(CHANGELIST)
    assert response.status_code == 200
    assert response.context["action_form"] is None
    assert 'name="action"' not in response.content.decode()
    run_action(client, "requeue", [rows["failed"]])
    run_action(client, "abandon", [rows["pending"]])
    rows["failed"].refresh_from_db()
    rows["pending"].refresh_from_db()
    assert (rows["failed"].status, rows["pending"].status) == (Status.FAILED, Status.PENDING)


def test_requeue_permission_without_view_permission_opens_nothing(client):
    logged_in(client, "requeue_outboxmessage")
    assert client.get(CHANGELIST).status_code == 403


def test_staff_with_the_permission_sees_every_action(client, rows):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    choices = dict(client.get(CHANGELIST).context["action_form"].fields["action"].choices)
    assert set(choices) == {"", "requeue", "abandon", "requeue_head", "skip_head"}


def test_requeue_moves_failed_and_abandoned_rows_and_counts_the_refused(client, rows):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    response = run_action(client, "requeue", rows.values())
    assert response.status_code == 302
    assert messages_of(response) == [
        ("success", "2 messages requeued: pending again, attempts reset."),
        (
            "warning",
            "4 selected messages were not requeued: only failed or abandoned messages can be.",
        ),
    ]
    for name in ("failed", "abandoned"):
        row = OutboxMessage.objects.get(pk=rows[name].pk)
        assert (row.status, row.attempts, row.last_error, row.abandoned_at) == (
            Status.PENDING,
            0,
            "",
            None,
        )
    assert OutboxMessage.objects.get(pk=rows["leased"].pk).status == Status.PROCESSING


def test_requeue_of_one_row_speaks_in_the_singular(client, rows):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    response = run_action(client, "requeue", [rows["failed"], rows["published"]])
    assert messages_of(response) == [
        ("success", "1 message requeued: pending again, attempts reset."),
        (
            "warning",
            "1 selected message was not requeued: only failed or abandoned messages can be.",
        ),
    ]


def test_abandon_stops_pending_failed_and_expired_rows_never_a_live_lease(client, rows):
    logged_in(client, "view_outboxmessage", "requeue_outboxmessage")
    response = run_action(client, "abandon", rows.values())
    assert messages_of(response) == [
        ("success", "3 messages abandoned: the relay will not send them."),
        (
            "warning",
            "3 selected messages were not abandoned: only pending or failed messages "
            "(or processing ones whose lease expired) can be.",
        ),
    ]
    status = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert {name: status[row.pk] for name, row in rows.items()} == {
        "pending": Status.ABANDONED,
        "failed": Status.ABANDONED,
        "expired": Status.ABANDONED,
        "abandoned": Status.ABANDONED,
        "published": Status.PUBLISHED,
        "leased": Status.PROCESSING,
    }
    expired = OutboxMessage.objects.get(pk=rows["expired"].pk)
    assert expired.abandoned_at is not None
    assert (expired.locked_until, expired.locked_by, expired.lease_token) == (None, "", None)
    leased = OutboxMessage.objects.get(pk=rows["leased"].pk)
    assert leased.lease_token == rows["leased"].lease_token


def test_actions_over_all_filtered_rows(admin_client, rows):
    response = admin_client.post(
        CHANGELIST + "?status__exact=failed",
        {"action": "requeue", "select_across": 1, "index": 0, "_selected_action": [0]},
    )
    assert messages_of(response) == [
        ("success", "1 message requeued: pending again, attempts reset.")
    ]
    assert OutboxMessage.objects.failed().count() == 0


# ---------------------------------------------------------------- big tables


def test_count_rows_is_exact_up_to_the_limit_then_the_planners_estimate():
    OutboxMessage.objects.bulk_create(
        OutboxMessage(event_type="bulk", destination="d", payload={}) for _ in range(40)
    )
    rows = OutboxMessage.objects.all()
    assert count_rows(rows, exact_up_to=40) == count_rows(rows) == RowCount(40, exact=True)
    with connection.cursor() as cursor:
        cursor.execute(f'ANALYZE "{OutboxMessage._meta.db_table}"')
    estimate = count_rows(rows, exact_up_to=10)
    assert not estimate.exact
    assert 11 <= estimate.value <= 80


def test_the_summary_reads_every_count_from_an_index(rows):
    """A count by status alone reads the table (published rows and all) for the states
    without a partial index of their own: on a retained million rows, every scrape and
    admin page paid for a scan. Each of summary()'s queries must have a plan without
    one, with sequential scans priced out (``enable_seqscan`` off)."""
    # An ordered row in each of the states the due indexes hold.
    OutboxMessageFactory(ordering_key="k", sequence=1)
    OutboxMessageFactory(ordering_key="k", sequence=2, status=Status.PROCESSING)
    with CaptureQueriesContext(connection) as queries:
        counts = status.summary(blocked=True).counts
    (plan,) = _plans(queries).values()  # one statement
    assert "Seq Scan" not in plan
    # Pending and processing in two parts (a due index each; the ordered part may read
    # the key's unfinished events instead, an index on the same rows), the others by
    # their own.
    for index in ("due", "failed", "abandoned", "published", "key_unfinished"):
        assert f"outbox_{index}_idx" in plan
    assert all(count.exact for count in counts.values())
    assert {state: count.value for state, count in counts.items()} == dict(
        pending=2, processing=3, published=1, failed=1, abandoned=1
    )


def test_the_due_rows_are_counted_through_the_due_indexes(rows):
    """What a drain counts (its progress total, exact, and the rows it left untried,
    bounded) is read in two parts, each through its due index, never by a scan."""
    OutboxMessageFactory(ordering_key="k", sequence=1)
    with CaptureQueriesContext(connection) as queries:
        counted = (status.due_count(), status.due_rows())
    assert counted == (4, RowCount(4, exact=True))
    assert OutboxMessage.objects.due().count() == 4
    plans = _plans(queries)
    assert len(plans) == 4
    assert [sql for sql, plan in plans.items() if "Seq Scan" in plan] == []


def _case(name: str, states: set[str], select: Callable[[Any], Any]) -> Any:
    return pytest.param(select, states, id=name)


@pytest.mark.parametrize(
    ("select", "states"),
    [_case(s.value, {s.value}, lambda q, s=s: q.in_states(s)) for s in Status]
    + [
        _case("failed+pending", {"pending", "failed"}, lambda q: q.in_states("failed", "pending")),
        _case("requeueable", {"failed", "abandoned"}, lambda q: q.requeueable()),
        _case("abandonable", {"pending", "failed", "expired"}, lambda q: q.abandonable()),
    ],
)
def test_the_rows_of_a_state_are_read_from_an_index(rows, select, states):
    """The admin's status filter, the rows an operator requeues or abandons, and a
    state's count: by ``status`` alone each was a scan of the table, a retained
    million published rows and all. Read through indexes, they are the same rows."""
    OutboxMessageFactory(ordering_key="k", sequence=1)  # an ordered row (the other index)
    OutboxMessageFactory(status=Status.PROCESSING, locked_until=timezone.now() - HOUR)
    selected = select(OutboxMessage.objects.all())
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        plan = selected.order_by().explain()
    # Neither a scan of the table nor a walk of its primary key or event ids, filtered.
    assert "Seq Scan" not in plan and "_pkey" not in plan and "event_id" not in plan
    by_status = OutboxMessage.objects.filter(status__in=states)
    if "expired" in states:  # leased out, the lease expired: its relay died
        expired = dict(status=Status.PROCESSING, locked_until__lte=timezone.now())
        by_status = by_status | OutboxMessage.objects.filter(**expired)
    assert set(selected) == set(by_status) != set()


def _plans(queries: Iterable[dict[str, str]]) -> dict[str, str]:
    """Each captured query's plan, with sequential scans priced out: a plan that
    still has one had no index to read."""
    plans = {}
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        for query in queries:
            cursor.execute(f"EXPLAIN {query['sql']}")
            plans[query["sql"]] = as_on_the_table("\n".join(line for (line,) in cursor.fetchall()))
    return plans


@pytest.mark.parametrize(
    ("unordered", "ordered", "exact"),
    [(2, 1, True), (3, 0, True), (0, 3, True), (2, 2, False), (3, 1, False), (4, 1, False)],
)
def test_a_state_counted_in_two_parts_is_exact_up_to_the_limit_in_all(
    monkeypatch, unordered, ordered, exact
):
    """Pending rows are counted as their unordered and ordered parts: the second part
    counts up to what the first left of the limit, so that an exact count is never above
    it, and one past it is the planner's estimate."""
    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", 3)
    OutboxMessageFactory.create_batch(unordered)
    for sequence in range(1, ordered + 1):
        OutboxMessageFactory(ordering_key="k", sequence=sequence)
    counted = status.count_state(OutboxMessage.objects.all(), "pending")
    if exact:
        assert counted == RowCount(unordered + ordered, exact=True)
    else:
        assert not counted.exact and counted.value >= 4


@pytest.mark.parametrize(("unordered", "ordered"), [(2, 1), (3, 0), (0, 3), (2, 2), (4, 1)])
def test_the_summary_in_one_statement_counts_as_the_orm_does(monkeypatch, unordered, ordered):
    """On PostgreSQL summary() reads its figures in one statement, each part up to the
    limit plus one: a state at or under the limit in all is exact, as count_state says;
    past it, it is not, and a part past the limit is the planner's estimate (an EXPLAIN
    more), never below the rows seen."""
    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", 3)
    OutboxMessageFactory.create_batch(unordered)
    for sequence in range(1, ordered + 1):
        OutboxMessageFactory(ordering_key="k", sequence=sequence)
    with CaptureQueriesContext(connection) as queries:
        read = status.summary(states=("pending", "failed")).counts
    by_orm = status.count_state(OutboxMessage.objects.all(), "pending")
    assert read["failed"] == RowCount(0, exact=True)
    assert read["pending"].exact == by_orm.exact == (unordered + ordered <= 3)
    assert read["pending"].value >= unordered + ordered
    if read["pending"].exact:
        assert read["pending"].value == unordered + ordered
    assert len(queries) == (2 if max(unordered, ordered) > 3 else 1)


@pytest.mark.parametrize("limit", [1, 4])
def test_the_summary_counts_the_blocked_keys_in_its_statement(monkeypatch, limit):
    """Asked for, the blocked keys are read in the same statement: a key (of one
    destination) whose head, its first row not published, is ABANDONED. Rows behind a
    head do not count, nor an ABANDONED row with an unfinished one before it, nor a key's
    rows on another destination. Past the limit, the planner's estimate."""
    monkeypatch.setattr(status, "EXACT_COUNT_LIMIT", limit)
    for key, states in [
        ("a", [Status.ABANDONED, Status.ABANDONED]),  # blocked, once
        ("b", [Status.ABANDONED]),  # blocked
        ("c", [Status.PENDING, Status.ABANDONED]),  # not blocked: its head is pending
        ("d", [Status.PUBLISHED, Status.ABANDONED]),  # blocked: its head is the second
    ]:
        for sequence, state in enumerate(states, start=1):
            OutboxMessageFactory(destination="orders", ordering_key=key, sequence=sequence,
                                 status=state)  # fmt: skip
    OutboxMessageFactory(destination="billing", ordering_key="c", sequence=1,
                         status=Status.ABANDONED)  # fmt: skip  # blocked: another key
    assert status.blocked_count() == RowCount(4, exact=True)
    with CaptureQueriesContext(connection) as queries:
        read = status.summary(states=(), blocked=True).blocked
    if limit >= 4:
        assert read == RowCount(4, exact=True) and len(queries) == 1
    else:
        assert read is not None and not read.exact and read.value >= 2  # an EXPLAIN more
        assert len(queries) == 2
    assert status.summary(states=()).blocked is None


def test_the_summary_in_one_statement_finds_the_oldest_due_row_of_both_due_indexes():
    """The backlog age is the older of the two due indexes' oldest due rows: a row
    not due yet, or published, does not count."""
    now = timezone.now()
    OutboxMessageFactory(available_at=now - dt.timedelta(minutes=5))
    OutboxMessageFactory(ordering_key="k", sequence=1, available_at=now - dt.timedelta(hours=1))
    OutboxMessageFactory(available_at=now + dt.timedelta(hours=1))
    OutboxMessageFactory(status=Status.PUBLISHED, available_at=now - dt.timedelta(days=1))
    read = status.summary(states=()).oldest_due_age
    assert read is not None and dt.timedelta(minutes=59) < read < dt.timedelta(minutes=61)
    OutboxMessage.objects.filter(sequence=1).delete()
    read = status.summary(states=()).oldest_due_age
    assert read is not None and dt.timedelta(minutes=4) < read < dt.timedelta(minutes=6)


def test_a_row_staged_in_the_open_transaction_is_due_by_the_statements_clock():
    """Due is by the ORM's Now() (the statement's time), not the transaction's start: a
    row staged in this (the test's) transaction is due when summary() reads it after."""
    with transaction.atomic():
        stage("a", {}, destination="orders")
        assert OutboxMessage.objects.due().exists()
        assert status.summary(states=()).oldest_due_age is not None


@pytest.mark.parametrize("state", [Status.PENDING, Status.PROCESSING])
def test_the_list_filtered_by_a_state_without_an_index_reads_the_due_indexes(
    admin_client, rows, state
):
    """Filtered by pending or processing (no index of their own), the list's count
    would be a scan of the table, published rows and all: it reads the due indexes,
    and lists the same rows."""
    ordered = OutboxMessageFactory(ordering_key="k", sequence=1, status=state)
    expected = sorted(OutboxMessage.objects.filter(status=state).values_list("pk", flat=True))
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(CHANGELIST, {"status__exact": state})
    assert sorted(listed(response)) == expected and ordered.pk in expected
    table = OutboxMessage._meta.db_table
    plans = _plans([q for q in queries if q["sql"].startswith("SELECT") and table in q["sql"]])
    assert [sql for sql, plan in plans.items() if "Seq Scan" in plan] == []
    (count,) = [plan for sql, plan in plans.items() if "COUNT(*)" in sql and state in sql]
    # The ordered part may read the key's unfinished events instead: an index on the same rows.
    assert "outbox_due_idx" in count
    assert "outbox_ordered_due_idx" in count or "outbox_key_unfinished_idx" in count


@pytest.mark.django_db(databases=["default", "lite"])
def test_on_sqlite_a_state_is_counted_whole():
    """SQLite takes a partial index only for a query that repeats its condition: two
    parts would be two scans there, so a state is one count."""
    rows = OutboxMessage.objects.using("lite")
    rows.bulk_create(OutboxMessageFactory.build_batch(2))
    rows.bulk_create(OutboxMessageFactory.build_batch(1, ordering_key="k", sequence=1))
    with CaptureQueriesContext(connections["lite"]) as queries:
        assert status.count_state(rows, "pending") == RowCount(3, exact=True)
    assert len(queries) == 1


def test_unfiltered_changelist_never_counts_the_whole_table(admin_client):
    total = EXACT_COUNT_LIMIT + 50
    OutboxMessage.objects.bulk_create(
        (OutboxMessage(event_type="bulk", destination="d", payload={"n": n}) for n in range(total)),
        batch_size=5000,
    )
    with connection.cursor() as cursor:
        cursor.execute(f'ANALYZE "{OutboxMessage._meta.db_table}"')
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(CHANGELIST)
    assert response.status_code == 200
    counts = [q["sql"] for q in queries if "COUNT(" in q["sql"].upper()]
    assert counts, "the paginator and the summary count something"
    unbounded = [sql for sql in counts if "LIMIT" not in sql.upper()]
    assert unbounded == []
    cl = response.context["cl"]
    assert not cl.paginator.row_count.exact
    assert total * 0.5 <= cl.result_count <= total * 2
    assert len(cl.result_list) == cl.list_per_page
    html = response.content.decode()
    assert "this is PostgreSQL's estimate" in html
    assert "_facets" not in html


def test_changelist_queries_do_not_grow_with_the_rows_shown(admin_client):
    def queries_for(n: int) -> int:
        OutboxMessageFactory.create_batch(n)
        with CaptureQueriesContext(connection) as queries:
            assert admin_client.get(CHANGELIST).status_code == 200
        return len(queries)

    assert queries_for(3) == queries_for(60)


# ---------------------------------------------------------------- the inbox


def test_inbox_admin_lists_filters_by_consumer_and_finds_an_event_id(admin_client):
    billing = InboxMessageFactory(consumer="billing")
    shipping = InboxMessageFactory(consumer="shipping")
    url = reverse("admin:django_outbox_inboxmessage_changelist")
    assert listed(admin_client.get(url)) == sorted([billing.pk, shipping.pk])
    assert listed(admin_client.get(url, {"consumer": "shipping"})) == [shipping.pk]
    assert listed(admin_client.get(url, {"q": str(billing.event_id)})) == [billing.pk]
    assert listed(admin_client.get(url, {"q": "billing"})) == []  # the filter has consumers
    assert admin_client.get(reverse("admin:django_outbox_inboxmessage_add")).status_code == 403


def test_inbox_failure_admin_shows_parked_letters_with_their_body_escaped(admin_client):
    parked = InboxFailure.objects.create(
        consumer="billing",
        event_id=uuid.uuid4(),
        event_type="order.paid",
        attempts=5,
        last_error="ValueError: <bad>",
        body='{"order_id": 7, "note": "<script>x()</script>"}',
        headers={"event_type": "order.paid"},
        parked_at=timezone.now(),
    )
    failing = InboxFailure.objects.create(
        consumer="shipping", event_id=uuid.uuid4(), attempts=1, body="not json <i>"
    )
    url = reverse("admin:django_outbox_inboxfailure_changelist")
    assert listed(admin_client.get(url)) == sorted([parked.pk, failing.pk])
    assert listed(admin_client.get(url, {"consumer": "billing"})) == [parked.pk]
    assert listed(admin_client.get(url, {"parked_at__isempty": "0"})) == [parked.pk]
    assert listed(admin_client.get(url, {"q": str(failing.event_id)})) == [failing.pk]

    html = admin_client.get(
        reverse("admin:django_outbox_inboxfailure_change", args=[parked.pk])
    ).content.decode()
    assert "<script>" not in html
    assert (
        '<pre class="outbox-json">{\n  &quot;note&quot;: &quot;&lt;script&gt;x()&lt;/script&gt;'
        "&quot;,\n  &quot;order_id&quot;: 7\n}</pre>"
    ) in html
    assert "ValueError: &lt;bad&gt;" in html
    html = admin_client.get(
        reverse("admin:django_outbox_inboxfailure_change", args=[failing.pk])
    ).content.decode()
    assert '<pre class="outbox-json">not json &lt;i&gt;</pre>' in html


def test_an_event_id_is_found_in_the_inbox_of_every_consumer(admin_client):
    """The inbox's index leads with the consumer: an event id is searched by one probe per
    consumer (test_admin_plans.py holds the plans), and finds each consumer's mark."""
    event_id = uuid.uuid4()
    marks = [InboxMessageFactory(consumer=name, event_id=event_id) for name in ("a", "b", "c")]
    InboxMessageFactory(consumer="d")
    url = reverse("admin:django_outbox_inboxmessage_changelist")
    assert listed(admin_client.get(url, {"q": str(event_id)})) == sorted(m.pk for m in marks)


def test_a_failure_is_found_by_the_start_of_its_event_type_in_the_recent_window(
    admin_client, monkeypatch
):
    from django_outbox.admin import window

    old, new = (
        InboxFailure.objects.create(consumer="billing", event_id=uuid.uuid4(), event_type=name)
        for name in ("order.paid", "order.placed")
    )
    url = reverse("admin:django_outbox_inboxfailure_changelist")
    assert listed(admin_client.get(url, {"q": "order."})) == [old.pk, new.pk]
    assert listed(admin_client.get(url, {"q": "ORDER."})) == []  # case matters
    monkeypatch.setattr(window, "RECENT_ROWS", 1)
    assert listed(admin_client.get(url, {"q": "order."})) == [new.pk]


def test_relays_are_searched_by_the_start_of_their_worker_and_a_uuid_is_no_error(admin_client):
    """A UUID term looked for an ``event_id`` the heartbeat rows do not have: a 500."""
    now = timezone.now()
    row = WorkerHeartbeat.objects.create(kind="relay", worker="web-1:42", database="default",
                                         started_at=now, beat_at=now, interval=10)  # fmt: skip
    WorkerHeartbeat.objects.create(kind="relay", worker="web-2:7", database="default",
                                   started_at=now, beat_at=now, interval=10)  # fmt: skip
    url = reverse("admin:django_outbox_workerheartbeat_changelist")
    assert listed(admin_client.get(url, {"q": "web-1"})) == [row.pk]
    assert listed(admin_client.get(url, {"q": str(row.process)})) == [row.pk]
    assert listed(admin_client.get(url, {"q": str(uuid.uuid4())})) == []
