"""What the outbox commands share; it lives in the library (:mod:`django_outbox.cli`)
so that each command stays a thin layer: parse, call, print. The argparse types
(``positive_int`` and friends) are there too."""

from django_outbox.cli import (
    add_consumer_options,
    add_database_option,
    add_relay_options,
    add_replay_options,
    consumer_from_options,
    finish,
    library_errors,
    require_tables,
    stop_on_signals,
)

__all__ = [
    "add_consumer_options",
    "add_database_option",
    "add_relay_options",
    "add_replay_options",
    "consumer_from_options",
    "finish",
    "library_errors",
    "require_tables",
    "stop_on_signals",
]
