"""The example end to end: place orders, relay their events, bill them once through the inbox."""

from __future__ import annotations

import random
import time
from decimal import Decimal
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandParser
from django.db.models.functions import Now

from django_outbox.consumer import ConsumerStats, InboxConsumer
from django_outbox.models import OutboxMessage
from django_outbox.ops.cli import positive_int
from example_project.billing.handlers import invoice_order
from example_project.billing.models import Invoice
from example_project.shop.services import place_order

#: Seconds without a message after which a demo consumer run ends.
IDLE_TIMEOUT = 1.0


class Command(BaseCommand):
    help = (
        "Place orders through @publish_on_success, relay their order.placed events with "
        "run_outbox_relay --drain, invoice each order once with an inbox consumer, then "
        "publish a tenth of the events again to show the inbox skipping them."
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
        self.stdout.write(f"1. placed {orders} orders; {staged} order.placed events staged")

        self.stdout.write("2. run_outbox_relay --drain")
        call_command("run_outbox_relay", "--drain", stdout=self.stdout)
        published = OutboxMessage.objects.published().count()

        self.stdout.write(
            "3. run_outbox_consumer --queue orders "
            "--handler example_project.billing.handlers.invoice_order"
        )
        first = self._consume()

        again = max(orders // 10, 1)
        self.stdout.write(
            f"4. a relay that crashed before marking its batch publishes {again} events again"
        )
        redo = OutboxMessage.objects.order_by("-id").values_list("id", flat=True)[:again]
        OutboxMessage.objects.filter(id__in=list(redo)).update(
            status=OutboxMessage.Status.PENDING, available_at=Now(), published_at=None
        )
        call_command("run_outbox_relay", "--drain", stdout=self.stdout)
        second = self._consume()

        invoices = Invoice.objects.count()
        invoiced_orders = Invoice.objects.values("order_id").distinct().count()
        duplicates = first.duplicates + second.duplicates
        elapsed = time.perf_counter() - started
        self.stdout.write(
            f"summary: staged {staged}, published {published}, consumed {invoices} "
            f"(invoices for {invoiced_orders} distinct orders), duplicates skipped {duplicates}, "
            f"in {elapsed:.1f}s\n"
            "admin: python manage.py createsuperuser && python manage.py runserver, "
            "then open http://127.0.0.1:8000/admin/django_outbox/"
        )

    def _consume(self) -> ConsumerStats:
        consumer = InboxConsumer("orders", invoice_order.__wrapped__, invoice_order.inbox_consumer)
        stats = consumer.run(idle_timeout=IDLE_TIMEOUT)
        self.stdout.write(f"   {stats.summary()}")
        return stats
