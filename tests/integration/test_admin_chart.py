"""The outbox changelist's chart of the last hour, drawn from the samples relays take."""

from __future__ import annotations

import datetime as dt

import pytest

from django_outbox.models import OutboxSample
from tests.integration.test_admin import CHANGELIST, logged_in
from tests.support import minute_with_time_left

pytestmark = pytest.mark.django_db
MINUTE = dt.timedelta(minutes=1)


def hour_of_samples(missing: set[int]) -> dt.datetime:
    """A sample for each of the last 60 minutes but the ``missing`` ones (minutes ago);
    returns this minute. Backlog: 100 + minutes ago pending, minutes ago % 7 failed;
    published: 60 x minutes ago."""
    minute = minute_with_time_left(seconds=20)
    OutboxSample.objects.bulk_create(
        OutboxSample(
            taken_at=minute - ago * MINUTE,
            pending=100 + ago,
            processing=1,
            failed=ago % 7,
            published=60 * ago,
        )
        for ago in range(60)
        if ago not in missing
    )
    return minute


def test_without_samples_a_note_says_why_there_is_no_chart(client):
    OutboxSample.objects.create(
        taken_at=dt.datetime(2020, 1, 1, tzinfo=dt.UTC),  # long ago: not the last hour
        pending=1,
        processing=0,
        failed=0,
        published=0,
    )
    response = logged_in(client, "view_outboxmessage").get(CHANGELIST)

    page = response.content.decode()
    assert 'class="outbox-chart"' not in page
    assert "no relay has sampled this database in the last hour" in page


def test_an_hour_of_samples_draws_the_backlog_and_the_rate_with_gaps(client):
    hour_of_samples(missing={20, 21, 22})
    response = logged_in(client, "view_outboxmessage").get(CHANGELIST)

    page = response.content.decode()
    assert page.count('<svg xmlns="http://www.w3.org/2000/svg" class="outbox-chart"') == 2
    assert page.count('<g class="outbox-chart-bar">') == 2 * 57
    assert 'aria-label="Backlog, the last 60 minutes: 57 sampled, highest 162"' in page
    assert (
        'aria-label="Published per minute, the last 60 minutes: 57 sampled, highest 3540"' in page
    )


def test_with_no_published_retention_a_note_stands_in_for_the_rate(client, settings):
    settings.OUTBOX = {**settings.OUTBOX, "PUBLISHED_RETENTION": 0}
    hour_of_samples(missing=set())
    response = logged_in(client, "view_outboxmessage").get(CHANGELIST)

    page = response.content.decode()
    assert page.count('class="outbox-chart"') == 1
    assert 'aria-label="Backlog, the last 60 minutes: 60 sampled' in page
    assert "Published per minute" not in page
    assert "No publish rate: PUBLISHED_RETENTION is 0" in page
