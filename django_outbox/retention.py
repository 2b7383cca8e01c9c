"""Deleting PUBLISHED and ABANDONED rows once their retention has passed.

Deletes go in bounded batches (each its own short statement), so cleanup never
holds long locks and can run beside relays. Cut-offs come from the database clock.
"""

from __future__ import annotations

import logging

from django.db.models import QuerySet

from . import db
from .conf import outbox_settings
from .models import OutboxMessage

logger = logging.getLogger(__name__)

DELETE_BATCH = 1000


def expired(using: str = "default") -> dict[str, QuerySet[OutboxMessage]]:
    """The rows retention would delete now, per final state."""
    rows = OutboxMessage.objects.using(using)
    return {
        "published": rows.published().filter(
            published_at__lt=db.now_plus(-outbox_settings.PUBLISHED_RETENTION.total_seconds())
        ),
        "abandoned": rows.abandoned().filter(
            abandoned_at__lt=db.now_plus(-outbox_settings.ABANDONED_RETENTION.total_seconds())
        ),
    }


def cleanup(
    using: str = "default", *, dry_run: bool = False, batch_size: int = DELETE_BATCH
) -> dict[str, int]:
    """Delete (or with ``dry_run`` count) expired rows; returns counts per state."""
    if dry_run:
        return {state: rows.count() for state, rows in expired(using).items()}
    counts = {state: _delete_in_batches(rows, batch_size) for state, rows in expired(using).items()}
    if any(counts.values()):
        logger.info(
            "retention deleted %(published)d published and %(abandoned)d abandoned rows",
            counts,
            extra={"action": "outbox.cleanup", "using": using, **counts},
        )
    return counts


def _delete_in_batches(rows: QuerySet[OutboxMessage], batch_size: int) -> int:
    total = 0
    while ids := list(rows.values_list("id", flat=True)[:batch_size]):
        # The filter is applied again: a row requeued since it was selected stays.
        deleted, _ = rows.filter(id__in=ids).delete()
        total += deleted
    return total
