"""Why rows were not published, counted: rows that failed alike are one reason with a
count, for the relay's log (one record per batch and reason, never one per row) and
for the summary of ``run_outbox_relay --once/--drain``."""

from __future__ import annotations

import collections
import dataclasses

#: Distinct reasons a count keeps; the rows of further reasons are only counted, so
#: a relay that runs for weeks with ever new error texts does not grow.
MAX_REASONS = 100


@dataclasses.dataclass(frozen=True)
class Reason:
    """Why some rows were not published: where they went, the error (as in
    ``last_error``, without passwords), and whether they were abandoned."""

    destination: str
    error: str
    abandoned: bool


@dataclasses.dataclass
class FailureCounts:
    """Failed and abandoned rows counted by :class:`Reason`. At most ``MAX_REASONS``
    reasons are kept; the rows of any further reason are counted in ``others``."""

    counts: collections.Counter[Reason] = dataclasses.field(default_factory=collections.Counter)
    others: int = 0

    def add(self, reason: Reason, rows: int) -> None:
        if reason in self.counts or len(self.counts) < MAX_REASONS:
            self.counts[reason] += rows
        else:
            self.others += rows

    def update(self, other: FailureCounts) -> None:
        for reason, rows in other.counts.items():
            self.add(reason, rows)
        self.others += other.others

    def most_common(self, limit: int) -> tuple[list[tuple[Reason, int]], int]:
        """The ``limit`` reasons with the most rows, most first (ties in destination and
        error order), and how many rows the other reasons hold."""
        ranked = sorted(
            self.counts.items(), key=lambda item: (-item[1], item[0].destination, item[0].error)
        )
        rest = sum(rows for _, rows in ranked[limit:]) + self.others
        return ranked[:limit], rest

    def __bool__(self) -> bool:
        return bool(self.counts) or self.others > 0
