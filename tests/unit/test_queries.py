"""Named queries (django_outbox/db/queries.sql), the claimed row built by column
name, and the frozen SQL of the migrations. No database: SQL is only rendered."""

from __future__ import annotations

import ast
import datetime as dt
import importlib
import json
import pathlib
import re
import uuid

import pytest

from django_outbox.db import postgresql, queries
from django_outbox.envelope import CLAIMED_FIELDS, ClaimedMessage
from django_outbox.models import CLAIMABLE, OutboxMessage, OutboxStatus

PACKAGE = pathlib.Path(queries.__file__).parents[1]
SAMPLE = """\
-- header comment, before any query

-- name: first
-- what it does
SELECT {column} FROM {table} WHERE status IN ({states})

-- name: second
UPDATE t SET x = 1
"""


def _spaced(sql: str) -> str:
    return " ".join(sql.split())


def test_parse_keeps_each_sections_sql_without_its_comments():
    assert queries.parse(SAMPLE) == {
        "first": "SELECT {column} FROM {table} WHERE status IN ({states})",
        "second": "UPDATE t SET x = 1",
    }


def test_a_query_defined_twice_is_refused():
    with pytest.raises(ValueError, match="query 'second' is defined twice"):
        queries.parse(SAMPLE + "\n-- name: second\nSELECT 1\n")


def test_every_query_of_the_package_file_loads():
    text = (PACKAGE / "db" / "queries.sql").read_text()
    names = re.findall(r"^-- name: (\w+)", text, re.MULTILINE)
    assert set(names) == {
        "claim",
        "claim_unordered",
        "insert_deduplicated",
        "deduplicated_row",
        "claim_commit_unflushed",
        "claim_without_jit",
        "claim_unordered_rows",
        "claim_payload",
        "claim_due",
        "claim_bounded",
        "claim_lease",
        "ordered_gate",
        "backlog_part_unfinished",
        "backlog_part_due",
        "backlog_part_scheduled",
        "next_due",
        "next_due_first",
        "next_due_in",
        "backlog_part_failed",
        "backlog_part_published",
        "backlog_part_abandoned",
        "mark_published",
        "delete_published",
        "lease_held",
        "insert",
        "insert_row",
        "insert_ordered",
        "sequence_scope",
        "ordered_row",
        "backlog",
        "backlog_count",
        "backlog_oldest_due",
        "backlog_blocked",
        "oldest_snapshot",
        "listen",
        "notify_function",
        "notify_trigger",
        "partitioned",
        "partitions",
        "next_id",
        "serial_sequence",
        "convert_timeouts",
        "partition_create",
        "partition_attach",
        "partition_expiry",
        "partition_lock",
        "partition_drop",
        "convert_lock",
        "convert_names",
        "convert_indexes",
        "convert_storage",
        "convert_rename",
        "convert_rename_index",
        "convert_detach_identity",
        "convert_parent",
        "convert_attach_first",
        "convert_drop_index",
        "convert_drop_constraint",
        "partition_default",
        "dedup_locks",
        "dedup_lock",
        "maintenance_lock",
        "dedup_partitioned",
        "partition_blockers",
        "convert_acl",
        "convert_owner",
        "convert_attachments",
        "claim_window",
    }
    for name in names:
        assert queries._queries()[name]
        assert "-- " not in queries._queries()[name]


def test_an_unknown_query_name_is_an_error_naming_it():
    with pytest.raises(queries.UnknownQuery, match=r"no query named 'clam' in .*queries\.sql"):
        queries.sql("clam")


def test_a_placeholder_without_a_value_is_an_error_naming_it():
    with pytest.raises(
        queries.UnknownQuery, match=r"query 'claim_lease' needs a value for \{table\}"
    ):
        queries.sql("claim_lease")


def test_identifiers_and_literals_are_quoted_and_escaped():
    assert queries.quote_identifier('we"ird') == '"we""ird"'
    assert queries.quote_literal("it's") == "'it''s'"
    table = {"table": 'out"box'}
    due = queries.sql(
        "claim_due",
        literals={"claimable": ["a", "b'c"], "processing": "p"},
        fragments={"clock": "now()", "window": ""},
    )
    payload = queries.sql("claim_payload", fragments={"payload": "payload"})
    rows = queries.sql(
        "claim_unordered_rows", identifiers=table, fragments={"due": due, "payload": payload}
    )
    lease = queries.sql(
        "claim_lease",
        identifiers=table,
        literals={"processing": "p"},
        fragments={"next_due": "1", "lease_window": ""},
    )
    assert 'FROM "out""box"' in rows
    assert "status IN ('a', 'b''c')" in rows
    assert "SET status = 'p'" in lease


def test_the_claim_names_every_column_it_returns_after_claimed_message():
    sql = postgresql._claim_sql()
    returning = sql[sql.index("RETURNING") :]
    # ClaimedMessage's fields, then the count of the rows the claim considered
    # (ClaimedBatch.left_behind) and the seconds until the next row comes due
    # (ClaimedBatch.next_due_in).
    assert re.findall(r"AS (\w+)", returning) == [*CLAIMED_FIELDS, "considered", "next_due_in"]
    claimable = ", ".join(f"'{status.value}'" for status in CLAIMABLE)
    assert f"status IN ({claimable})" in sql
    assert f'FROM "{OutboxMessage._meta.db_table}"' in sql
    assert f"SET status = '{OutboxStatus.PROCESSING.value}'" in sql


def test_a_claimed_message_is_built_by_column_name():
    row = {
        "created_at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC),
        "attempts": 2,
        "ordering_key": "k",
        "headers": '{"h": 1}',
        "payload": '{"a": 1}',
        "destination": "d",
        "event_type": "t",
        "event_id": uuid.UUID(int=7),
        "extra": "ignored",
        "skipped": False,
        "id": 5,
        "sequence": 3,
    }
    build = ClaimedMessage.reader(list(row), headers=json.loads)
    assert build(tuple(row.values())) == ClaimedMessage(
        5, uuid.UUID(int=7), "t", "d", '{"a": 1}', {"h": 1}, "k", 2, row["created_at"], 3, False
    )


def test_a_claimed_row_without_a_field_is_refused_naming_it():
    with pytest.raises(TypeError, match="a claimed row has no column attempts, created_at"):
        ClaimedMessage.reader([f for f in CLAIMED_FIELDS if f not in {"attempts", "created_at"}])


def _migration(name: str):
    return importlib.import_module(f"django_outbox.migrations.{name}")


def test_the_initial_migration_keeps_its_own_copy_of_the_trigger_sql():
    """Editing queries.sql never changes what 0001 installs: it imports nothing of
    the package, and its frozen copy is what the package defines today (when
    this fails after an edit of queries.sql, the edit needs a new migration)."""
    path = PACKAGE / "migrations" / "0001_initial.py"
    imported = {
        node.module if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert not {name for name in imported if name and name.startswith("django_outbox")}
    initial = _migration("0001_initial")
    table = OutboxMessage._meta.db_table
    assert _spaced(initial.NOTIFY_FUNCTION_SQL) == _spaced(
        queries.sql("notify_function", literals={"channel": postgresql.NOTIFY_CHANNEL})
    )
    assert _spaced(initial.NOTIFY_TRIGGER_SQL) == _spaced(
        queries.sql("notify_trigger", identifiers={"table": table})
    )
