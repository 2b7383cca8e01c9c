"""System checks that need the database: manage.py check with --database, and the relay and
consumer refusing to start (subprocesses on PostgreSQL)."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.test.utils import override_settings

from tests.support import manage
from tests.unit.test_checks import BROKER, OPTIONS


@pytest.mark.django_db
def test_manage_py_check_reports_the_errors():
    with override_settings(OUTBOX={**BROKER, "BATCH_SIZE": -5}):
        with pytest.raises(SystemCheckError, match=r"django_outbox.E003"):
            call_command("check", "--database", "default")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "command",
    [
        ["run_outbox_relay", "--drain"],
        ["run_outbox_consumer", "--queue=orders", "--handler=tests.testapp.handlers.bill"],
    ],
    ids=["relay", "consumer"],
)
def test_the_relay_and_the_consumer_refuse_to_start_without_the_filesystem_folder(
    tmp_path, command
):
    """The check, not a FileNotFoundError in last_error, is what a user sees first."""
    missing = str(tmp_path / "broker")
    options = {"data_folder_in": missing, "data_folder_out": missing}
    result = manage(*command, BROKER_URL="filesystem://", BROKER_TRANSPORT_OPTIONS=options)
    assert result.returncode == 1, result.stderr
    assert (
        f"?: (django_outbox.E012) The filesystem:// broker's folder {missing!r} "
        f"({OPTIONS}['data_folder_out']) does not exist."
    ) in result.stderr.splitlines()
