"""The admin's relays and consumers in a real headless Chromium (see
test_admin_browser.py): a live relay, a dead one and a stopped consumer, each with its
state badge; a screenshot in ``tests/artifacts/admin_relays.png``."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from django.contrib.auth.models import Permission
from playwright.sync_api import Page, expect

from django_outbox.models import WorkerHeartbeat, WorkerKind
from django_outbox.workers.heartbeat import Heartbeat
from tests.integration.test_admin_browser import browse, log_in, operator
from tests.integration.test_admin_browser import pytestmark as browser_marks

pytestmark = browser_marks


def test_the_relays_page_shows_each_process_with_its_state(live_server, capsys):
    Heartbeat(WorkerKind.RELAY, "web-1:4242").beat({"claimed": 1200, "published": 1198})
    Heartbeat(WorkerKind.RELAY, "web-2:99").beat({"published": 52})
    an_hour_ago = WorkerHeartbeat.objects.get(worker="web-2:99").beat_at - dt.timedelta(hours=1)
    WorkerHeartbeat.objects.filter(worker="web-2:99").update(beat_at=an_hour_ago)  # dead
    Heartbeat(WorkerKind.CONSUMER, "worker-3:77", name="billing@orders").stopped({"handled": 5})
    operator().user_permissions.add(
        Permission.objects.get(
            content_type__app_label="django_outbox", codename="view_workerheartbeat"
        )
    )

    def look_at_the_relays(page: Page, base_url: str, screenshot: Path) -> None:
        log_in(page, base_url, "workerheartbeat")
        expect(page.get_by_role("heading", name="Select relay or consumer to view")).to_be_visible()
        rows = page.locator("#result_list tbody tr")
        expect(rows).to_have_count(3)
        # Latest beat first: the stopped consumer, the live relay, the dead relay.
        expect(rows.locator("th")).to_have_text(["worker-3:77", "web-1:4242", "web-2:99"])
        expect(rows.locator(".outbox-worker-state")).to_have_text(["stopped", "live", "dead"])
        expect(rows.first).to_contain_text("billing@orders")
        page.screenshot(path=str(screenshot), full_page=True)
        rows.locator("th a").nth(1).click()
        expect(page.locator(".field-counts_json")).to_contain_text('"published": 1198')

    browse(look_at_the_relays, live_server.url, "admin_relays.png", capsys)
