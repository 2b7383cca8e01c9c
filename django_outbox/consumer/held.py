"""Messages a consumer keeps unacked until their time comes: a failed delivery for its
backoff delay, an event of an ordered route held back for an earlier one of its key.
Each occupies a prefetch slot meanwhile, so the consumer takes other messages while
they wait.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Any

from ..inbox.records import Scope


class Held:
    """Failed messages kept unacked until their backoff delay is over, soonest first.

    Each one occupies a prefetch slot meanwhile, so the consumer takes other
    messages while they wait; a message is requeued (to be delivered again,
    marked redelivered) when its time comes, or at once when the consumer stops.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any, Scope | None]] = []
        self._order = itertools.count()  # ties in due time: first held, first requeued

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, message: Any, delay: float, scope: Scope | None = None) -> None:
        """Hold ``message`` for ``delay`` seconds; an event held back for an earlier one
        of its key gives its ``scope``, which :meth:`release` requeues at once."""
        entry = (time.monotonic() + delay, next(self._order), message, scope)
        heapq.heappush(self._heap, entry)

    def release(self, scope: Scope) -> None:
        """Requeue now the messages held back for ``scope``, in the order they came."""
        due = sorted(entry for entry in self._heap if entry[3] == scope)
        if not due:
            return
        self._heap = [entry for entry in self._heap if entry[3] != scope]
        heapq.heapify(self._heap)
        for entry in sorted(due, key=lambda entry: entry[1]):
            entry[2].requeue()

    def wait(self, longest: float) -> float:
        """Seconds to wait for a message before the next held one is due, at most ``longest``."""
        if not self._heap:
            return longest
        return min(longest, max(self._heap[0][0] - time.monotonic(), 0.001))

    def requeue_due(self) -> None:
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            heapq.heappop(self._heap)[2].requeue()

    def requeue_all(self) -> None:
        while self._heap:
            heapq.heappop(self._heap)[2].requeue()

    def forget(self) -> None:
        self._heap.clear()
