"""django_outbox.conf.from_env in the example project: its manage.py reads OUTBOX from the
environment (subprocesses)."""

from __future__ import annotations

import subprocess
import sys

from tests.integration.test_example_project import example_env, manage_in
from tests.support import REPO

SHOW = "from django_outbox.conf import outbox_settings as s; print(s.BATCH_SIZE, s.broker_url)"


def test_the_example_project_reads_its_settings_from_the_environment(tmp_path):
    env = example_env(tmp_path)
    assert manage_in(env, "shell", "-c", SHOW).splitlines()[-1].split() == ["500", "filesystem://"]

    env.update(OUTBOX_BATCH_SIZE="7", OUTBOX_BROKER_URL="memory://")
    assert manage_in(env, "shell", "-c", SHOW).splitlines()[-1].split() == ["7", "memory://"]

    env.update(OUTBOX_BATCH_SIZE="seven")
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "django_outbox.exceptions.OutboxConfigurationError: OUTBOX_BATCH_SIZE "
        "(OUTBOX[\"BATCH_SIZE\"]) must be a positive integer; got 'seven'"
    )
