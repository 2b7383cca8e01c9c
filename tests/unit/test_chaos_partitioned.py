"""The chaos suite's partitioned profile (chaos/partitioned.py): which producer failures
count as staging failures, and how a chaos trigger is moved to the partitioned table."""

from __future__ import annotations

from pathlib import Path

from chaos import partitioned

OUTAGES = [
    "terminating connection due to administrator command",
    'connection failed: connection to server at "127.0.0.1", port 23432 failed: '
    "FATAL:  the database system is starting up",
    'connection failed: connection to server at "127.0.0.1", port 23432 failed: '
    "FATAL:  the database system is shutting down",
    'connection failed: connection to server at "127.0.0.1", port 23432 failed: Connection refused',
    "consuming input failed: server closed the connection unexpectedly",
]
STAGING = [
    'no partition of relation "django_outbox_outboxmessage" found for row',
    "deadlock detected",
    'relation "django_outbox_outboxmessage_p801" does not exist',
]


def test_a_producer_failure_counts_unless_an_outage_explains_it(tmp_path: Path) -> None:
    log = tmp_path / "producer-1.log"
    lines = [f"database error, waiting: {text}" for text in [*OUTAGES, *STAGING]]
    log.write_text("\n".join(["---- pid 42", *lines, "committed 10 orders"]) + "\n")

    assert partitioned.staging_failures([log, tmp_path / "producer-2.log"]) == len(STAGING)
