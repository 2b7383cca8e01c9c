"""The suite's destinations, shared by the runner, its processes and their settings.

Both publish with the routing key ``QUEUE`` to the one queue the consumer reads (and the
tap beside it): ``QUEUE`` itself (``chaos.orders``: keyless, the default route) and
``ORDERED`` (an ordered route whose events carry one of ``ORDERED_KEYS`` keys).
"""

from __future__ import annotations

QUEUE = "chaos.orders"
ORDERED = "chaos.accounts"
ORDERED_KEYS = 20
#: Keyless, on a quorum queue of the three-node RabbitMQ cluster (broker alias ``cluster``):
#: what the cluster node faults (chaos.cluster) are aimed at.
CLUSTERED = "chaos.cluster"
