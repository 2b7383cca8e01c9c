"""The example shop end to end: place orders, relay their events, read them off the broker."""

from __future__ import annotations

import argparse
import json
import random
import time
import uuid
from decimal import Decimal
from typing import Any

import kombu
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser

from django_outbox.conf import outbox_settings
from django_outbox.models import OutboxMessage
from example_project.shop.services import place_order


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {number}")
    return number


class Command(BaseCommand):
    help = (
        "Place orders through @publish_on_success, relay their order.placed events with "
        "run_outbox_relay --drain, then read them back from the broker's 'orders' queue."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--orders",
            type=positive_int,
            default=1000,
            help="orders to place (default: %(default)r)",
        )
        parser.add_argument(
            "--seed",
            type=int,
            default=7,
            help="seed for customers and totals (default: %(default)r)",
        )

    def handle(self, *args: Any, orders: int, seed: int, **options: Any) -> None:
        started = time.perf_counter()
        rng = random.Random(seed)
        for _ in range(orders):
            place_order(f"customer{rng.randrange(50)}", Decimal(rng.randrange(100, 100_000)) / 100)
        staged = OutboxMessage.objects.count()
        self.stdout.write(
            f"1. placed {orders} orders; {staged} order.placed events staged with them"
        )

        self.stdout.write("2. run_outbox_relay --drain")
        call_command("run_outbox_relay", "--drain", stdout=self.stdout)
        published = OutboxMessage.objects.published().count()

        received = self._read_queue("orders")
        expected = set(OutboxMessage.objects.values_list("event_id", flat=True))
        matched = sum(1 for event_id in received if event_id in expected)
        self.stdout.write(
            f"3. read {len(received)} messages from the 'orders' queue "
            f"({matched} match staged events, {len(received) - len(set(received))} duplicates)"
        )
        elapsed = time.perf_counter() - started
        self.stdout.write(
            f"summary: staged {staged}, published {published}, received {len(received)} "
            f"in {elapsed:.1f}s\n"
            "admin: python manage.py createsuperuser && python manage.py runserver, "
            "then open http://127.0.0.1:8000/admin/django_outbox/outboxmessage/"
        )

    def _read_queue(self, name: str) -> list[uuid.UUID]:
        event_ids = []
        with kombu.Connection(
            outbox_settings.broker_url, transport_options=outbox_settings.BROKER_TRANSPORT_OPTIONS
        ) as connection:
            queue = connection.SimpleQueue(name)
            try:
                while True:
                    try:
                        message = queue.get(block=False)
                    except queue.Empty:
                        break
                    json.loads(message.body)  # every body is JSON
                    event_ids.append(uuid.UUID(message.headers["event_id"]))
                    message.ack()
            finally:
                queue.close()
        return event_ids
