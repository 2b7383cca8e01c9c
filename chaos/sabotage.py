"""Deliberately broken guarantees, to show that the audit catches them.

``python -m chaos --sabotage lease`` starts relays whose finalize ignores the
lease token (a relay whose lease was taken over writes anyway);
``--sabotage inbox`` starts a consumer without the inbox (every delivery runs the
handler); ``--sabotage parking`` starts a consumer that parks a message at its first
redelivery, as if a consumer kill were the message's fault; ``--sabotage order`` starts
relays whose claim has no per-key gate (the named query ``ordered_gate`` replaced with
``TRUE``), so any due row of an ordered key can be claimed, by any relay, next to its
predecessors. A run with any of them must fail its audit. Nothing imports this module
unless ``CHAOS_SABOTAGE`` is set.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from django.db import transaction

KINDS = ("lease", "inbox", "parking", "order")


def apply(kind: str) -> None:
    if kind == "lease":
        from django_outbox.models import OutboxQuerySet

        OutboxQuerySet.leased = lambda self, token: self  # type: ignore[method-assign]
    elif kind == "inbox":
        from django_outbox import consumer

        consumer.process_once = _no_inbox  # type: ignore[assignment]
    elif kind == "order":
        _without_ordered_gate()
    elif kind == "parking":
        from django_outbox.consumer import InboxConsumer

        InboxConsumer.__init__ = _parking_at_once(InboxConsumer.__init__)  # type: ignore[method-assign]
    else:
        raise ValueError(f"CHAOS_SABOTAGE must be one of {', '.join(KINDS)}; got {kind!r}")


def _without_ordered_gate() -> None:
    """Replace the claim's per-key gate, the named query ``ordered_gate``, with ``TRUE``."""
    from django_outbox.db import postgresql, queries

    named = queries._queries()
    if "ordered_gate" not in named:
        raise ValueError("--sabotage order: queries.sql has no ordered_gate query to replace")
    named["ordered_gate"] = "TRUE"
    postgresql._claim_sql.cache_clear()  # the claim is built from the named queries once


@contextlib.contextmanager
def _no_inbox(consumer: str, event_id: object, using: str = "default") -> Iterator[bool]:
    """``process_once`` without the mark: every delivery counts as new."""
    with transaction.atomic(using=using):
        yield True


def _parking_at_once(init: Callable[..., None]) -> Callable[..., None]:
    """``InboxConsumer.__init__`` with ``max_deliveries=1``: a redelivered message (its
    consumer was killed) is parked before its handler runs."""

    @functools.wraps(init)
    def parking(self: object, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "max_deliveries": 1})

    return parking
