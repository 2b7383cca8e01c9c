"""The chaos suite's processes: started, signalled, restarted, each logging to a file.

A ``Proc`` is one role (``relay-1``, ``consumer``, ``producer-2`` ...); killing and
restarting it keeps the role and appends the new incarnation's output to the same
log, after a line naming its pid.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.services import REPO

HOST = socket.gethostname()


class Proc:
    def __init__(self, role: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.role = role
        self.argv = argv
        self.env = {**env, "CHAOS_ROLE": role}
        self.log = logs / f"{role}.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.exits: list[int] = []  # return codes of the incarnations that ended
        self.pids: list[int] = []  # of every incarnation

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def application_name(self) -> str:
        """Its database connections' ``application_name`` (see chaos.settings)."""
        return f"{self.role} {self.pid}"

    @property
    def worker(self) -> str:
        """The relay's ``locked_by``: ``host:pid``, as the relay names itself."""
        return f"{HOST}:{self.pid}"

    def start(self) -> None:
        with self.log.open("ab") as log:
            log.write(f"---- {time.strftime('%H:%M:%S')} starting {self.role}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.pids.append(self.process.pid)
        with self.log.open("ab") as log:
            log.write(f"---- pid {self.process.pid}\n".encode())

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.signal(signal.SIGKILL)
        self.wait(30)

    def wait(self, timeout: float) -> int:
        assert self.process is not None
        code = self.process.wait(timeout)
        self.exits.append(code)
        return code

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, and the exit code (SIGKILL after ``timeout``: reported as -9)."""
        if not self.alive():
            assert self.process is not None
            return self.process.returncode
        self.signal(signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -signal.SIGKILL

    def cleanup(self) -> None:
        """Whatever state the run left it in: make sure it is gone."""
        if self.alive():
            self.signal(signal.SIGCONT)
            self.kill()


def manage(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "manage.py"), *args]


def module(name: str, *args: str) -> list[str]:
    return [sys.executable, "-m", name, *args]


def worker_env(database_url: str, services_env: dict[str, str], outbox: str) -> dict[str, str]:
    return {
        **os.environ,
        **services_env,
        "DJANGO_SETTINGS_MODULE": "chaos.settings",
        "CHAOS_DATABASE_URL": database_url,
        "CHAOS_OUTBOX": outbox,
        "PYTHONUNBUFFERED": "1",
    }
