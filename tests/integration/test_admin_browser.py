"""The admin in a real headless Chromium: an operator requeues every failed message.

Debian's ``chromium`` package is the browser (Playwright drives it; nothing is
downloaded); ``scripts/test`` installs it. The screenshot lands in
``tests/artifacts/`` (ignored by git) and its path is printed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.utils import timezone
from playwright.sync_api import Page, expect, sync_playwright

from django_outbox.models import OutboxMessage
from tests.factories import OutboxMessageFactory

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
PASSWORD = "browser-test-password"

Status = OutboxMessage.Status

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"{CHROMIUM} is absent: apt-get install chromium chromium-driver "
        "(scripts/test installs them)",
    ),
]


def operator() -> User:
    user = User.objects.create_user("operator", password=PASSWORD, is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_outbox",
            codename__in=["view_outboxmessage", "requeue_outboxmessage"],
        )
    )
    return user


def log_in(page: Page, base_url: str, model: str) -> None:
    """Log in as :func:`operator`, landing on the changelist of ``model``."""
    page.goto(f"{base_url}/admin/login/?next=/admin/django_outbox/{model}/")
    page.get_by_label("Username").fill("operator")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()


def browse(steps: Callable[[Page, str, Path], None], base_url: str, name: str, capsys) -> None:
    """Run ``steps(page, base_url, screenshot)`` in Chromium; the screenshot it takes
    (``tests/artifacts/NAME``) must not be empty. No ORM call while Playwright runs: its
    event loop makes Django refuse sync queries."""
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / name
    screenshot.unlink(missing_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 900})
            page.set_default_timeout(30_000)
            steps(page, base_url, screenshot)
        finally:
            browser.close()
    with capsys.disabled():
        print(f"\nadmin screenshot: {screenshot}")
    assert screenshot.stat().st_size > 10_000


def requeue_all_failed(page: Page, base_url: str, screenshot: Path) -> None:
    """Log in, filter FAILED, select all, run requeue, then look at PENDING."""
    log_in(page, base_url, "outboxmessage")
    expect(page.get_by_role("heading", name="Select outbox message to view")).to_be_visible()

    page.locator("#changelist-filter").get_by_role("link", name="Failed", exact=True).click()
    expect(page).to_have_url(f"{base_url}/admin/django_outbox/outboxmessage/?status__exact=failed")
    expect(page.locator("#result_list tbody tr")).to_have_count(3)
    page.locator("#action-toggle").check()
    page.locator("select[name=action]").select_option("requeue")
    # The submit button is "Go" before Django 6.1 and "Run" from it.
    page.locator(".actions button[type=submit]").first.click()

    expect(page.locator("ul.messagelist")).to_contain_text(
        "3 messages requeued: pending again, attempts reset."
    )
    expect(page.locator("#result_list")).to_have_count(0)  # no FAILED row is left
    expect(page.locator("#outbox-summary .outbox-summary-failed")).to_contain_text("Failed: 0")

    page.locator("#changelist-filter").get_by_role("link", name="Pending", exact=True).click()
    expect(page.locator("#result_list .outbox-status")).to_have_text(["Pending"] * 4)
    page.screenshot(path=str(screenshot), full_page=True)


def test_operator_requeues_every_failed_message_from_the_browser(live_server, capsys):
    failed = OutboxMessageFactory.create_batch(3, status=Status.FAILED, attempts=4)
    OutboxMessageFactory(status=Status.PENDING)
    abandoned = OutboxMessageFactory(status=Status.ABANDONED)
    operator()
    browse(requeue_all_failed, live_server.url, "admin_requeue.png", capsys)
    status = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert [status[row.pk] for row in failed] == [Status.PENDING] * 3
    assert status[abandoned.pk] == Status.ABANDONED
    assert set(
        OutboxMessage.objects.filter(pk__in=[r.pk for r in failed]).values_list(
            "attempts", flat=True
        )
    ) == {0}


def skip_the_blocked_head(page: Page, base_url: str, screenshot: Path) -> None:
    """Log in, find the blocked key above the rows, press its "Skip head" button, and
    confirm."""
    log_in(page, base_url, "outboxmessage")
    blocked = page.locator("#outbox-blocked")
    expect(blocked).to_contain_text("1 blocked key")
    key = blocked.locator("tr.outbox-blocked-key")
    expect(key).to_have_count(1)
    expect(key).to_contain_text("order-1")
    expect(key).to_contain_text("poison: the payload cannot be encoded")
    page.screenshot(path=str(screenshot.with_name("admin_blocked_key.png")), full_page=True)
    key.get_by_role("button", name="Skip head").click()
    expect(page.locator("#content")).to_contain_text("Skipping cannot be undone.")
    expect(page.locator("#skip-head-rows tbody tr")).to_have_count(1)
    page.get_by_role("button", name="Yes, skip them").click()

    expect(page.locator("ul.messagelist")).to_contain_text(
        "1 head skipped: a skip marker is published in its place; its key moves on."
    )
    expect(page.locator("#outbox-blocked")).to_have_count(0)
    page.screenshot(path=str(screenshot), full_page=True)


def test_operator_skips_a_blocked_head_from_the_browser(live_server, capsys):
    published = OutboxMessageFactory(ordering_key="order-1", sequence=1, published=True)
    head = OutboxMessageFactory(
        ordering_key="order-1",
        sequence=2,
        status=Status.ABANDONED,
        abandoned_at=timezone.now(),
        last_error="poison: the payload cannot be encoded",
    )
    behind = OutboxMessageFactory(ordering_key="order-1", sequence=3)
    operator()
    browse(skip_the_blocked_head, live_server.url, "admin_skip_head.png", capsys)
    status = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert [status[published.pk], status[head.pk], status[behind.pk]] == [
        Status.PUBLISHED,
        Status.PENDING,
        Status.PENDING,
    ]
    assert OutboxMessage.objects.get(pk=head.pk).skipped_at is not None
