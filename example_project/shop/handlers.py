"""A consumer of the shop's ``order.placed`` events, for the quickstart.

Run it with::

    python manage.py run_outbox_consumer --queue orders \
        --handler example_project.shop.handlers.acknowledge_order

``@inbox_handler`` gives the consumer its inbox name, so ``--consumer`` is not needed.
"""

from __future__ import annotations

from django_outbox import ReceivedEvent, inbox_handler


@inbox_handler("shop-mailer")
def acknowledge_order(event: ReceivedEvent) -> None:
    """Runs once per event, in the same transaction as the inbox mark."""
    order = event.payload
    summary = f"order {order['order_id']} for {order['customer']}, {order['total']}"
    print(f"{event.event_type}: {summary}")
