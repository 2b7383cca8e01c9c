"""The NATS consumer's pure parts: the durable's name and the headers it hands on
(the consumer itself runs on the real cluster: tests/integration/test_nats_consumer.py)."""

from __future__ import annotations

import re

from django_outbox.consumer.nats import durable_name, received_headers


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
