"""The chart of the last hour in a real headless Chromium (see test_admin_browser.py):
an hour of samples with a gap, two SVG charts with their bars and labels, a screenshot
in ``tests/artifacts/admin_chart.png``."""

from __future__ import annotations

from pathlib import Path

from django.utils import timezone
from playwright.sync_api import Page, expect

from tests.integration.test_admin_browser import browse, log_in, operator
from tests.integration.test_admin_browser import pytestmark as browser_marks
from tests.integration.test_admin_chart import MINUTE, hour_of_samples

pytestmark = browser_marks


def test_the_changelist_draws_an_hour_of_samples(live_server, capsys):
    minute = hour_of_samples(missing={20, 21, 22})
    operator()
    clock = {  # the x axis labels, in the admin's time zone
        "backlog": [
            timezone.localtime(minute - ago * MINUTE).strftime("%H:%M") for ago in (59, 29, 0)
        ],
        "rate": [
            timezone.localtime(minute - ago * MINUTE).strftime("%H:%M") for ago in (60, 30, 1)
        ],
    }

    def look_at_the_chart(page: Page, base_url: str, screenshot: Path) -> None:
        log_in(page, base_url, "outboxmessage")
        charts = page.locator("#outbox-charts svg.outbox-chart")
        expect(charts).to_have_count(2)
        backlog = page.get_by_role("img", name="Backlog, the last 60 minutes")
        rate = page.get_by_role("img", name="Published per minute, the last 60 minutes")
        for chart, top, times in (
            (backlog, "200", clock["backlog"]),
            (rate, "5,000", clock["rate"]),
        ):
            expect(chart).to_be_visible()
            expect(chart.locator("g.outbox-chart-bar")).to_have_count(57)  # 60 minutes, 3 gaps
            expect(chart.locator("text.outbox-chart-ymax")).to_have_text(top)
            expect(chart.locator("text.outbox-chart-time")).to_have_text(times)
        expect(backlog.locator("text.outbox-chart-legend")).to_have_text(["failed", "pending"])
        # The newest minute's bar: 100 pending, none failed.
        expect(backlog.locator("g.outbox-chart-bar title").last).to_have_text(
            f"{clock['backlog'][-1]}: pending 100, failed 0"
        )
        page.locator("#outbox-summary").screenshot(
            path=str(screenshot.with_name("admin_chart_box.png"))
        )
        page.screenshot(path=str(screenshot), full_page=True)

    browse(look_at_the_chart, live_server.url, "admin_chart.png", capsys)
