"""kombu's filesystem transport (``filesystem://``): the folders it needs, checked
before the first publish.

The transport writes each message as a file into ``data_folder_out`` and reads
from ``data_folder_in``, both transport options. A folder that does not exist
fails every publish (or every read) with a bare ``FileNotFoundError``; an option
left out falls back to kombu's ``data_out``/``data_in`` in the working directory;
and two different folders lose nothing but deliver nothing, since the relay
writes where no consumer reads. :func:`folder_problems` says so in words, for the
system checks (E012, W005), which every management command runs at start-up: the
relay and the consumers among them. :func:`require_folders` is part of the relay's
broker check, for a folder that goes away while the relay runs.

Nothing here reads settings: the caller passes the URL and the options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..conf import CHECK_IDS, Broker, Problem, broker_scheme
from .kombu import KombuTransport

#: The options that name the folders, in the order they are checked, with kombu's
#: default for each (relative to the working directory).
FOLDERS = {"data_folder_in": "data_in", "data_folder_out": "data_out"}

_OPTIONS = 'OUTBOX["BROKER_TRANSPORT_OPTIONS"]'


class FilesystemTransport(KombuTransport):
    """kombu's ``filesystem://``: a file per message, in folders that must exist. The
    broker check looks for them, so a folder that goes away is an outage."""

    def _check_ready(self) -> None:
        require_folders(self._url, self._options, self.options_setting)

    @classmethod
    def problems(cls, broker: Broker) -> list[Problem]:
        """E012 and W005: the folders, found by the system checks before the first publish."""
        return folder_problems(broker.url, broker.options, broker.options_setting)


def is_filesystem(url: str) -> bool:
    return broker_scheme(url) == "filesystem"


def folder_problems(url: str, options: Mapping[str, Any], setting: str = _OPTIONS) -> list[Problem]:
    """What keeps the filesystem broker at ``url`` from delivering with ``options``:
    a folder option left out or naming no folder (E012), or ``data_folder_in`` and
    ``data_folder_out`` naming different folders (W005). Empty for other transports.
    ``setting`` is where the options are set (the texts name it)."""
    if not is_filesystem(url):
        return []
    found = [
        problem
        for option, default in FOLDERS.items()
        if (problem := _folder_problem(option, options.get(option), default, setting)) is not None
    ]
    if found:
        return found
    folder_in, folder_out = (os.fspath(options[option]) for option in FOLDERS)
    if os.path.realpath(folder_in) != os.path.realpath(folder_out):  # symlinks: one folder
        found.append(
            Problem(
                CHECK_IDS["filesystem_split"],
                f'{setting} has "data_folder_in" {folder_in!r} and "data_folder_out" '
                f"{folder_out!r}: the relay writes into the second and consumers read from "
                "the first, so no event is ever consumed.",
                "Set both to the same folder: the relay and the consumers read the same "
                "options, so the relay writes where they read only when the two are one.",
            )
        )
    return found


def require_folders(url: str, options: Mapping[str, Any], setting: str = _OPTIONS) -> None:
    """Raise :class:`FileNotFoundError`, in E012's words, when a folder of the
    filesystem broker at ``url`` is not there (an option left out stands for kombu's
    default folder). Part of the relay's broker check, so that a folder removed while
    a relay runs is an outage, waited out without spending attempts, rather than a
    failed publish of every batch."""
    if not is_filesystem(url):
        return
    for option, default in FOLDERS.items():
        folder = options.get(option) or default
        if isinstance(folder, str | os.PathLike) and not os.path.isdir(folder):
            raise FileNotFoundError(_no_folder(option, os.fspath(folder), setting).msg)


def _folder_problem(option: str, folder: object, default: str, setting: str) -> Problem | None:
    if folder is None:
        return Problem(
            CHECK_IDS["filesystem_folder"],
            f"{setting} has no {option!r} for the filesystem:// broker: kombu would use "
            f"the folder {os.path.abspath(default)!r} (its default {default!r}, relative to "
            "the working directory).",
            f'Set "data_folder_in" and "data_folder_out" in {setting} to one folder that '
            'exists, such as str(BASE_DIR / "broker").',
        )
    if not isinstance(folder, str | os.PathLike) or not os.fspath(folder):
        return Problem(
            CHECK_IDS["filesystem_folder"],
            f"{setting}[{option!r}] must be a folder path; got {folder!r}.",
            f'Set "data_folder_in" and "data_folder_out" in {setting} to one folder that exists.',
        )
    if not os.path.isdir(folder):
        return _no_folder(option, os.fspath(folder), setting)
    return None


def _no_folder(option: str, path: str, setting: str) -> Problem:
    """E012 for a folder option whose path is no folder: missing, a file, or a path
    that starts with "~" (kombu does not expand it)."""
    named = f"The filesystem:// broker's folder {path!r} ({setting}[{option!r}])"
    if path.startswith("~"):
        return Problem(
            CHECK_IDS["filesystem_folder"],
            f'{named} starts with "~", which kombu does not expand: it would be a folder '
            'named "~" in the working directory.',
            f"Write the whole path, such as {os.path.expanduser(path)!r} "
            f"(os.path.expanduser({path!r})).",
        )
    if os.path.exists(path):
        return Problem(
            CHECK_IDS["filesystem_folder"],
            f"{named} is not a folder.",
            f"Set {setting}[{option!r}] to a folder, or put a folder in its place.",
        )
    return Problem(
        CHECK_IDS["filesystem_folder"],
        f"{named} does not exist.",
        f"Create it (mkdir -p {path}) where the relay and the consumers "
        f"run, or set {setting}[{option!r}] to a folder that exists.",
    )
