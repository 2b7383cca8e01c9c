"""The unit layer runs with no services at all: no database, no broker.

pytest-django already refuses database access to a test without the ``django_db`` mark; this
refuses the mark itself (and the fixtures that open a database) at collection, so a test that
needs PostgreSQL cannot be put here by mistake and skipped or passed silently: it fails, naming
the layer it belongs to.
"""

from __future__ import annotations

import pytest

DATABASE_FIXTURES = {
    "db",
    "transactional_db",
    "live_server",
    "django_db_reset_sequences",
    "django_db_serialized_rollback",
    "admin_client",
    "admin_user",
    "django_user_model",
}


def database_use(item: pytest.Item) -> str | None:
    """What makes ``item`` a database test (a mark or a fixture), or None."""
    if item.get_closest_marker("django_db"):
        return "the django_db mark"
    used = sorted(DATABASE_FIXTURES & set(getattr(item, "fixturenames", ())))
    return f"the fixture {used[0]!r}" if used else None


def pytest_runtest_setup(item: pytest.Item) -> None:
    reason = database_use(item)
    if reason is not None:
        pytest.fail(
            f"{item.nodeid} uses {reason}: unit tests touch no database; "
            "move it to tests/integration/",
            pytrace=False,
        )
