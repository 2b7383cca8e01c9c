from __future__ import annotations

import pytest
from django.db import transaction
from django.test import TestCase, TransactionTestCase, override_settings

from django_outbox import publish_on_success, stage, stage_many
from django_outbox.models import OutboxMessage, OutboxStatus
from django_outbox.testing import captured_events, drain


def _many(using="default"):
    with transaction.atomic(using=using):
        stage_many(
            [{"event_type": f"e.{n}", "payload": {"n": n}, "destination": "orders"} for n in range(3)],
            using=using,
        )


@publish_on_success("order.placed", destination="orders", payload=lambda r, *a: {"r": r})
def _place(r):
    return r


class Attack(TestCase):
    databases = {"default", "other"}

    def test_stage_many_and_publish_on_success(self):
        with captured_events() as events:
            _many()
            _place(7)
            with transaction.atomic():
                _place(8)
                with pytest.raises(ZeroDivisionError), transaction.atomic():
                    _place(9)
                    1 / 0
        assert [e.event_type for e in events] == ["e.0", "e.1", "e.2", "order.placed", "order.placed"]
        assert [e.payload for e in events][3:] == [{"r": 7}, {"r": 8}]
        assert [e.event_type for e in drain()] == ["e.0", "e.1", "e.2", "order.placed", "order.placed"]
        assert drain() == []

    def test_second_alias(self):
        with captured_events() as events:
            _many("other")
        assert len(events) == 3
        assert drain() == []
        assert len(drain("other")) == 3

    def test_poison(self):
        _many()
        with override_settings(OUTBOX={"DEFAULT_ROUTE": False}):
            out = drain()
            print(out, list(OutboxMessage.objects.values_list("status", "attempts", "last_error")))
            out2 = drain()
            print(out2, list(OutboxMessage.objects.values_list("status", "attempts")))

    def test_celery(self):
        with override_settings(OUTBOX={"ROUTES": {"orders": {"celery_task": "x.y"}}}):
            with captured_events() as events:
                _many()
            assert len(events) == 3
            assert [e.payload for e in drain()] == [{"n": 0}, {"n": 1}, {"n": 2}]


class AttackTx(TransactionTestCase):
    databases = {"default"}

    def test_tx(self):
        with captured_events() as events:
            _many()
            _place(1)
            with transaction.atomic():
                _place(2)
                with pytest.raises(ZeroDivisionError), transaction.atomic():
                    _place(3)
                    1 / 0
        assert [e.event_type for e in events] == ["e.0", "e.1", "e.2", "order.placed", "order.placed"]
        assert len(drain()) == 5
        assert drain() == []
        with transaction.atomic():
            _place(4)
            assert len(drain()) == 1
