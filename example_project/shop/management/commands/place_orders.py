"""Place a batch of orders, each in its own transaction, each staging an ``order.placed`` event."""

from __future__ import annotations

import argparse
import random
import time
from decimal import Decimal

from django.core.management.base import BaseCommand

from django_outbox.models import OutboxMessage
from example_project.shop.services import place_order


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {number}")
    return number


class Command(BaseCommand):
    help = "Place orders through @publish_on_success so every order stages its event."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
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
            help="random seed for customers and totals (default: %(default)r)",
        )

    def handle(self, *args: object, orders: int, seed: int, **options: object) -> None:
        rng = random.Random(seed)
        before = OutboxMessage.objects.count()
        started = time.perf_counter()
        for _ in range(orders):
            place_order(f"customer{rng.randrange(50)}", Decimal(rng.randrange(100, 100_000)) / 100)
        elapsed = time.perf_counter() - started
        staged = OutboxMessage.objects.count() - before
        self.stdout.write(
            f"placed {orders} orders in {elapsed:.2f}s ({orders / elapsed:.0f}/s); "
            f"staged {staged} order.placed events "
            f"({OutboxMessage.objects.pending().count()} pending in the outbox)"
        )
