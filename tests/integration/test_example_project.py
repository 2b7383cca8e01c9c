"""The README's first command and the quickstart: the example shop end to end on SQLite
and filesystem://, no server needed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.support import REPO


def example_env(tmp_path) -> dict[str, str]:
    """The example project's own defaults (SQLite, filesystem://) under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "OUTBOX_BROKER_URL"}}
    env.update(DJANGO_SETTINGS_MODULE="example_project.settings", OUTBOX_DEMO_DIR=str(tmp_path))
    return env


def manage_in(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


@pytest.mark.slow  # the README's first command runs it on Django 5.2
def test_demo_places_relays_and_bills_every_order_once(tmp_path):
    env = example_env(tmp_path)
    manage_in(env, "migrate", "--verbosity", "0")
    out = manage_in(env, "demo", "--orders", "120")

    assert (
        "summary: staged 120, published 120, consumed 120 (invoices for 120 distinct orders), "
        "duplicates skipped 12, in "
    ) in out
    assert (
        "received 120: handled 120, duplicates 0, ignored 0, failed 0, parked 0, rejected 0" in out
    )
    assert "received 12: handled 0, duplicates 12, ignored 0, failed 0, parked 0, rejected 0" in out
    assert (tmp_path / "db.sqlite3").exists()
    # kombu's filesystem transport keeps its exchange bindings in the demo's folder,
    # not in a control/ folder of the working directory (the repository).
    assert (tmp_path / "broker" / "control" / "outbox.exchange").exists()
    assert not (REPO / "control").exists()


INVOICED = (
    "from example_project.billing.models import Invoice; "
    "print(*Invoice.objects.order_by('customer').values_list('customer', flat=True))"
)


def test_the_quickstart_runs_as_written(tmp_path):
    """Every `python manage.py` line of the quickstart's example-shop block, in order."""
    text = (REPO / "docs" / "quickstart.md").read_text()
    section = text.split("## Try it: the example shop", 1)[1]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL).group(1)
    commands = [
        shlex.split(line, comments=True)
        for line in block.replace("\\\n", "").splitlines()
        if line.startswith("python manage.py ")
    ]
    assert [c[2] for c in commands] == [
        "migrate",
        "shell",
        "outbox_status",
        "run_outbox_relay",
        "outbox_status",
        "run_outbox_consumer",
    ]
    env = example_env(tmp_path)
    outputs = [manage_in(env, *command[2:]) for command in commands]

    assert re.search(r"^pending +3$", outputs[2], re.MULTILINE)
    assert outputs[3].startswith("claimed 3, published 3, failed 0, abandoned 0, lease lost 0")
    assert re.search(r"^published +3$", outputs[4], re.MULTILINE)
    assert outputs[5].startswith(
        "received 3: handled 3, duplicates 0, ignored 0, failed 0, parked 0, rejected 0 in "
    )
    invoiced = manage_in(env, "shell", "-c", INVOICED)
    assert invoiced.splitlines()[-1].split() == ["ada", "alan", "grace"]
