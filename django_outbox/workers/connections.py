"""The database connection a relay's or a consumer's run leaves behind."""

from __future__ import annotations

from django.db import connections


def close_thread_connection(using: str) -> None:
    """Close this thread's connection to ``using``, unless an atomic block holds it (a
    caller's transaction, as a test's): Django keeps one connection per thread, and a
    run in a thread of its own that left it open would leave it for the garbage
    collector to find later, wherever the process is then."""
    connection = connections[using]
    if not connection.in_atomic_block:
        connection.close()
