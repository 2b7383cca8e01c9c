"""Triggers for the rows of docs/hostile-input.md's "A filesystem:// broker without its
folder" section added in the review of issue 19: a file where the folder should be, and
a folder written with "~"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import case
from .settings import check_lines, only


@case("filesystem-folder-is-a-file")
def filesystem_folder_is_a_file(request: Any) -> str:
    root: Path = request.getfixturevalue("tmp_path")
    (root / "broker").write_text("")
    options = {"data_folder_in": str(root / "broker"), "data_folder_out": str(root)}
    return only(check_lines(BROKER_URL="filesystem://", BROKER_TRANSPORT_OPTIONS=options))


@case("filesystem-folder-tilde")
def filesystem_folder_tilde(request: Any) -> str:
    root: Path = request.getfixturevalue("tmp_path")
    options = {"data_folder_in": "~/broker", "data_folder_out": str(root)}
    return only(check_lines(BROKER_URL="filesystem://", BROKER_TRANSPORT_OPTIONS=options))
