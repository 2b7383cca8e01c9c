"""The package as a user gets it (issue 42): a wheel and an sdist built from the checkout pass
``twine check``, and the wheel, installed in a fresh virtualenv, takes a new project through
the quickstart to its first handled event (docs/deploying.md, Installing from a wheel).

A real build, a real venv, real pip: slow (about a minute), and the build's isolated
environment needs the package index that pip is configured with (or pip's cache). The
dependencies are the test venv's own versions, installed --no-deps, as in test_extras.py.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from importlib import metadata
from pathlib import Path

import pytest

from tests.integration.test_extras import CORE
from tests.integration.test_quickstart import NewUser, quickstart_blocks, user_env
from tests.support import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and the sdist, built from a copy of the checkout (an in-tree build
    writes build/ and egg-info into it)."""
    root = tmp_path_factory.mktemp("dist")
    source = root / "source"
    shutil.copytree(
        REPO / "django_outbox",
        source / "django_outbox",
        ignore=shutil.ignore_patterns("__pycache__"),  # bytecode the suite wrote, or writes
    )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(root / "dist"), str(source)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return root / "dist"


def test_the_wheel_and_the_sdist_pass_twine_check(dist):
    version = metadata.version("django-transactional-outbox")
    built = sorted(path.name for path in dist.iterdir())
    assert built == [
        f"django_transactional_outbox-{version}-py3-none-any.whl",
        f"django_transactional_outbox-{version}.tar.gz",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_quickstart_runs_from_the_wheel_in_a_fresh_venv(dist, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    subprocess.run([*pip, *(f"{n}=={metadata.version(n)}" for n in CORE)], check=True, timeout=600)
    (wheel,) = dist.glob("*.whl")
    subprocess.run([*pip, str(wheel)], check=True, timeout=600)

    # The user's shell: the fresh venv first on PATH, so "python" and "django-admin" are its.
    env = {**user_env(), "PATH": os.pathsep.join([str(venv / "bin"), os.environ["PATH"]])}
    user = NewUser(tmp_path / "site", env=env)
    user.cwd.mkdir()
    user.follow(quickstart_blocks())

    (relay,) = [out for c, out in user.printed if c.startswith("python manage.py run_outbox_relay")]
    assert relay.startswith("claimed 2, published 2, failed 0")
    with closing(sqlite3.connect(user.cwd / "db.sqlite3")) as db:
        invoices = db.execute("SELECT order_id FROM billing_invoice").fetchall()
    assert invoices == [(1,)]
    # The package that ran is the wheel's, in the fresh venv, not the checkout.
    located = subprocess.run(
        [python, "-c", "import django_outbox; print(django_outbox.__file__)"],
        cwd=user.cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert located.stdout.startswith(str(venv)), located.stdout
