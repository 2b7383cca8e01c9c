"""Celery, Redis, Kafka and NATS are optional extras: in a fresh virtualenv with this package
and its core dependencies only (no celery, no redis, no confluent-kafka, no nats-py), the
package imports, the relay runs, and a Celery route, a redis://, a kafka:// or a nats:// URL
is refused with the pip extra to install.

A real venv, real pip, real subprocesses: slow (about a minute), and it needs the
package index that pip is configured with (or pip's cache).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from tests.support import REPO

pytestmark = pytest.mark.slow

#: The core dependencies, pinned to the versions of the test venv, installed --no-deps.
CORE = ("Django", "asgiref", "sqlparse", "psycopg", "psycopg-binary", "typing_extensions")
CORE += ("kombu", "amqp", "vine", "packaging", "django-environ")

SETTINGS = """
import os
SECRET_KEY = "x"
USE_TZ = True
INSTALLED_APPS = ["django.contrib.contenttypes", "django_outbox"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
OUTBOX = {"BROKER_URL": os.environ.get("BROKER", "memory://")}
if os.environ.get("CELERY_ROUTE"):
    OUTBOX["ROUTES"] = {"emails": {"celery_task": "shop.tasks.send_receipt"}}
"""

RELAY = """
import sys, threading
import django
django.setup()
from django.core.management import call_command
from django.db import transaction
import django_outbox
from django_outbox.relay import Relay
from django_outbox.exceptions import OutboxConfigurationError
call_command("migrate", verbosity=0)
with transaction.atomic():
    django_outbox.stage("order.placed", {"id": 1}, destination="orders")
totals = Relay().run(threading.Event(), drain=True)
print("published", totals.published)
print("celery imported", "celery" in sys.modules)
from django.test import override_settings
with override_settings(OUTBOX={"BROKER_URL": "memory://",
                               "ROUTES": {"emails": {"celery_task": "t"}}}):
    try:
        Relay()
    except OutboxConfigurationError as exc:
        print(exc)
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtualenv with the package and its core dependencies: no celery, no redis."""
    root = tmp_path_factory.mktemp("no-celery")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    python = root / "venv" / "bin" / "python"
    pins = [f"{name}=={metadata.version(name)}" for name in CORE]
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, "--no-deps", *pins], check=True, timeout=600)
    # Built from a copy: an in-tree build would write the checkout's build/ folder.
    source = root / "source"
    shutil.copytree(
        REPO / "django_outbox",
        source / "django_outbox",
        ignore=shutil.ignore_patterns("__pycache__"),  # bytecode the suite wrote, or writes
    )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, source / name)
    subprocess.run([*pip, "--no-deps", str(source)], check=True, timeout=600)
    (root / "mini_settings.py").write_text(SETTINGS)
    (root / "relay.py").write_text(textwrap.dedent(RELAY))
    return root


def run_in(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "venv" / "bin" / "python"), *args],
        cwd=venv,
        env={"DJANGO_SETTINGS_MODULE": "mini_settings", "PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_venv_has_neither_celery_nor_redis(venv):
    found = run_in(
        venv, "-c", "import importlib.util as u; print(u.find_spec('celery'), u.find_spec('redis'))"
    )
    assert found.stdout.split() == ["None", "None"], found.stderr


def test_check_passes_without_celery_and_the_relay_runs(venv):
    result = run_in(venv, "-m", "django", "check")
    assert result.returncode == 0, result.stderr
    relay = run_in(venv, "relay.py")
    assert relay.returncode == 0, relay.stderr
    assert relay.stdout.splitlines() == [
        "published 1",
        "celery imported False",
        "django_outbox.E016: Routes ['emails'] send Celery tasks (celery_task), which requires "
        'the celery package: pip install "django-transactional-outbox[celery]"',
    ]


def test_a_celery_route_without_celery_is_a_check_error_naming_the_extra(venv):
    result = run_in(venv, "-m", "django", "check", CELERY_ROUTE="1")
    assert result.returncode == 1
    assert (
        "?: (django_outbox.E016) Routes ['emails'] send Celery tasks (celery_task), which "
        'requires the celery package: pip install "django-transactional-outbox[celery]"\n'
    ) in result.stderr


def test_a_redis_url_without_redis_is_a_check_error_naming_the_extra(venv):
    result = run_in(venv, "-m", "django", "check", BROKER="redis://127.0.0.1:6379/0")
    assert result.returncode == 1
    assert (
        "?: (django_outbox.E011) The broker URL redis://127.0.0.1:6379/0 needs the Python "
        "package 'redis', which is not installed: pip install "
        '"django-transactional-outbox[redis]"\n'
    ) in result.stderr


def test_a_kafka_url_without_confluent_kafka_is_a_check_error_naming_the_extra(venv):
    result = run_in(venv, "-m", "django", "check", BROKER="kafka://127.0.0.1:9092")
    assert result.returncode == 1
    assert (
        "?: (django_outbox.E011) The broker URL kafka://127.0.0.1:9092 is a Kafka cluster, "
        "which needs the Python package 'confluent_kafka' (confluent-kafka), not installed: "
        'pip install "django-transactional-outbox[kafka]"\n'
    ) in result.stderr


def test_inboxtask_without_celery_names_the_extra(venv):
    result = run_in(venv, "-c", "import django_outbox.celery")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: django_outbox.celery requires the celery package: "
        'pip install "django-transactional-outbox[celery]"'
    )


def test_a_nats_url_without_nats_py_is_a_check_error_naming_the_extra(venv):
    result = run_in(venv, "-m", "django", "check", BROKER="nats://u:secret@127.0.0.1:4222,h2:4222")
    assert result.returncode == 1
    assert (
        "?: (django_outbox.E011) The broker URL nats://u:***@127.0.0.1:4222,h2:4222 is NATS "
        "JetStream, whose client nats-py is not installed: pip install "
        '"django-transactional-outbox[nats]"\n'
    ) in result.stderr
