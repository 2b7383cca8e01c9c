"""Publishing with RabbitMQ's publisher confirms, pipelined per batch (py-amqp).

The channel is put in confirm mode once; a batch is written without waiting, then
the broker's ``basic.ack``/``basic.nack`` frames (possibly ``multiple=True``) are
collected. A message counts as published only when its own delivery tag was acked; a
nack, a lost connection or the confirm timeout fail the messages still unconfirmed.
A message no queue received comes back first (``basic.return``: ``mandatory``) and
fails as unroutable. A ``connection.blocked`` (a resource alarm) stops the batch:
:class:`~.connection.BrokerStalled`, an outage.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import kombu

from ..conf import outbox_settings
from ..conf.routes import Route
from ..envelope import CONTENT_ENCODING, CONTENT_TYPE, ClaimedMessage
from .amqp_frames import PublishFrames
from .base import NACKED, Failure, Outcome, unroutable
from .connection import BrokerStalled
from .writers import Envelope, encode_frames, write_frames

#: The longest a batch waits for its confirms; shorter under a short lease, see
#: :func:`lease_confirm_timeout`.
CONFIRM_TIMEOUT = 30.0
#: Where :meth:`ConfirmedChannel.probe` sends its probe: the default exchange with a
#: routing key no queue has, so the broker drops the message and confirms it.
PROBE_ROUTING_KEY = "django_outbox.probe"
#: An outcome not known yet: not sent, or sent and not confirmed.
UNSETTLED: Any = object()


def lease_confirm_timeout() -> float:
    """Seconds a relay's batch waits for the confirms of one destination:
    :data:`CONFIRM_TIMEOUT`, but at most a third of ``LEASE_SECONDS``. The relay starts
    a destination only in the first half of a claim's lease, so its confirms are in
    (or given up) with a sixth of the lease left to record the outcomes before another
    relay may take the rows over."""
    return min(CONFIRM_TIMEOUT, outbox_settings.LEASE_SECONDS / 3)


def nacked_whole(outcomes: Sequence[Outcome]) -> bool:
    """Whether the broker nacked every message of a batch."""
    return bool(outcomes) and all(
        isinstance(outcome, Failure) and outcome.error == NACKED for outcome in outcomes
    )


class Confirms:
    """Delivery tags of one confirm-mode channel and the batch they belong to."""

    def __init__(self, channel: Any) -> None:
        channel.confirm_select()
        channel.events["basic_ack"].add(self._on_ack)
        channel.events["basic_nack"].add(self._on_nack)
        channel.events["basic_return"].add(self._on_return)
        self.last_tag = 0  # the broker numbers a channel's messages 1, 2, ...
        self.first_tag = 1  # no tag below this one is pending
        self.pending: dict[int, int] = {}  # delivery tag -> index in the batch
        self.ids: dict[int, str] = {}  # index -> message id
        self.returned: dict[str, str] = {}  # message id -> why the broker returned it
        self.outcomes: list[Outcome] = []

    def start(self, outcomes: list[Outcome]) -> None:
        self.first_tag = self.last_tag + 1
        self.pending.clear()
        self.ids.clear()
        self.returned.clear()
        self.outcomes = outcomes

    def sent(self, indices: Sequence[int], message_ids: Sequence[str]) -> None:
        """The messages at ``indices`` of the batch were (or are about to be) written, in
        this order: they take the channel's next delivery tags."""
        first = self.last_tag + 1
        self.last_tag += len(indices)
        self.pending.update(zip(range(first, self.last_tag + 1), indices, strict=True))
        self.ids.update(zip(indices, message_ids, strict=True))

    def _on_return(self, exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        self.returned[message.properties.get("message_id", "")] = unroutable(exchange, routing_key)

    def _on_ack(self, delivery_tag: int, multiple: bool) -> None:
        # A returned message is acked after its basic.return: it reached no queue.
        for index in self._settle(delivery_tag, multiple):
            error = self.returned.get(self.ids.get(index, ""))
            self.outcomes[index] = None if error is None else Failure(error, kind="unroutable")

    def _on_nack(self, delivery_tag: int, multiple: bool) -> None:
        for index in self._settle(delivery_tag, multiple):
            self.outcomes[index] = Failure(NACKED, kind="nacked")

    def _settle(self, delivery_tag: int, multiple: bool) -> list[int]:
        tags: range | list[int] = [delivery_tag]
        if multiple:  # every tag up to this one: walk only those not settled before
            tags = range(self.first_tag, delivery_tag + 1)
            self.first_tag = max(self.first_tag, delivery_tag + 1)
        return [self.pending.pop(tag) for tag in tags if tag in self.pending]


class ConfirmedChannel:
    """A py-amqp channel in confirm mode, on one connection: its delivery tags
    (:class:`Confirms`), its frame encoder, and whether the broker blocked the
    connection (``connection.blocked``, sent under a resource alarm once the
    connection publishes). Made once per connection; ``timeout`` is the longest a
    batch waits for its confirms."""

    def __init__(self, connection: kombu.Connection, channel: Any, timeout: float) -> None:
        self.confirms = Confirms(channel)
        self._connection, self._channel, self._timeout = connection, channel, timeout
        self._frames = PublishFrames(
            channel.channel_id, connection.connection.frame_max, CONTENT_TYPE, CONTENT_ENCODING
        )
        #: Why the broker blocked the connection; None while it is not.
        self.blocked: str | None = None
        connection.connection.on_blocked = self._on_blocked
        connection.connection.on_unblocked = self._on_unblocked

    def _on_blocked(self, reason: str) -> None:
        self.blocked = reason or "connection.blocked"

    def _on_unblocked(self) -> None:
        self.blocked = None

    def publish(
        self,
        route: Route,
        messages: Sequence[ClaimedMessage],
        outcomes: list[Outcome],
        envelope: Envelope,
    ) -> None:
        """Encode the batch in ``envelope`` (a message AMQP cannot carry fails alone,
        permanently), write it in a few socket writes, then collect its confirms."""
        confirms, connection = self.confirms, self._connection
        confirms.start(outcomes)
        # Hear a connection.blocked sent since the last batch's confirms came (py-amqp
        # reads what is there before each message it publishes): then send nothing.
        with contextlib.suppress(TimeoutError):
            connection.drain_events(timeout=0)
        if self.blocked is not None:
            raise self._blocked_error(len(messages))
        indices, ids, frames = encode_frames(self._frames, route, messages, outcomes, envelope)
        # The tags are registered first: the broker may confirm while the batch is written.
        confirms.sent(indices, ids)
        write_frames(connection, frames)
        self._await(len(messages), self._timeout)

    def probe(self, timeout: float) -> None:
        """Publish one empty message to no queue (:data:`PROBE_ROUTING_KEY`, not
        mandatory: dropped) and wait for its confirm, at most ``timeout`` seconds;
        :class:`BrokerStalled` when it does not come."""
        self.confirms.start([UNSETTLED])
        self.confirms.sent([0], [""])
        channel = self._channel
        channel.basic_publish(
            channel.prepare_message(b""), exchange="", routing_key=PROBE_ROUTING_KEY
        )
        self._await(1, timeout)

    def _blocked_error(self, total: int) -> BrokerStalled:
        unconfirmed = sum(outcome is UNSETTLED for outcome in self.confirms.outcomes)
        return BrokerStalled(
            f"the broker blocked publishing ({self.blocked}): "
            f"{unconfirmed} of {total} messages not confirmed"
        )

    def _await(self, total: int, timeout: float) -> None:
        """Collect the confirms of the ``total`` messages sent; :class:`BrokerStalled`
        when the broker blocks the connection or ``timeout`` passes first (the
        messages never sent, after a block, count among those unconfirmed)."""
        confirms, connection = self.confirms, self._connection
        deadline = time.monotonic() + timeout
        while confirms.pending:
            if self.blocked is not None:
                raise self._blocked_error(total)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BrokerStalled(
                    f"{len(confirms.pending)} of {total} messages were not confirmed "
                    f"by the broker within {timeout:g}s"
                )
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=remaining)
