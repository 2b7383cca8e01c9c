"""The README's first command: the example shop end to end on SQLite and filesystem://."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import REPO


def test_demo_places_relays_and_bills_every_order_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "OUTBOX_BROKER_URL"}}
    env.update(DJANGO_SETTINGS_MODULE="example_project.settings", OUTBOX_DEMO_DIR=str(tmp_path))

    def manage(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    manage("migrate", "--verbosity", "0")
    out = manage("demo", "--orders", "120")

    assert (
        "summary: staged 120, published 120, consumed 120 (invoices for 120 distinct orders), "
        "duplicates skipped 12, in "
    ) in out
    assert "received 120: handled 120, duplicates 0, failed 0, parked 0, rejected 0" in out
    assert "received 12: handled 0, duplicates 12, failed 0, parked 0, rejected 0" in out
    assert (tmp_path / "db.sqlite3").exists()
