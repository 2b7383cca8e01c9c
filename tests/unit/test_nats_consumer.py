"""The NATS consumer's pure parts: the durable's name, the headers it hands on and what
it remembers of nak'd messages (the consumer itself runs on the real cluster:
tests/integration/test_nats_consumer.py)."""

from __future__ import annotations

import re
import time

from django_outbox.consumer.nats import Naks, durable_name, received_headers


def test_a_durable_is_named_after_its_consumer_and_never_shared():
    assert durable_name("billing-v2_x") == "billing-v2_x"
    spaced, dotted = durable_name("billing v2"), durable_name("billing.v2")
    assert re.fullmatch(r"billing_v2_[0-9a-f]{8}", spaced), spaced
    assert re.fullmatch(r"billing_v2_[0-9a-f]{8}", dotted), dotted
    assert spaced != dotted != durable_name("billing_v2") == "billing_v2"


def test_headers_lose_jetstreams_own_and_read_the_ordering_ones_as_the_relay_wrote_them():
    raw = {
        "Nats-Msg-Id": "x",
        "content-type": "application/cloudevents+json",
        "event_id": "e",
        "sequence": "7",
        "skipped": "true",
        "attempt": "2",
        "x-delivery-count": "99",  # a publisher's own: the server's count wins
    }
    assert received_headers(raw, 3) == {
        "event_id": "e",
        "sequence": 7,
        "skipped": True,
        "attempt": "2",
        "x-delivery-count": 2,
    }
    assert received_headers({"sequence": "seven"}, 1)["sequence"] == "seven"


class Settled:
    """A stand-in for a JetStream message (no server needed to count naks): what it was
    asked to do."""

    def __init__(self) -> None:
        self.naks: list[float | None] = []

    def requeue(self, delay: float | None = None) -> None:
        self.naks.append(delay)


def test_a_nakd_message_never_shortens_a_fetch_but_keeps_the_run_from_going_idle():
    """nats-server before 2.10.14 lost a redelivery that fell due as a pull request
    expired (#5305): a fetch timed to a nak's delay met that every few runs."""
    naks, failed, early = Naks(), Settled(), Settled()
    naks.hold(failed, 0.05)
    assert failed.naks == [0.05], "nak'd with its delay at once: the server redelivers it"
    assert naks.wait(1.0) == 1.0
    assert len(naks) == 1, "still to come back: an idle timeout must not end the run"
    naks.hold(early, 0.3, scope=("consumer", "key"))
    assert naks.wait(1.0) <= 0.3, "an early event held here is requeued by the run itself"
    assert len(naks) == 2
    time.sleep(0.06)
    naks.requeue_due()
    assert (len(naks), early.naks) == (1, [])
    naks.release(("consumer", "key"))
    assert (len(naks), early.naks) == (0, [None])


def test_forgetting_drops_the_nakd_and_the_held() -> None:
    naks = Naks()
    naks.hold(Settled(), 30)
    naks.hold(Settled(), 30, scope=("consumer", "key"))
    naks.forget()
    assert len(naks) == 0
