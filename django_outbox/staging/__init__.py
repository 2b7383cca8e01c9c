"""Staging: an event becomes an outbox row in the caller's transaction.

:mod:`.stage` holds :func:`stage`, :func:`stage_many`, :func:`publish_on_success` and
:func:`cancel`, the checks of what a caller passes, and the dedup keys. It may import
the row's life (:mod:`django_outbox.state`, :mod:`django_outbox.db`), the models, the
settings, the routes and the leaves; nothing that relays, consumes or operates.
"""

from .stage import RESERVED_HEADERS, cancel, publish_on_success, stage, stage_many

__all__ = ["RESERVED_HEADERS", "cancel", "publish_on_success", "stage", "stage_many"]
