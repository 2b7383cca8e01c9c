"""Triggers for the "A filesystem:// broker without its folder" section of
docs/hostile-input.md, and for the consumer that gives up on an unreachable broker
(issue 19)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support import manage, unreachable_broker_url

from . import case
from .settings import check_lines, only


def folders(request: Any, folder_in: str, folder_out: str) -> dict[str, str]:
    """Transport options with the two folders under a fresh temporary directory."""
    root: Path = request.getfixturevalue("tmp_path")
    return {"data_folder_in": str(root / folder_in), "data_folder_out": str(root / folder_out)}


@case("filesystem-folder-missing")
def filesystem_folder_missing(request: Any) -> str:
    options = folders(request, "nowhere", "")
    return only(check_lines(BROKER_URL="filesystem://", BROKER_TRANSPORT_OPTIONS=options))


@case("filesystem-folder-option-missing")
def filesystem_folder_option_missing(request: Any) -> str:
    options = {"data_folder_in": folders(request, "", "")["data_folder_in"]}
    return only(check_lines(BROKER_URL="filesystem://", BROKER_TRANSPORT_OPTIONS=options))


@case("filesystem-folders-differ")
def filesystem_folders_differ(request: Any) -> str:
    options = folders(request, "in", "out")
    for folder in options.values():
        Path(folder).mkdir()
    return only(check_lines(BROKER_URL="filesystem://", BROKER_TRANSPORT_OPTIONS=options))


@case("consumer-gave-up")
def consumer_gave_up(request: Any) -> str:
    result = manage(
        "run_outbox_consumer",
        "--queue=orders",
        "--handler=tests.testapp.handlers.record",
        "--consumer=billing",
        "--idle-timeout=1",
        # A port that refuses every connection (a broker that is down), held by this process:
        # one only freed was taken meanwhile by a server of another CI chain, once.
        BROKER_URL=unreachable_broker_url(),
    )
    assert result.returncode == 1, result.stderr
    return result.stderr.strip().splitlines()[-1]
