"""Payload size: MAX_PAYLOAD_BYTES at stage time, MAX_BATCH_BYTES on every claim, on
real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import base64
import json
import os
import uuid

import pytest
from django.conf import settings
from django.core import checks
from django.db import connection, transaction
from django.test.utils import override_settings

from django_outbox import PayloadTooLarge, db, stage, stage_many
from django_outbox.envelope import ClaimedBatch
from django_outbox.models import OutboxMessage
from django_outbox.relay import Relay
from tests.support import consume, delete_queue, unique_destination

pytestmark = pytest.mark.django_db(transaction=True)

MiB = 1024 * 1024


def blob(size: int) -> dict[str, str]:
    """A payload whose JSON text is exactly ``size`` bytes, as staged and as jsonb prints it."""
    return {"blob": "x" * (size - len('{"blob": ""}'))}


def outbox(**overrides: object):
    return override_settings(OUTBOX={**settings.OUTBOX, **overrides})


def test_the_default_bound_refuses_a_payload_over_one_mebibyte_and_takes_one_at_it():
    with transaction.atomic():
        stage("a.b", blob(MiB), destination="d")
        with pytest.raises(PayloadTooLarge) as excinfo:
            stage("a.b", blob(MiB + 1), destination="d")
        stage("a.b", {"after": "the refusal"}, destination="d")
    assert str(excinfo.value) == (
        f"the JSON of the payload of event 'a.b' is {MiB + 1} bytes, more than "
        f'OUTBOX["MAX_PAYLOAD_BYTES"] ({MiB}): stage a reference to the data (an id, a URL) '
        "instead, or raise the setting"
    )
    assert isinstance(excinfo.value, ValueError)
    assert OutboxMessage.objects.count() == 2


def test_the_bound_counts_utf8_bytes_and_applies_to_headers_too():
    with outbox(MAX_PAYLOAD_BYTES=20), transaction.atomic():
        stage("a.b", {"é": "ééééé"}, destination="d")  # 20 bytes, 14 characters
        with pytest.raises(PayloadTooLarge, match=r"payload of event 'a.b' is 22 bytes"):
            stage("a.b", {"é": "éééééé"}, destination="d")
        with pytest.raises(PayloadTooLarge, match=r"the headers of event 'a.b' is 25 bytes"):
            stage("a.b", {}, destination="d", headers={"x-trace": "0123456789"})
        with pytest.raises(PayloadTooLarge):
            stage_many([{"event_type": "a.b", "payload": blob(21), "destination": "d"}])
    assert OutboxMessage.objects.count() == 1


@pytest.mark.parametrize(
    ("name", "value"), [("MAX_PAYLOAD_BYTES", "1 MiB"), ("MAX_BATCH_BYTES", 0)]
)
def test_the_byte_settings_are_checked(name, value):
    with outbox(**{name: value}):
        found = checks.run_checks(databases=[])  # Django 6.1 asks each database otherwise
        errors = [m for m in found if m.id == "django_outbox.E003"]
    assert [e.msg for e in errors] == [
        f'OUTBOX["{name}"] must be a positive integer; got {value!r}.'
    ]


def stage_sizes(*sizes: int) -> list[int]:
    """Commit one event per size (payload JSON of that many bytes), in this order; their ids."""
    ids = []
    for size in sizes:
        with transaction.atomic():
            ids.append(stage("a.b", blob(size), destination="d").pk)
    return ids


def claim_through_the_setting(max_bytes: int) -> ClaimedBatch:
    """The relay's claim (the PostgreSQL statement), bounded by ``MAX_BATCH_BYTES``."""
    with outbox(MAX_BATCH_BYTES=max_bytes):
        return db.claim("default", limit=500, lease_seconds=60, worker="w", token=uuid.uuid4())


def claim_portable(max_bytes: int) -> ClaimedBatch:
    """The claim of databases other than PostgreSQL (it runs on PostgreSQL too)."""
    return db._claim_portable("default", 500, max_bytes, 60, "w", uuid.uuid4())


def claim_unordered(max_bytes: int) -> ClaimedBatch:
    """The claim a relay whose settings order no route sends between its whole claims."""
    token = uuid.uuid4()
    return db.claim(
        "default", limit=500, max_bytes=max_bytes, lease_seconds=60, worker="w", token=token,
        ordered=False,
    )  # fmt: skip


@pytest.mark.parametrize("claim", [claim_through_the_setting, claim_unordered, claim_portable])
def test_a_batch_is_split_by_bytes_and_the_next_claim_takes_the_rest(claim):
    ids = stage_sizes(1000, 1000, 1000, 1000, 600)

    batches, left_behind = [], []
    while batch := claim(2500):
        batches.append([m.id for m in batch])
        left_behind.append(batch.left_behind)
    assert batches == [ids[0:2], ids[2:4], ids[4:5]]
    # The relay claims again at once after a claim that left rows behind, and only then.
    assert left_behind == [True, True, False]
    assert claim(2500).left_behind is False  # nothing due: nothing left behind


@pytest.mark.parametrize("ordered", [True, False], ids=["whole", "unordered"])
def test_the_row_count_bound_still_holds_under_the_byte_bound(ordered):
    ids = stage_sizes(100, 100, 100)
    token = uuid.uuid4()
    claimed = db.claim(
        "default", limit=2, max_bytes=MiB, lease_seconds=60, worker="w", token=token,
        ordered=ordered,
    )  # fmt: skip
    assert [m.id for m in claimed] == ids[:2]


@pytest.mark.parametrize("ordered", [True, False], ids=["whole", "unordered"])
def test_large_and_compressed_payloads_are_counted_and_returned_as_their_text(ordered):
    """The claim carries a small payload's text from its pick to its result and writes a
    larger one's again for the rows it leases (stored in over 2 KiB, or compressed): both
    paths count the text's bytes against the bound and return the text as staged."""
    random = {"blob": base64.b64encode(os.urandom(3000)).decode()}  # incompressible
    payloads = [blob(1000), random, blob(5000), blob(600)]  # blob(5000) is compressed
    ids = []
    for payload in payloads:
        with transaction.atomic():
            ids.append(stage("a.b", payload, destination="d").pk)
    table = OutboxMessage._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT pg_column_size(payload) > 2048, pg_column_compression(payload) IS NOT NULL "
            f'FROM "{table}" ORDER BY id'
        )
        assert cursor.fetchall() == [(False, False), (True, False), (False, True), (False, False)]
    texts = [json.dumps(payload) for payload in payloads]
    token = uuid.uuid4()
    claimed = db.claim(
        "default", limit=500, max_bytes=sum(map(len, texts[:3])), lease_seconds=60,
        worker="w", token=token, ordered=ordered,
    )  # fmt: skip
    assert [m.id for m in claimed] == ids[:3] and claimed.left_behind
    assert [m.payload for m in claimed] == texts[:3]


def insert_legacy_row(destination: str, size: int) -> int:
    """A row as an older version (with no MAX_PAYLOAD_BYTES) could have staged it."""
    table = OutboxMessage._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f'INSERT INTO "{table}" (event_id, event_type, destination, payload, headers, '
            "ordering_key, available_at, created_at, status, attempts, locked_by, last_error) "
            "VALUES (%s, 'legacy.big', %s, %s::jsonb, '{}', '', now(), now(), 'pending', 0, "
            "'', '') RETURNING id",
            [uuid.uuid4(), destination, json.dumps(blob(size))],
        )
        return cursor.fetchone()[0]


@pytest.fixture
def destination():
    name = unique_destination("size")
    yield name
    delete_queue(name)


def test_a_legacy_row_over_max_payload_bytes_is_published_alone_in_its_batch(destination):
    def small() -> int:
        with transaction.atomic():
            return stage("a.b", {"n": 1}, destination=destination).pk

    first = [small(), small()]
    legacy = insert_legacy_row(destination, 3 * MiB)
    last = [small(), small()]

    claimed = []
    with outbox(MAX_BATCH_BYTES=2 * MiB), Relay() as relay:
        while (stats := relay.run_once()).claimed:
            assert stats.published == stats.claimed
            claimed.append(stats.claimed)
    assert claimed == [2, 1, 2]
    messages = consume(destination, 5)
    bodies = {m.headers["event_type"]: m.body for m in messages}
    assert len(messages) == 5
    assert json.loads(bodies["legacy.big"]) == blob(3 * MiB)
    assert OutboxMessage.objects.get(pk=legacy).status == OutboxMessage.Status.PUBLISHED
    assert all(
        status == OutboxMessage.Status.PUBLISHED
        for status in OutboxMessage.objects.filter(pk__in=first + last).values_list(
            "status", flat=True
        )
    )
