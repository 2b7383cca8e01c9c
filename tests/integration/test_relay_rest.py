"""A listening relay rests after a batch that caught up with what was due, and claims
again at once after one that left due rows behind (real PostgreSQL and RabbitMQ).

The relays run on a thread of the test process (``running_relay``), so that their
claims can be counted: ``store.claim`` is wrapped, not replaced, and every claim is
the real statement. ``POLL_INTERVAL`` is 30 s, so a row that waited for the poll
instead of being claimed at once would miss every deadline below by far.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.db import transaction

from django_outbox import stage, stage_many
from django_outbox.envelope import ClaimedBatch
from django_outbox.state import store
from tests.integration.test_payload_size import blob
from tests.integration.test_slow_paths import running_relay
from tests.support import (
    consume,
    delete_queue,
    stage_events,
    status_counts,
    unique_destination,
    wait_until,
)

pytestmark = pytest.mark.django_db(transaction=True)

POLL_INTERVAL = 30


@pytest.fixture
def destination() -> Iterator[str]:
    yield (name := unique_destination())
    delete_queue(name)


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every claim the relay makes, empty ones included."""
    sizes: list[int] = []
    claim = store.claim

    def counted(*args: object, **kwargs: object) -> ClaimedBatch:
        batch = claim(*args, **kwargs)  # type: ignore[arg-type]
        sizes.append(len(batch))
        return batch

    monkeypatch.setattr(store, "claim", counted)
    return sizes


def test_a_relay_at_a_trickle_claims_once_per_event(destination, claims):
    """Events committed one at a time, each published before the next: every NOTIFY
    is answered by one claim, which takes the event, and the relay rests. (Before,
    each event cost three claims: its own and two that came back empty.)"""
    events = 10
    with running_relay(POLL_INTERVAL=POLL_INTERVAL):
        wait_until(lambda: claims, timeout=30, what="the relay's first claim")
        for n in range(events):
            with transaction.atomic():
                stage("t.trickle", {"n": n}, destination=destination)
            wait_until(
                lambda n=n: status_counts()["published"] == n + 1,
                timeout=20,
                what=f"event {n} published",
            )
        # Reading the queue until it stays quiet for a second also gives a claim that
        # would follow the last batch its moment.
        assert len(consume(destination, events, timeout=20)) == events
    assert sorted(claims, reverse=True)[:events] == [1] * events
    # The relay's first claim, maybe a whole claim of the poll's; nothing per event.
    assert len(claims) <= events + 2, claims


def test_rows_a_claim_left_behind_by_its_byte_bound_are_claimed_at_once(destination, claims):
    """One transaction (one NOTIFY) of five 1,000-byte events and MAX_BATCH_BYTES 2,500:
    the claims take two, two and one, back to back, without waiting for the poll."""
    with running_relay(POLL_INTERVAL=POLL_INTERVAL, MAX_BATCH_BYTES=2500):
        wait_until(lambda: claims, timeout=30, what="the relay's first claim")
        with transaction.atomic():
            stage_many(
                {"event_type": "t.big", "payload": blob(1000), "destination": destination}
                for _ in range(5)
            )
        wait_until(
            lambda: status_counts()["published"] == 5,
            timeout=POLL_INTERVAL / 3,
            what="the five events published before the poll",
        )
    assert [size for size in claims if size] == [2, 2, 1]


def test_rows_freed_by_the_finalize_of_the_batch_before_are_claimed_at_once(destination, claims):
    """One transaction: 30 events of one key of an ordered route, then 25 unordered. The
    first claim (20 rows, full) takes the key's head and 19 unordered events; the claim
    made ahead beside its publish finds the key busy and takes the last 6 unordered
    events, not full and all published. That batch caught up with nothing: its claim ran
    before the first batch's finalize freed the key's next rows, which no NOTIFY will
    announce. The relay claims again instead of resting for the poll."""
    ordered = unique_destination("ordered")
    routes = {"ROUTES": {ordered: {"ordered": True, "queue": ordered}}}
    try:
        with running_relay(POLL_INTERVAL=POLL_INTERVAL, **routes):
            wait_until(lambda: claims, timeout=30, what="the relay's first claim")
            with transaction.atomic():
                stage_events(30, ordered, keys=1)
                stage_events(25, destination)
            wait_until(
                lambda: status_counts()["published"] == 55,
                timeout=POLL_INTERVAL / 3,
                what="the 55 events published before the poll",
            )
    finally:
        delete_queue(ordered)
    assert next(size for size in claims if size) == 20, claims
