"""Every refused input and misconfiguration listed in docs/hostile-input.md, as code.

Each module of this package registers one *trigger* per row of the page with
:func:`case`: a function that takes pytest's ``request``, provokes the failure on
the real services (PostgreSQL, RabbitMQ, Redis) and returns the one line a user
sees: an exception as ``"TypeName: message"``, a system check as
``"django_outbox.E0xx: message"``, a log line or a command's output line.

``tests/integration/test_docs.py`` runs every trigger and compares its line with the page's
row, where ``…`` stands for any text. So the page cannot promise an error the code
does not give, and a case cannot be added here without a row on the page.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

Trigger = Callable[[Any], str]

CASES: dict[str, Trigger] = {}


def case(name: str) -> Callable[[Trigger], Trigger]:
    """Register ``trigger`` as the code behind the row ``name`` of docs/hostile-input.md."""

    def register(trigger: Trigger) -> Trigger:
        if name in CASES:
            raise ValueError(f"hostile case {name!r} is registered twice")
        CASES[name] = trigger
        return trigger

    return register


def load() -> dict[str, Trigger]:
    """Import every module of this package and return the registered triggers."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return CASES


def error_line(exc: BaseException) -> str:
    """An exception the way the page writes it: ``TypeName: message``."""
    return f"{type(exc).__name__}: {exc}"
