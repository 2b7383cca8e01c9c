"""The chaos processes' log format, and reading it back for the report."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

ROLE = os.environ.get("CHAOS_ROLE", "chaos")
_ACTION = re.compile(r" \[([a-z_.]+)\] ")
_LOST = re.compile(r"lease lost on (\d+) row")


class ActionFilter(logging.Filter):
    """Give every record the ``role`` and ``action`` the format names (``-`` when
    the record has no action)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = ROLE
        if not hasattr(record, "action"):
            record.action = "-"
        return True


def lines(path: Path, action: str) -> list[str]:
    """The lines of the log at ``path`` that carry ``action``."""
    if not path.exists():
        return []
    return [
        line
        for line in path.read_text(errors="replace").splitlines()
        if (match := _ACTION.search(line)) and match.group(1) == action
    ]


def lease_lost_rows(path: Path) -> int:
    """Rows a relay reported it left alone because its lease was taken over."""
    found = (_LOST.search(line) for line in lines(path, "outbox.lease_lost"))
    return sum(int(match.group(1)) for match in found if match)
