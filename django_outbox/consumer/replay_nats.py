"""Replaying parked messages to the NATS JetStream subjects they came from (their
``queue``), on the NATS broker of the route that publishes each subject, with a
``Nats-Msg-Id`` of their own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..conf.brokers import nats_servers
from ..conf.redact import mask_url
from ..envelope import CONTENT_ENCODING
from ..exceptions import BrokerUnreachable, OutboxError
from ..transports.nats import (
    MSG_ID,
    EventLoop,
    close_client,
    cluster_errors,
    connect_options,
    header_text,
)
from .replay import replay_headers, unpark_replayed

if TYPE_CHECKING:
    from ..models import InboxFailure


def replay(url: str, options: dict[str, Any], parked: list[InboxFailure], timeout: float) -> None:
    """Publish each of ``parked`` (parked by consumers of the NATS broker ``url``) to its
    subject again, its PubAck awaited within ``timeout``, then unpark it. Its
    ``Nats-Msg-Id`` is its event id and the time it was parked: the stream does not drop
    it as a duplicate of the message first delivered (within the duplicate window), yet
    drops a second replay of the same parking, cut short before its unpark.
    :class:`BrokerUnreachable` when the cluster cannot be reached or does not answer."""
    from nats.aio.client import Client

    loop, client = EventLoop(), Client()
    try:
        options = connect_options("django_outbox replay", options)
        loop.run(client.connect(nats_servers(url), **options), timeout)
        js = client.jetstream(timeout=timeout)
        for failure in parked:
            loop.run(js.publish(failure.queue, **_message(failure)), timeout + 1)
            unpark_replayed(failure)
    except cluster_errors() as exc:
        raise BrokerUnreachable(
            f"cannot reach the NATS broker {mask_url(url)}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        close_client(loop, client)


def _message(failure: InboxFailure) -> dict[str, Any]:
    """The payload and headers that replay ``failure`` to NATS; :class:`OutboxError` for a
    header NATS cannot carry (a message that came from elsewhere: the relay's travel)."""
    assert failure.parked_at is not None  # parked() only
    try:
        headers = {
            name: header_text(name, value)
            for name, value in replay_headers(failure.headers).items()
            if value is not None
        }
    except ValueError as exc:
        raise OutboxError(
            f"parked event {failure.event_id} cannot be replayed to NATS: {exc} (the events "
            "before it were replayed)"
        ) from None
    headers[MSG_ID] = f"{failure.event_id}:replay:{failure.parked_at.isoformat()}"
    return {"payload": failure.body.encode(CONTENT_ENCODING), "headers": headers}
