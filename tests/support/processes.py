"""Real processes of the tests: ``manage.py`` commands and Python snippets in
subprocesses with the test settings and databases, started, stopped with signals and
waited on."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.db import connections

#: The repository's root.
REPO = Path(__file__).resolve().parents[2]


def database_url(alias: str = "default") -> str:
    """The URL of the database the tests really use (pytest-django's test_ database)."""
    params = connections[alias].settings_dict
    return f"postgres://{params['USER']}@{params['HOST']}:{params['PORT']}/{params['NAME']}"


def relay_env(**outbox: Any) -> dict[str, str]:
    """The environment of a manage.py subprocess: the test databases, OUTBOX overrides."""
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=database_url("default"),
        OTHER_DATABASE_URL=database_url("other"),
        OUTBOX_OVERRIDES=json.dumps(outbox),
        PYTHONUNBUFFERED="1",
    )
    return env


def manage_command(name: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO / "manage.py"), name, *args]


def relay_command(*args: str) -> list[str]:
    return manage_command("run_outbox_relay", *args)


def never_migrated_env(folder: Path) -> dict[str, str]:
    """The environment of a command whose database is a new SQLite file in ``folder``,
    never migrated (the test settings otherwise)."""
    (folder / "fresh_settings.py").write_text(
        "from tests.settings import *  # noqa: F403\n\n"
        f"DATABASES = {{'default': {{'ENGINE': 'django.db.backends.sqlite3', "
        f"'NAME': {str(folder / 'db.sqlite3')!r}}}}}\n"
        # W006: the tasks backend of the test settings on SQLite (Django 6).
        "SILENCED_SYSTEM_CHECKS = ['django_outbox.W001', 'django_outbox.W006']\n"
    )
    env = relay_env()
    env.update(
        DJANGO_SETTINGS_MODULE="fresh_settings",
        PYTHONPATH=os.pathsep.join([str(folder), str(REPO)]),
    )
    return env


def run_python(
    code: str, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (with ``args``) in a fresh interpreter with the test settings, the
    test databases and ``env`` on top."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**relay_env(), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_command(name: str, *args: str, **outbox: Any) -> subprocess.Popen[str]:
    """Start ``manage.py name args...`` in the background, output captured."""
    return subprocess.Popen(
        manage_command(name, *args),
        cwd=REPO,
        env=relay_env(**outbox),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def start_relay(*args: str, **outbox: Any) -> subprocess.Popen[str]:
    return start_command("run_outbox_relay", *args, **outbox)


def run_relay(*args: str, timeout: float = 300, **outbox: Any) -> subprocess.CompletedProcess[str]:
    result = manage("run_outbox_relay", *args, timeout=timeout, **outbox)
    assert result.returncode == 0, result.stderr
    return result


def manage(*args: str, timeout: float = 120, **outbox: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        manage_command(*args),
        cwd=REPO,
        env=relay_env(**outbox),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def stop(
    process: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout: float = 60
) -> tuple[int, str, str]:
    process.send_signal(sig)
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


@dataclasses.dataclass
class Ended:
    """How a process :func:`running` stopped ended: its exit status and output."""

    code: int | None = None
    out: str = ""
    err: str = ""


@contextlib.contextmanager
def running(process: subprocess.Popen[str], sig: int = signal.SIGTERM) -> Iterator[Ended]:
    """Let ``process`` run through the block (waiting in it for what it should bring
    about), then stop it with ``sig``, even when the block fails; once the block went
    through, the process must have exited 0 (its stderr tells why not). The
    :class:`Ended` yielded holds its status and output after the block."""
    ended = Ended()
    try:
        yield ended
    finally:
        ended.code, ended.out, ended.err = stop(process, sig)
    assert ended.code == 0, ended.err


def wait_until(
    predicate,
    *,
    timeout: float,
    interval: float = 0.1,
    what: str = "condition",
    process: subprocess.Popen[str] | None = None,
):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``. With
    ``process`` (what should bring the condition about), fail as soon as it exits, and
    either failure stops it and tells the end of its stderr."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(
                f"{what}: the process exited {process.returncode} first{_told(process)}"
            )
        time.sleep(interval)
    told = "" if process is None else _told(process)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{told}")


def _told(process: subprocess.Popen[str]) -> str:
    """The end of ``process``'s stderr, after stopping it if it still runs."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        _out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        _out, err = process.communicate()
    return f"; its stderr ends: {(err or '')[-3000:]}"
