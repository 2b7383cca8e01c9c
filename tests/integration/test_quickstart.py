"""The quickstart's "Add it to your project" half, run as written by a new user, no server.

The page's convention, which a reader follows too: a code block whose first line is
``# path/file.py (add at the end)`` is appended to that file, one whose first line is just
``# path/file.py`` is the whole file (replacing what ``startapp`` wrote); other Python blocks
(the RabbitMQ and Redis forms of the settings) are alternatives, compiled but not applied.
Each line of an ``sh`` block is a command, run as written by a shell whose ``PATH`` starts with
this venv's ``bin`` (``cd`` moves the following commands); ``pip install`` lines are skipped,
as the package is already installed here and the test has no network. Each ``text`` block is
output the page promises: every line of it (``…`` standing for any text) must be a line that
the commands before it printed. No server: the subprocesses get none of the service URLs.

The page's RabbitMQ and Redis forms of the settings are followed too, against this suite's
servers: the settings block changed as the page says (its ``BROKER_DIR`` lines and filesystem
``OUTBOX`` dropped, the form's ``OUTBOX`` in their place), only the URL pointed at the server.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import pytest

from tests.support import AMQP_URL, REDIS_URL, REPO, delete_queue

PAGE = REPO / "docs" / "quickstart.md"
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
FILE_HEADER = re.compile(r"# ([\w/]+\.(?:py|ini))( \(add at the end\))?")
#: Variables that point the project's own settings or the commands at a server.
SERVER_ENV = ("DATABASE_URL", "OTHER_DATABASE_URL", "DJANGO_SETTINGS_MODULE", "PYTHONPATH")


def quickstart_blocks() -> list[tuple[str, str]]:
    """(language, body) of each fenced block of the "Add it to your project" half, in order."""
    section = PAGE.read_text().split("## Add it to your project", 1)[1]
    return BLOCK.findall(section)


def with_broker(settings: str, form: str, url: str) -> str:
    """``settings`` (the page's no-server block) changed to ``form`` (one of its broker forms)
    as the page says: the ``BROKER_DIR`` lines through the end of ``OUTBOX`` replaced by the
    form's ``OUTBOX``, whose ``BROKER_URL`` becomes ``url`` (same scheme)."""
    start = settings.index("BROKER_DIR = ")
    end = settings.index("\n}\n", settings.index("OUTBOX = {")) + len("\n}\n")
    page_url = re.search(r'"BROKER_URL": "([^"]*)"', form)
    assert page_url and page_url.group(1).split(":")[0] == url.split(":")[0], form
    outbox = form[form.index("OUTBOX = {") :].replace(page_url.group(1), url)
    return settings[:start] + outbox + settings[end:]


def broker_form(name: str) -> str:
    """The page's alternative settings block whose first line begins ``# name``."""
    (form,) = [body for lang, body in quickstart_blocks() if body.startswith(f"# {name}")]
    return form


def commands_of(body: str) -> list[str]:
    """The commands of an ``sh`` block: one per line, backslash continuations joined."""
    lines = body.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def user_env() -> dict[str, str]:
    """The user's shell: this venv first on PATH, no service of the test suite in sight."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SERVER_ENV and not k.startswith(("OUTBOX_", "CELERY_"))
    }
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def normalized(line: str) -> str:
    return " ".join(line.split())


def promised_line(line: str) -> re.Pattern[str]:
    return re.compile(".*?".join(map(re.escape, normalized(line).split("…"))))


@dataclass
class NewUser:
    """Follows the page: runs its commands, writes its files, reads what was printed."""

    cwd: Path
    env: dict[str, str] = field(default_factory=user_env)
    printed: list[tuple[str, str]] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    #: The page's broker form to use instead of the no-server settings, and its server's URL.
    broker: tuple[str, str] | None = None

    def run(self, command: str) -> None:
        if command.startswith(("pip install", "python -m pip install")):
            return  # installed in this venv already
        if command.startswith("cd "):
            self.cwd = self.cwd / command.removeprefix("cd ").strip()
            return
        result = subprocess.run(
            command,
            shell=True,
            cwd=self.cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{command}\nexited {result.returncode}:\n{output}"
        self.printed.append((command, output))

    def write(self, body: str) -> None:
        header = FILE_HEADER.fullmatch(body.splitlines()[0])
        if header is None or header.group(1).endswith(".py"):
            compile(body, header.group(1) if header else "<alternative>", "exec")
        if header is None:
            return  # an alternative form of a block, not applied
        target = self.cwd / header.group(1)
        if self.broker and header.group(1) == "mysite/settings.py":
            body = with_broker(body, broker_form(self.broker[0]), self.broker[1])
        if header.group(2):  # add at the end
            assert target.exists(), f"{target} should exist before the page appends to it"
            target.write_text(target.read_text() + "\n" + body)
        else:
            target.write_text(body)
        self.written.append(header.group(1))

    def check_promised(self, body: str) -> None:
        lines = {normalized(line) for _, output in self.printed for line in output.splitlines()}
        for promised in filter(str.strip, body.splitlines()):
            pattern = promised_line(promised)
            assert any(pattern.fullmatch(line) for line in lines), (
                f"the page promises {promised!r}; the commands printed:\n"
                + "\n".join(f"$ {c}\n{o}" for c, o in self.printed)
            )

    def follow(self, blocks: list[tuple[str, str]]) -> None:
        for language, body in blocks:
            if language == "sh":
                for command in commands_of(body):
                    self.run(command)
            elif language in ("python", "ini"):
                self.write(body)
            elif language == "text":
                self.check_promised(body)


# The page's steps do not depend on the broker: Django 6 (which skips "slow") follows them
# on RabbitMQ only, Django 5.2 on all three.
@pytest.fixture(
    params=[
        pytest.param("filesystem", marks=pytest.mark.slow),
        "RabbitMQ",
        pytest.param("Redis", marks=pytest.mark.slow),
    ]
)
def broker(request) -> Iterator[tuple[str, str] | None]:
    """The no-server path (None), or a broker form of the page and this suite's server; the
    page's queue ``orders`` is deleted before and after, so only the page's events are in it."""
    if request.param == "filesystem":
        yield None
        return
    url = {"RabbitMQ": AMQP_URL, "Redis": REDIS_URL}[request.param]
    delete_queue("orders", url)
    yield request.param, url
    delete_queue("orders", url)


def test_a_new_user_following_the_page_consumes_their_first_event(tmp_path, broker):
    user = NewUser(tmp_path, broker=broker)
    user.follow(quickstart_blocks())

    # The page is the whole path, from startproject to the consumer, nothing skipped.
    assert user.written == [
        "mysite/settings.py",
        "orders/models.py",
        "orders/services.py",
        "billing/models.py",
        "billing/handlers.py",
    ]
    assert user.printed[0][0] == "django-admin startproject mysite"
    (relay,) = [out for c, out in user.printed if c.startswith("python manage.py run_outbox_relay")]
    (consumer,) = [out for c, out in user.printed if "manage.py run_outbox_consumer" in c]
    # The order.placed event is billed; the order.shipped staged beside it is acked, unbilled.
    assert relay.startswith("claimed 2, published 2, failed 0")
    assert re.search(
        r"^received 2: handled 1, duplicates 0, ignored 1, failed 0, parked 0, rejected 0 in ",
        consumer,
        re.MULTILINE,
    ), consumer
    with closing(sqlite3.connect(user.cwd / "db.sqlite3")) as db:
        query = "SELECT order_id, CAST(total AS TEXT) FROM billing_invoice"
        invoices = db.execute(query).fetchall()
    assert [(order_id, Decimal(total)) for order_id, total in invoices] == [(1, Decimal("19.90"))]
    # The broker was a folder of the project, or none at all.
    assert (user.cwd / "broker" / "control" / "outbox.exchange").exists() is (broker is None)
