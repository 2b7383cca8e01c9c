"""Every query of every admin page on tables of 200,000 rows, proved by its plan.

The admin promises pages that stay fast on millions of rows. Timings would flake, so
each page is requested for real (the test client, a superuser), every statement it
sends to the database is captured, and each one that reads a big table is run again
under ``EXPLAIN (ANALYZE, FORMAT JSON)``. No node of a plan may examine more than a
tenth of its table: the rows it returned plus the rows it threw away (by filter or by
a lossy bitmap's recheck), times its loops. Nor may an index be searched by a column
other than its first: PostgreSQL 15 then walks the whole index, and the node shows
only the rows it found. The rows are built once for the module by one
``INSERT ... SELECT generate_series`` per table (committed, so each test's own writes
roll back over them) and removed after it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_outbox.admin import ACTION_ROW_LIMIT
from django_outbox.admin.base import PAGE_DEPTH_ROWS
from django_outbox.models import InboxFailure, InboxMessage, OutboxMessage, TaskResultRecord

pytestmark = pytest.mark.django_db

ROWS = 200_000
#: No node of a plan may examine more than this share of its table.
SHARE = 10
BIG = {
    "outbox": OutboxMessage,
    "inbox": InboxMessage,
    "failures": InboxFailure,
    "tasks": TaskResultRecord,
}

# One row in a thousand is FAILED and one in two thousand ABANDONED (of an ordered
# route, so they block their keys), the newest 1,500 are the backlog, the rest are
# published and kept for retention; one event type and one destination are rare.
_OUTBOX = """
INSERT INTO {table} (event_id, event_type, destination, payload, headers, ordering_key,
    status, attempts, available_at, locked_until, locked_by, lease_token, last_error,
    created_at, published_at, abandoned_at, sequence, skipped_at)
SELECT gen_random_uuid(),
    CASE WHEN i % 997 = 0 THEN 'user.deleted'
         ELSE (ARRAY['order.placed', 'order.paid', 'order.shipped', 'user.created',
                     'stock.reserved', 'invoice.sent'])[1 + i % 6] END,
    CASE WHEN i % 1009 = 0 THEN 'audit'
         ELSE (ARRAY['orders', 'billing', 'crm', 'stock', 'ledger'])[1 + i % 5] END,
    jsonb_build_object('order_id', i, 'note', repeat('x', 120)), '{{}}'::jsonb,
    CASE WHEN i % 3 = 0 THEN '' ELSE 'order-' || (i % 20000) END,
    s.status,
    CASE s.status WHEN 'failed' THEN 3 WHEN 'abandoned' THEN 10 ELSE 0 END,
    at, CASE s.status WHEN 'processing' THEN now() + interval '1 minute' END,
    CASE s.status WHEN 'processing' THEN 'relay-1' ELSE '' END,
    CASE s.status WHEN 'processing' THEN gen_random_uuid() END,
    CASE WHEN s.status IN ('failed', 'abandoned') THEN 'ConnectionError: broker went away'
         ELSE '' END,
    at, CASE s.status WHEN 'published' THEN at + interval '1 second' END,
    CASE s.status WHEN 'abandoned' THEN at + interval '1 minute' END,
    CASE WHEN i % 5 = 4 AND i % 1009 <> 0 THEN i END, NULL
FROM generate_series(1, {rows}) AS i,
    LATERAL (SELECT now() - ({rows} - i) * interval '6 seconds' AS at) AS t,
    LATERAL (SELECT CASE WHEN i > {rows} - 1500 AND i % 10 = 0 THEN 'processing'
                         WHEN i > {rows} - 1500 THEN 'pending'
                         WHEN i % 1000 = 1 THEN 'failed'
                         WHEN i % 2000 = 4 THEN 'abandoned'
                         ELSE 'published' END AS status) AS s
"""
_INBOX = """
INSERT INTO {table} (consumer, event_id, processed_at)
SELECT CASE WHEN i % 1013 = 0 THEN 'archive'
            ELSE (ARRAY['billing', 'shipping', 'crm', 'search'])[1 + i % 4] END,
    gen_random_uuid(), now() - ({rows} - i) * interval '6 seconds'
FROM generate_series(1, {rows}) AS i
"""
_FAILURES = """
INSERT INTO {table} (consumer, event_id, queue, event_type, attempts, last_error, body,
    headers, first_failed_at, last_failed_at, parked_at)
SELECT CASE WHEN i % 1013 = 0 THEN 'archive'
            ELSE (ARRAY['billing', 'shipping', 'crm', 'search'])[1 + i % 4] END,
    gen_random_uuid(), 'orders', 'order.placed', 1 + i % 5, 'ValueError: bad', '{{}}',
    '{{}}'::jsonb, at, at, CASE WHEN i % 50 = 0 THEN at END
FROM generate_series(1, {rows}) AS i,
    LATERAL (SELECT now() - ({rows} - i) * interval '6 seconds' AS at) AS t
"""
_TASKS = """
INSERT INTO {table} (id, task_path, backend, queue_name, priority, run_after, args, kwargs,
    status, enqueued_at, started_at, last_attempted_at, finished_at, return_value, errors,
    worker_ids)
SELECT gen_random_uuid(),
    (ARRAY['mail.tasks.send_welcome', 'billing.tasks.charge', 'reports.tasks.build'])[1 + i % 3],
    'default',
    CASE WHEN i % 1013 = 0 THEN 'reports' ELSE (ARRAY['default', 'emails'])[1 + i % 2] END,
    0, NULL, '[]'::jsonb, '{{}}'::jsonb, s.status, at,
    CASE WHEN s.status <> 'READY' THEN at END, CASE WHEN s.status <> 'READY' THEN at END,
    CASE WHEN s.status IN ('SUCCESSFUL', 'FAILED') THEN at + interval '1 second' END,
    'null'::jsonb, '[]'::jsonb, '[]'::jsonb
FROM generate_series(1, {rows}) AS i,
    LATERAL (SELECT now() - ({rows} - i) * interval '6 seconds' AS at) AS t,
    LATERAL (SELECT CASE WHEN i > {rows} - 300 AND i % 3 = 0 THEN 'RUNNING'
                         WHEN i > {rows} - 300 THEN 'READY'
                         WHEN i % 500 = 0 THEN 'FAILED'
                         ELSE 'SUCCESSFUL' END AS status) AS s
"""
_FILL = {"outbox": _OUTBOX, "inbox": _INBOX, "failures": _FAILURES, "tasks": _TASKS}


@pytest.fixture(scope="module")
def big_tables(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """Each admin's table with ``ROWS`` rows, committed for the module, then emptied."""
    tables = [model._meta.db_table for model in BIG.values()]
    with django_db_blocker.unblock():
        with connection.cursor() as cursor:
            for name, model in BIG.items():
                cursor.execute(_FILL[name].format(table=model._meta.db_table, rows=ROWS))
            for table in tables:
                cursor.execute(f'VACUUM ANALYZE "{table}"')
        yield
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE " + ", ".join(f'"{table}"' for table in tables))


def _leading_columns() -> dict[str, str]:
    """The first column of each index of the big tables, by index name."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.relname, a.attname FROM pg_index i"
            " JOIN pg_class c ON c.oid = i.indexrelid"
            " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]"
            " WHERE i.indrelid::regclass::text = ANY(%s)",
            [[f"{m._meta.db_table}" for m in BIG.values()]],
        )
        return dict(cursor.fetchall())


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", ()):
        yield from _nodes(child)


def _examined(node: dict[str, Any]) -> int:
    """The rows a node read: returned, and thrown away by a filter or a lossy bitmap."""
    per_loop = (
        node.get("Actual Rows", 0)
        + node.get("Rows Removed by Filter", 0)
        + node.get("Rows Removed by Index Recheck", 0)
    )
    return int(per_loop * node.get("Actual Loops", 1))


#: Partial indexes of unfinished rows only: walking one reads the backlog of its kind, not
#: the table. (The requeue's check of the selected rows' dedup keys is planned on the
#: empty dedup index here; with a backlog of deduplicated events the id list wins.)
BACKLOG_INDEXES = {"outbox_dedup_unfinished_idx"}


def _walks_whole_index(node: dict[str, Any], leading: dict[str, str]) -> bool:
    """Whether an index is searched by a condition without its first column."""
    index = node.get("Index Name", "")
    cond, column = node.get("Index Cond"), leading.get(index)
    if index in BACKLOG_INDEXES:
        return False
    return bool(cond and column and not re.search(rf"\b{column}\b", cond))


def overreads(queries: list[dict[str, str]]) -> list[str]:
    """Each scan of a big table in the plans of ``queries`` that examined more than a
    ``SHARE``-th of its rows, or walked a whole index, as ``node (rows) <- statement``.
    The statements are run again under EXPLAIN ANALYZE in a savepoint rolled back."""
    tables, leading = {m._meta.db_table for m in BIG.values()}, _leading_columns()
    found = []
    for query in queries:
        sql = query["sql"]
        if not sql.lstrip().upper().startswith(("SELECT", "WITH", "UPDATE", "DELETE")):
            continue
        if not any(f'"{table}"' in sql for table in tables):
            continue
        for node in _plan_nodes(sql):
            name = node.get("Relation Name") or node.get("Index Name")
            over = node.get("Relation Name") in tables and _examined(node) > ROWS // SHARE
            if over or _walks_whole_index(node, leading):
                found.append(f"{name}: {node['Node Type']} ({_examined(node)} rows) <- {sql}")
    return found


def _plan_nodes(sql: str) -> list[dict[str, Any]]:
    with transaction.atomic():  # EXPLAIN ANALYZE runs the statement: undo what it wrote
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}")
            (document,) = cursor.fetchone()
        transaction.set_rollback(True)
    plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
    return list(_nodes(plan))


def captured(client: Any, url: str, data: dict[str, Any] | None = None, post: bool = False):
    """The response to a GET (or POST) of ``url`` and the statements it sent."""
    with CaptureQueriesContext(connection) as queries:
        response = (client.post if post else client.get)(url, data or {})
    assert response.status_code in (200, 302), (url, data, response.status_code)
    return response, list(queries)


def changelist(model: str) -> str:
    return reverse(f"admin:django_outbox_{model}_changelist")


def _row(model: type[Any], **where: Any) -> Any:
    return model.objects.filter(**where).order_by("-pk" if model is not TaskResultRecord
                                                  else "-enqueued_at").first()  # fmt: skip


def filter_links(client: Any, url: str) -> list[str]:
    """The query string of every choice of every filter of the changelist at ``url``."""
    response = client.get(url)
    cl = response.context["cl"]
    links = {choice["query_string"] for spec in cl.filter_specs for choice in spec.choices(cl)}
    return sorted(links)


MODELS = ["outboxmessage", "inboxmessage", "inboxfailure", "taskresultrecord"]


@pytest.mark.parametrize("model", MODELS)
def test_every_filter_choice_of_every_changelist_reads_a_tenth_at_most(
    big_tables, admin_client, model
):
    """The list unfiltered and under each choice its filters offer (every state, each
    event type, destination, consumer and queue seen, each date range), choices and all."""
    url = changelist(model)
    bad = []
    for link in filter_links(admin_client, url):
        _, queries = captured(admin_client, url + link)
        bad += overreads(queries)
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize(
    ("model", "where"),
    [
        ("outboxmessage", {"event_type": "user.deleted"}),
        ("outboxmessage", {"destination": "audit"}),
        ("outboxmessage", {"status__exact": "failed", "event_type": "order.paid"}),
        ("inboxmessage", {"consumer": "archive"}),
        ("inboxfailure", {"consumer": "archive"}),
        ("taskresultrecord", {"queue_name": "reports"}),
        ("taskresultrecord", {"status__exact": "FAILED"}),
    ],
)
def test_a_rare_value_filters_without_reading_the_table(big_tables, admin_client, model, where):
    """A value in few rows is the worst case of a filter: the newest rows first, a
    page's worth is never found early."""
    response, queries = captured(admin_client, changelist(model), where)
    assert response.context["cl"].result_list, where
    assert (bad := overreads(queries)) == [], "\n".join(bad)


def _search_terms() -> dict[str, list[str]]:
    outbox = _row(OutboxMessage, ordering_key__startswith="order-")
    inbox = _row(InboxMessage, consumer="archive")
    failure = _row(InboxFailure, consumer="archive")
    task = _row(TaskResultRecord, status="FAILED")
    return {
        "outboxmessage": [str(outbox.event_id), outbox.ordering_key, "order.", "nothing"],
        "inboxmessage": [str(inbox.event_id), "archive", "nothing"],
        "inboxfailure": [str(failure.event_id), "archive", "order.", "nothing"],
        "taskresultrecord": [str(task.id), "billing.", "nothing"],
    }


@pytest.mark.parametrize("model", MODELS)
def test_every_search_reads_a_tenth_at_most(big_tables, admin_client, model):
    """An event (or task) id, a key or consumer name, a prefix, and a term found nowhere
    (the worst case: nothing stops a scan early)."""
    bad = []
    for term in _search_terms()[model]:
        _, queries = captured(admin_client, changelist(model), {"q": term})
        bad += overreads(queries)
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("model", MODELS)
def test_the_detail_page_reads_a_tenth_at_most(big_tables, admin_client, model):
    row = _row(BIG[{"outboxmessage": "outbox", "inboxmessage": "inbox",
                    "inboxfailure": "failures", "taskresultrecord": "tasks"}[model]])  # fmt: skip
    url = reverse(f"admin:django_outbox_{model}_change", args=[row.pk])
    response, queries = captured(admin_client, url)
    assert str(row.pk) in response.content.decode()
    assert (bad := overreads(queries)) == [], "\n".join(bad)


@pytest.mark.parametrize("action", ["requeue", "abandon", "requeue_head", "skip_head"])
@pytest.mark.parametrize("across", [False, True], ids=["selected", "select-all"])
def test_every_action_and_its_confirmation_reads_a_tenth_at_most(
    big_tables, admin_client, action, across
):
    """Each action on a few selected rows, and on all the rows of a filtered list
    (abandoned ones: the heads of blocked keys); skip head answers its confirmation."""
    heads = OutboxMessage.objects.filter(status="abandoned").order_by("-id")[:3]
    data: dict[str, Any] = {"action": action, "index": 0,
                            "_selected_action": [row.pk for row in heads]}  # fmt: skip
    if across:
        data["select_across"] = 1
    url = changelist("outboxmessage") + "?status__exact=abandoned"
    _, queries = captured(admin_client, url, data, post=True)
    assert (bad := overreads(queries)) == [], "\n".join(bad)


def test_an_action_refused_for_too_many_rows_counts_no_further(big_tables, admin_client):
    """Select all on the published rows (most of the table): refused after counting
    ``ACTION_ROW_LIMIT + 1`` of them."""
    data = {"action": "requeue", "index": 0, "select_across": 1, "_selected_action": [0]}
    url = changelist("outboxmessage") + "?status__exact=published"
    _, queries = captured(admin_client, url, data, post=True)
    assert any(f"LIMIT {ACTION_ROW_LIMIT + 1}" in query["sql"] for query in queries)
    assert (bad := overreads(queries)) == [], "\n".join(bad)


def _short(line: str) -> str:
    """A plan's node and its statement's ORDER BY and LIMIT (the rest is its columns)."""
    return f"{line[: line.find(' <- ')]} <- ... {line[line.rfind('ORDER BY') :][:200]}"


@pytest.mark.parametrize("model", MODELS)
def test_a_sort_picked_in_the_url_reads_a_tenth_at_most(big_tables, admin_client, model, caplog):
    """docs/admin.md, "Sorting is by id only": ``?o=<column>``, each column of the list
    either way, the action box's included. Django applies any column's sort picked in
    the URL (``sortable_by`` only hides the headers' links): a Seq Scan of 200,001 rows
    for ``ORDER BY event_type``. Now a column ``sortable_by`` does not name is ignored."""
    caplog.set_level(logging.INFO, logger="django_outbox")
    cl = admin_client.get(changelist(model)).context["cl"]
    columns, sortable = cl.list_display, cl.sortable_by
    bad = []
    for index in range(len(columns)):
        for order in (str(index), f"-{index}"):
            _, queries = captured(admin_client, changelist(model), {"o": order})
            bad += [f"o={order} ({columns[index]}): {_short(line)}" for line in overreads(queries)]
    assert bad == [], "\n".join(bad)
    ignored = [r.getMessage() for r in caplog.records if r.name == "django_outbox.admin.base"]
    assert len(ignored) == 2 * len([column for column in columns if column not in sortable])
    assert ignored[-1].startswith(f"admin sort o=-{len(columns) - 1} ignored: this list sorts by")


@pytest.mark.parametrize("model", MODELS)
def test_the_last_page_reads_a_tenth_at_most(big_tables, admin_client, model, caplog):
    """The last page the paginator offers, and one past it: an OFFSET read every row
    before it (page 2,000: 199,900 index entries). Pages now stop at PAGE_DEPTH_ROWS
    rows; a deeper one is refused as a page out of range is (the list with e=1)."""
    caplog.set_level(logging.INFO, logger="django_outbox")
    response, _ = captured(admin_client, changelist(model))
    last = response.context["cl"].paginator.num_pages
    response, queries = captured(admin_client, changelist(model), {"p": last})
    assert response.status_code == 200
    assert [f"p={last}: {_short(line)}" for line in overreads(queries)] == []
    assert last == PAGE_DEPTH_ROWS // response.context["cl"].list_per_page
    deeper = admin_client.get(changelist(model), {"p": ROWS // 100})
    assert deeper.status_code == 302 and deeper.url.endswith("?e=1")
    (refused,) = [r for r in caplog.records if r.name == "django_outbox.admin.base"]
    assert refused.getMessage() == (
        f"admin page {ROWS // 100} refused: pages stop at 10000 rows deep, page {last}; sort "
        "the other way, filter or search to reach older rows"
    )
