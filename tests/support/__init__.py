"""Helpers of the tests that use real processes, brokers and databases, one job per module:

- ``processes``: ``manage.py`` commands and Python snippets in subprocesses, signals, waiting;
- ``brokers``: the test brokers' URLs, messages read, put and taken raw, queues deleted;
- ``services``: scripts/services (outages), ``rabbitmqctl``, a Redis out of memory;
- ``celery_workers``: real Celery workers and confirming or priority queues;
- ``rows``: events staged, rows counted per state, the database clock's minute.

Every name is also importable from ``tests.support`` itself, as the tests have always
imported them; a new helper goes in the module of its job.
"""

from __future__ import annotations

from tests.support.brokers import (
    AMQP_URL,
    REDIS_URL,
    broker_connection,
    consume,
    delete_queue,
    delete_redis_keys,
    drain_raw,
    publish_as_kombu,
    publish_raw,
)
from tests.support.celery_workers import confirming_celery_queue, priority_queue, start_worker
from tests.support.processes import (
    REPO,
    database_url,
    manage,
    manage_command,
    never_migrated_env,
    relay_command,
    relay_env,
    run_python,
    run_relay,
    running,
    start_command,
    start_relay,
    stop,
    wait_until,
)
from tests.support.rows import (
    TASKS_REQUIRING_TRANSACTION,
    Producer,
    as_on_the_table,
    claimed_message,
    minute_with_time_left,
    row_retention,
    stage_events,
    status_counts,
    unique_destination,
)
from tests.support.services import (
    free_port,
    free_ports,
    queue_settled,
    rabbitmqctl,
    redis_maxmemory,
    redis_read_only,
    redis_unable_to_persist,
    refused_port,
    services,
    services_output,
    unreachable_broker_url,
)

__all__ = [
    "AMQP_URL",
    "REDIS_URL",
    "REPO",
    "TASKS_REQUIRING_TRANSACTION",
    "Producer",
    "as_on_the_table",
    "broker_connection",
    "claimed_message",
    "confirming_celery_queue",
    "consume",
    "database_url",
    "delete_queue",
    "delete_redis_keys",
    "drain_raw",
    "free_port",
    "free_ports",
    "manage",
    "manage_command",
    "minute_with_time_left",
    "never_migrated_env",
    "priority_queue",
    "publish_as_kombu",
    "publish_raw",
    "queue_settled",
    "rabbitmqctl",
    "redis_maxmemory",
    "redis_read_only",
    "redis_unable_to_persist",
    "refused_port",
    "relay_command",
    "relay_env",
    "row_retention",
    "run_python",
    "run_relay",
    "running",
    "services",
    "services_output",
    "stage_events",
    "start_command",
    "start_relay",
    "start_worker",
    "status_counts",
    "stop",
    "unique_destination",
    "unreachable_broker_url",
    "wait_until",
]
