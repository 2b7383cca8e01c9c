"""The relay's claim and ``outbox_requeue`` on SQLite (the example project's database)
while another connection writes: the retention thread deleting, a request staging
events, the relay."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.integration.test_example_project import example_env, manage_in
from tests.support import REPO

# Another connection holds SQLite's write lock when the claim begins and commits a
# second later. A transaction that reads first is refused its write at once ("database is
# locked": its snapshot is stale); one that takes the write lock first waits for it.
SCRIPT = """
import sqlite3, threading, time, uuid
import django
django.setup()
from django.db import connection, transaction
from django.db.models.functions import Now
from django_outbox import stage_many
from django_outbox.state import store
from django_outbox.models import OutboxMessage

with transaction.atomic():
    stage_many([{"event_type": "t", "payload": {}, "destination": "q"} for _ in range(20)])
# for the requeue
OutboxMessage.objects.filter(id__gt=10).update(status="abandoned", abandoned_at=Now())
path = connection.settings_dict["NAME"]
holding = threading.Event()

def other_writer():
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("CREATE TABLE IF NOT EXISTS scratch (x)")
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO scratch VALUES (1)")
    holding.set()
    time.sleep(1)  # the operation below begins meanwhile; it may wait, but must not fail
    other.execute("COMMIT")

writer = threading.Thread(target=other_writer)
writer.start()
holding.wait()
print(OPERATION)
writer.join()
"""
CLAIM = 'len(store.claim("default", limit=10, lease_seconds=30, worker="w", token=uuid.uuid4()))'
REQUEUE = 'store.requeue_selected("default", ids=list(range(11, 21)))'
# The admin's requeue action on the selected rows, by a user the log names.
ADMIN = (
    "__import__('django_outbox.admin').admin.OutboxMessageAdmin(OutboxMessage, None)"
    "._change_fate(type('R', (), {'user': type('U', (), {'pk': 1})})(), "
    "OutboxMessage.objects.filter(id__gt=10), store.requeue, 'requeued')[0]"
)


@pytest.mark.slow  # two processes wait on SQLite's lock for seconds each
@pytest.mark.parametrize("operation", [CLAIM, REQUEUE, ADMIN], ids=["claim", "requeue", "admin"])
def test_a_claim_or_requeue_on_sqlite_waits_for_another_writer_instead_of_failing(
    tmp_path, operation
):
    assert run_script(tmp_path, SCRIPT.replace("OPERATION", operation)) == ["10"]


def run_script(tmp_path, script: str) -> list[str]:
    """The words ``script`` prints, run against the example project's new SQLite database."""
    env = example_env(tmp_path)
    manage_in(env, "migrate", "--verbosity", "0")
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()
