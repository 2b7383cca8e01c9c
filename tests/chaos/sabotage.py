"""Deliberately broken guarantees, to show that the audit catches them.

``python -m tests.chaos --sabotage lease`` starts relays whose finalize ignores the
lease token (a relay whose lease was taken over writes anyway);
``--sabotage inbox`` starts a consumer without the inbox (every delivery runs the
handler). A run with either must fail its audit. Nothing imports this module
unless ``CHAOS_SABOTAGE`` is set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from django.db import transaction

KINDS = ("lease", "inbox")


def apply(kind: str) -> None:
    if kind == "lease":
        from django_outbox.models import OutboxQuerySet

        OutboxQuerySet.leased = lambda self, token: self  # type: ignore[method-assign]
    elif kind == "inbox":
        from django_outbox import consumer

        consumer.process_once = _no_inbox  # type: ignore[assignment]
    else:
        raise ValueError(f"CHAOS_SABOTAGE must be one of {', '.join(KINDS)}; got {kind!r}")


@contextlib.contextmanager
def _no_inbox(consumer: str, event_id: object, using: str = "default") -> Iterator[bool]:
    """``process_once`` without the mark: every delivery counts as new."""
    with transaction.atomic(using=using):
        yield True
