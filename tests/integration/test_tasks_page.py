"""docs/tasks.md's quickstart, run as written by a new user, no server (Django 6 only).

The page's conventions are the quickstart's (tests/integration/test_quickstart.py): ``sh``
lines are commands, ``# path/file.py`` blocks are files (``(add at the end)``: appended),
``text`` blocks are output the page promises. One more: a command marked ``# in a second
terminal`` keeps running (the Celery worker); it is started in the background, its output
read with the others', and stopped at the end. A promised line may come from it a little
later, so each ``text`` block is waited for (up to a minute) before it fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.test_quickstart import BLOCK, NewUser
from tests.support import REPO

pytest.importorskip("django.tasks", reason="django.tasks is Django 6.0+")

# Not marked slow: it runs on Django 6 only, whose CI run skips the slow tests.

PAGE = REPO / "docs" / "tasks.md"
SECOND_TERMINAL = "# in a second terminal"


def page_blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced block of the quickstart section, in order."""
    section = PAGE.read_text().split("## Quickstart: no server", 1)[1].split("\n## ", 1)[0]
    return BLOCK.findall(section)


@dataclass
class UserWithTwoTerminals(NewUser):
    logs: Path = Path()
    background: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def run(self, command: str) -> None:
        if not command.endswith(SECOND_TERMINAL):
            super().run(command)
            return
        log = self.logs / f"terminal-{len(self.background) + 2}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                shell=True,
                cwd=self.cwd,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its process group: the shell and the worker
            )
        self.background.append((command, process, log))

    def check_promised(self, body: str) -> None:
        deadline = time.monotonic() + 60
        while True:
            before = list(self.printed)
            self.printed += [(c, log.read_text()) for c, _, log in self.background]
            try:
                super().check_promised(body)
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
            finally:
                self.printed = before

    def close(self) -> None:
        for _, process, _ in self.background:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGQUIT)  # Celery's cold shutdown
                process.wait(timeout=30)


def test_a_new_user_following_the_tasks_page_runs_their_first_task_once(tmp_path):
    (tmp_path / "project").mkdir()
    user = UserWithTwoTerminals(tmp_path / "project", logs=tmp_path)
    try:
        user.follow(page_blocks())
    finally:
        user.close()
    assert user.written == [
        "mysite/settings.py",
        "mysite/celery.py",
        "mysite/__init__.py",
        "emails/models.py",
        "emails/tasks.py",
        "emails/signup.py",
    ]
    assert [c for c, _, _ in user.background] == [
        f"celery -A mysite worker --queues default --pool solo --loglevel INFO   {SECOND_TERMINAL}"
    ]
