"""A disk-full PostgreSQL: the outbox table lives on a small tmpfs the suite mounts.

:class:`Disk` mounts a tmpfs (we run as root), makes it a tablespace and moves the
outbox table onto it, so that filling the tmpfs makes every staging fail the way a
full disk does: ``could not extend file ...: No space left on device``. The fault
``disk_full`` fills the tmpfs with a file of the runner's until a producer's staging
fails, keeps it full a few seconds, then deletes the file. Meanwhile the table's
``fillfactor`` is 10, so that a new row needs an empty page, as in a table whose
pages are all full: without it, staging goes on in the space the relays' updates
freed in existing pages (a minute and more on a busy machine), and fails only once
that is used up. Updates keep their page's room. Staging must fail cleanly
(the producer's transaction rolls back: its orders are not committed) and resume
when there is space again; an order committed meanwhile must not lose its event (the
audit's "orders committed during disk full lost"). :meth:`Disk.unmount` drops the
tablespace and unmounts, and the runner calls it however the run ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from .faults import Done, Fault, Injector

# The database helpers (chaos.database) need Django set up: imported where used, as
# the runner builds its Disk before it sets Django up.
TABLESPACE = "chaos_disk"
#: What a producer logs when staging meets the full disk.
DISK_FULL = re.compile(r"No space left on device|could not extend file")
HOLD = (2.0, 5.0)  # seconds the disk stays full after staging first failed
FIRST_FAILURE = 60.0  # seconds to wait for it
BLOCK = 1 << 20


class Disk:
    """The tmpfs tablespace of the outbox table, on the services' PostgreSQL."""

    def __init__(self, database_url: str, size_mb: int) -> None:
        self.database_url = database_url
        port = urlsplit(database_url).port
        self.mount = Path(tempfile.gettempdir()) / f"outbox-chaos-disk-{port}"
        self.size_mb = size_mb
        self.filler = self.mount / "filler"
        self.producer_logs: Sequence[Path] = ()  # where a producer's staging errors go

    def create(self) -> None:
        """Mount the tmpfs (an earlier run's leftovers first removed) and make it the
        tablespace ``chaos_disk``."""
        self.unmount()
        self.mount.mkdir(exist_ok=True)
        owner = shutil.chown  # the tablespace directory must belong to the server's user
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m,mode=0755", "tmpfs", self.mount],
            check=True,
            capture_output=True,
        )
        (self.mount / "pg").mkdir(mode=0o700)
        owner(self.mount / "pg", "postgres", "postgres")
        self._server(f"CREATE TABLESPACE {TABLESPACE} LOCATION '{self.mount / 'pg'}'")

    def move(self, table: str) -> None:
        """Put ``table`` (its heap; its indexes stay) on the tablespace."""
        from . import database as db

        db.rows(f'ALTER TABLE "{table}" SET TABLESPACE {TABLESPACE}')

    def fill(self) -> int:
        """Write a file until the tmpfs is full; returns the bytes written."""
        written = 0
        block = b"\0" * BLOCK
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            while len(block) >= 4096:
                try:
                    written += os.write(fd, block)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    block = block[: len(block) // 16]  # the last few pages too
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        """Free the space, drop the tablespace (the database using it is dropped
        first) and unmount; each step only if there is something to undo."""
        with contextlib.suppress(FileNotFoundError):
            self.free()
        try:
            self._server(f"DROP TABLESPACE IF EXISTS {TABLESPACE}")
        finally:
            if os.path.ismount(self.mount):
                subprocess.run(["umount", "--lazy", self.mount], check=True, capture_output=True)

    def failures(self) -> int:
        """Disk-full errors the producers have logged."""
        return sum(
            len(DISK_FULL.findall(log.read_text(errors="replace")))
            for log in self.producer_logs
            if log.exists()
        )

    def _server(self, statement: str) -> None:
        import psycopg

        server = urlunsplit(urlsplit(self.database_url)._replace(path="/postgres"))
        with psycopg.connect(server, autocommit=True) as connection:
            connection.execute(statement)  # type: ignore[arg-type]


def disk_full(injector: Injector) -> Done:
    """Fill the outbox table's tmpfs until staging fails, hold it a few seconds, free it."""
    from . import database as db
    from .faults import Done

    disk = injector.disk
    failed_before = disk.failures()
    first_order = db.last_order()
    began = time.monotonic()
    written = disk.fill()
    try:
        db.rows(f'ALTER TABLE "{db.OUTBOX}" SET (fillfactor = 10)')
        while disk.failures() == failed_before:
            if time.monotonic() - began > FIRST_FAILURE:
                raise RuntimeError(
                    f"disk_full: the tmpfs has been full for {FIRST_FAILURE:.0f}s and no "
                    "producer's staging has failed"
                )
            time.sleep(0.1)
        first_failure = time.monotonic() - began
        time.sleep(injector.rng.uniform(*HOLD))
    finally:
        disk.free()
        db.rows(f'ALTER TABLE "{db.OUTBOX}" RESET (fillfactor)')
    ended = time.monotonic()
    orders = (first_order, db.last_order())
    failed = disk.failures() - failed_before

    def facts() -> str:
        return (
            f"tmpfs filled ({written / BLOCK:.0f} MiB written), staging first failed after "
            f"{first_failure:.1f}s; {failed} staging transactions failed with 'No space left "
            f"on device' and were not committed; space freed after {ended - began:.1f}s; "
            f"orders {orders[0] + 1}..{orders[1]} committed meanwhile"
        )

    return Done("postgres", ended, facts, orders=orders)


def lost_during(faults: Sequence[Fault]) -> int:
    """Orders committed while a disk was full whose event was never handled."""
    from . import database as db

    return sum(
        db.unhandled(fault.done.orders[1], fault.done.orders[0])
        for fault in faults
        if fault.kind == "disk_full" and fault.done.orders
    )
