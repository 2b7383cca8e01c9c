"""docs/testing.md followed as written, the way test_quickstart.py follows the quickstart
(issue 42): a new project from ``django-admin startproject``, the page's files, and its tests
run by ``manage.py test`` and by pytest, with no broker URL and no server. ``pip install``
lines are skipped (the package and pytest-django are installed here already)."""

from __future__ import annotations

from tests.integration.test_quickstart import BLOCK, NewUser
from tests.support import REPO

PAGE = REPO / "docs" / "testing.md"


def page_blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced block from "With Django's TestCase" up to "The memory
    transport", in order."""
    text = PAGE.read_text()
    section = text.split("## With Django's `TestCase`", 1)[1].split("## The memory transport")[0]
    return BLOCK.findall(section)


def test_a_new_user_runs_the_testing_pages_tests_with_manage_py_test_and_pytest(tmp_path):
    user = NewUser(tmp_path)
    user.follow(page_blocks())

    assert user.written == [
        "mysite/settings.py",
        "shop/models.py",
        "shop/tests.py",
        "pytest.ini",
        "shop/test_orders.py",
    ]
    (django_run,) = [out for c, out in user.printed if c == "python manage.py test shop"]
    # No broker URL (E006 is a deployment check) and no W001 for the in-memory test database.
    assert "System check identified no issues (0 silenced)." in django_run, django_run
    assert "django_outbox" not in django_run, django_run
    (pytest_run,) = [out for c, out in user.printed if c == "python -m pytest"]
    assert " 5 passed" in pytest_run, pytest_run
