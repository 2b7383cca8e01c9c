"""``manage.py outbox_partition``: turn the outbox table into a partitioned one
(:mod:`django_outbox.db.partitions`), or on one that is, make the partitions ahead;
then the lines describing each partition."""

from __future__ import annotations

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.migrations.executor import MigrationExecutor

from ..conf import outbox_settings
from ..db import partitions
from ..exceptions import OutboxConfigurationError


def partition(using: str) -> list[str]:
    """Partition the outbox of database ``using`` (or keep its partitions ahead);
    returns the lines to print. Raises :class:`OutboxConfigurationError` with the fix
    when it cannot."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        raise OutboxConfigurationError(
            f"outbox_partition needs PostgreSQL; database {using!r} is {connection.vendor}"
        )
    sizes = outbox_settings.PARTITIONING
    if sizes is None:
        raise OutboxConfigurationError(
            'set OUTBOX["PARTITIONING"] = {"rows": ids per partition} first: the relays read '
            "the partitions' size from it (docs/scaling.md)"
        )
    executor = MigrationExecutor(connection)
    targets = [key for key in executor.loader.graph.leaf_nodes() if key[0] == "django_outbox"]
    if executor.migration_plan(targets):
        raise OutboxConfigurationError(
            f"django_outbox has unapplied migrations on {using!r}: run manage.py migrate first"
        )
    if partitions.is_partitioned(connection):
        made = partitions.ensure_ahead(connection, sizes["rows"], sizes["ahead"])
        lines = [f"the outbox table is partitioned; {len(made)} partitions made ahead"]
    else:
        partitions.convert(connection, sizes["rows"], sizes["ahead"])
        lines = ["the outbox table is now partitioned by ranges of id"]
    return lines + describe(using)


def describe(using: str) -> list[str]:
    """One line per partition: its ids, and what keeps it or when it may be dropped."""
    connection = connections[using]
    drawn = partitions.next_id(connection)
    published, abandoned = outbox_settings.PUBLISHED_RETENTION, outbox_settings.ABANDONED_RETENTION
    lines = []
    for part in partitions.partitions(connection):
        if part.default:
            lines.append(f"{part.name}: ids no range holds (deleted row by row)")
            continue
        ids = part.ids
        if part.upper is None or part.upper > drawn:
            lines.append(f"{part.name}: {ids}, open (ids still to be drawn)")
            continue
        expiry = partitions.expiry(connection, part, published, abandoned)
        state = (
            _kept(connection, part)
            if expiry.blocked
            else "expired: the next cleanup drops it"
            if expiry.expired
            else f"dropped after {expiry.expires_at:%Y-%m-%d %H:%M:%S %Z}"
        )
        lines.append(f"{part.name}: {ids}, closed, {state}")
    return lines


def _kept(connection: BaseDatabaseWrapper, part: partitions.Partition) -> str:
    """Why ``part`` is kept, naming the rows and what an operator does about them."""
    ids = partitions.blockers(connection, part, limit=4)
    rows = ", ".join(map(str, ids[:3])) + (" ..." if len(ids) > 3 else "")
    return (
        f"kept whole by rows {rows} (unfinished, or ABANDONED ordered: an operator requeues "
        "or skips those; see outbox_status)"
    )
