"""How the outbox commands and reports write texts of any length and durations on one line."""

from __future__ import annotations

import datetime as dt
import math

#: The longest error text a command prints on one line (``last_error`` keeps 2000).
MAX_LINE = 200


def one_line(text: str, limit: int = MAX_LINE) -> str:
    """``text`` on one line (line breaks become spaces), cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def duration(delta: dt.timedelta) -> str:
    """``3s``, ``4.5 min`` or ``2.0 h``: seconds rounded up, so "due in 0s" means now."""
    seconds = delta.total_seconds()
    if seconds < 90:
        return f"{math.ceil(seconds)}s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
