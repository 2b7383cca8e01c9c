"""Deleting rows whose retention has passed: outbox rows in a final state, inbox
marks, and inbox failure records.

Deletes go in bounded batches (each its own short statement), so cleanup never
holds long locks and can run beside relays and consumers. Cut-offs come from the
database clock.

=============  ==========================================  =======================
kind           rows                                         kept for
=============  ==========================================  =======================
``published``  PUBLISHED outbox rows, by ``published_at``  ``PUBLISHED_RETENTION``
``abandoned``  ABANDONED outbox rows, by ``abandoned_at``  ``ABANDONED_RETENTION``
``inbox``      inbox marks, by ``processed_at``            ``INBOX_RETENTION``
``failures``   unparked inbox failures, by last failure    ``INBOX_RETENTION``
``parked``     parked inbox failures, by ``parked_at``     ``ABANDONED_RETENTION``
=============  ==========================================  =======================
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from django.db.models import Expression, QuerySet

from . import db
from .conf import outbox_settings
from .models import InboxFailure, InboxMessage, OutboxMessage

logger = logging.getLogger(__name__)

DELETE_BATCH = 1000


def _before(retention: dt.timedelta) -> Expression:
    return db.now_plus(-retention.total_seconds())


def expired(using: str = "default") -> dict[str, QuerySet[Any]]:
    """The rows retention would delete now, per kind (see the module docstring)."""
    outbox = OutboxMessage.objects.using(using)
    failures = InboxFailure.objects.using(using)
    return {
        "published": outbox.published().filter(
            published_at__lt=_before(outbox_settings.PUBLISHED_RETENTION)
        ),
        "abandoned": outbox.abandoned().filter(
            abandoned_at__lt=_before(outbox_settings.ABANDONED_RETENTION)
        ),
        "inbox": InboxMessage.objects.using(using).filter(
            processed_at__lt=_before(outbox_settings.INBOX_RETENTION)
        ),
        "failures": failures.failing().filter(
            last_failed_at__lt=_before(outbox_settings.INBOX_RETENTION)
        ),
        "parked": failures.parked().filter(
            parked_at__lt=_before(outbox_settings.ABANDONED_RETENTION)
        ),
    }


def cleanup(
    using: str = "default", *, dry_run: bool = False, batch_size: int = DELETE_BATCH
) -> dict[str, int]:
    """Delete (or with ``dry_run`` count) expired rows; returns counts per kind."""
    if dry_run:
        return {kind: rows.count() for kind, rows in expired(using).items()}
    counts = {kind: _delete_in_batches(rows, batch_size) for kind, rows in expired(using).items()}
    if any(counts.values()):
        logger.info(
            "retention deleted %s",
            describe(counts),
            extra={"action": "outbox.cleanup", "using": using, **counts},
        )
    return counts


def describe(counts: dict[str, int]) -> str:
    """``"3 published, 0 abandoned, ..."``: one line for logs and commands."""
    return ", ".join(f"{count} {kind}" for kind, count in counts.items())


def _delete_in_batches(rows: QuerySet[Any], batch_size: int) -> int:
    total = 0
    while ids := list(rows.values_list("id", flat=True)[:batch_size]):
        # The filter is applied again: a row requeued since it was selected stays.
        deleted, _ = rows.filter(id__in=ids).delete()
        total += deleted
    return total
