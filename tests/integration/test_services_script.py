"""scripts/services on a machine whose directories it must not change.

A checkout can live under a directory the postgres user cannot enter (a 0700 home, a
``mktemp -d``). scripts/services once added ``o+x`` to every such ancestor, for good; now
PostgreSQL's files go to a directory of their own under /tmp. These tests start a real
PostgreSQL of their own from the script, on a port no other test uses.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import psycopg
import pytest

from tests.support import REPO, free_port

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None,
    reason="scripts/services starts PostgreSQL as the postgres user: it runs as root",
)


def services(state: Path, port: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUTBOX_SERVICES_DIR": str(state), "OUTBOX_PG_PORT": str(port)}
    return subprocess.run(
        [str(REPO / "scripts/services"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_checkout_the_postgres_user_cannot_enter_changes_no_directory(tmp_path):
    locked = tmp_path / "home"
    locked.mkdir(mode=0o700)
    locked.chmod(0o700)  # whatever the umask
    state, port = locked / "checkout" / ".services", free_port()
    modes = {path: path.stat().st_mode for path in (tmp_path, locked)}
    started = services(state, port, "start", "postgres")
    try:
        assert started.returncode == 0, started.stderr
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/outbox") as connection:
            data = connection.execute("SHOW data_directory").fetchone()[0]
        assert {path: path.stat().st_mode for path in modes} == modes
        assert stat.S_IMODE(locked.stat().st_mode) == 0o700
        assert not data.startswith(str(locked)), data
        assert (state / "postgres.dir").read_text().strip() == str(Path(data).parent)
        assert "user postgres cannot enter" in started.stderr
        # The other commands find the files again: a restart keeps the database.
        restarted = services(state, port, "restart", "postgres")
        assert restarted.returncode == 0, restarted.stderr
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/outbox") as connection:
            assert connection.execute("SHOW data_directory").fetchone()[0] == data
    finally:
        services(state, port, "stop", "postgres")
        if (state / "postgres.dir").exists():
            shutil.rmtree((state / "postgres.dir").read_text().strip(), ignore_errors=True)


def test_a_checkout_the_postgres_user_can_enter_keeps_its_files_inside():
    # Not under pytest's tmp_path: its root, /tmp/pytest-of-root, is 0700.
    checkout = Path(tempfile.mkdtemp(prefix="outbox-open-", dir="/tmp"))
    checkout.chmod(0o755)
    state, port = checkout / ".services", free_port()
    started = services(state, port, "start", "postgres")
    try:
        assert started.returncode == 0, started.stderr
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:{port}/outbox") as connection:
            data = connection.execute("SHOW data_directory").fetchone()[0]
        assert data == str(state / "postgres" / "data")
        assert not (state / "postgres.dir").exists()
    finally:
        services(state, port, "stop", "postgres")
        shutil.rmtree(checkout, ignore_errors=True)
