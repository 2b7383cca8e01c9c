"""The Django admin for the outbox and the inbox: read-mostly, fast on big tables.

Events are facts: no admin adds or edits a row. The one change an operator
makes is to an outbox row's fate, through the ``requeue`` and ``abandon``
actions, and for the blocked head of an ordered key "requeue head" and "skip
head" (listed above the rows with their buttons); all delegate to
:mod:`django_outbox.state.store` and need the ``django_outbox.requeue_outboxmessage``
permission (not just view or change). Delete is left to superusers only:
deleting a PENDING row loses a committed event without a trace, which is what
the outbox exists to prevent; retention deletes finished rows and ``abandon``
stops a row from being sent. A superuser can still delete one row from its page
(to purge a payload that must not be kept, say); the bulk ``delete_selected``
action is removed, because its confirmation page would list every selected row.

Pages stay fast with millions of rows: every statement reads through an index or
a bound (tests/integration/test_admin_plans.py proves it by the plans of every
page on 200,000 rows): no full ``COUNT(*)`` (see
:func:`django_outbox.db.count_rows`), filter choices and value filters read from
the recent window (:func:`~.window.recent`), sorting only by id (the one index that
serves every filter), ids and ordering keys searched by exact match on their
indexes, and no action on more than ``ACTION_ROW_LIMIT`` rows.

What lives where (Django's autodiscovery imports this package, which imports each
admin module, and each registers its admin):

- :mod:`.window`: the recent window (``RECENT_ROWS``) and the filters that read it;
- :mod:`.base`: what every admin shares (``ReadOnlyAdmin``, its paginator and search,
  ``DeliveryAdmin``'s error and header columns, the JSON and badge helpers);
- :mod:`.outbox`: the outbox changelist, its columns and filters, a row's page;
- :mod:`.actions`: the outbox's actions (``ACTION_ROW_LIMIT``);
- :mod:`.summary`: the figures above the outbox's list: state counts, blocked keys,
  charts;
- :mod:`.inbox`, :mod:`.task_results`, :mod:`.heartbeats`: the inbox marks and
  failures, the Django tasks' results, the relays and consumers.

It may import anything of the package below Django's entry points (the models, the
store, the status reads, the samples and heartbeats, the charts, the settings);
nothing of the package imports it. Its modules import each other downwards only, in
the order of the list above (``outbox`` imports ``actions`` and ``summary``).
"""

from .actions import ACTION_ROW_LIMIT
from .base import (
    ERROR_EXCERPT_CHARS,
    DeliveryAdmin,
    EstimatingPaginator,
    ReadOnlyAdmin,
    pretty_json,
)
from .heartbeats import WORKER_STATE_COLOURS, WorkerHeartbeatAdmin
from .inbox import InboxFailureAdmin, InboxMessageAdmin
from .outbox import OutboxMessageAdmin, StatusFilter
from .summary import STATUS_COLOURS
from .task_results import TaskResultAdmin
from .window import (
    RECENT_ROWS,
    InRecentWindow,
    RecentChoicesFilter,
    RecentValuesFilter,
    distinct_leading,
    recent,
)

__all__ = [
    "ACTION_ROW_LIMIT",
    "ERROR_EXCERPT_CHARS",
    "RECENT_ROWS",
    "STATUS_COLOURS",
    "WORKER_STATE_COLOURS",
    "DeliveryAdmin",
    "EstimatingPaginator",
    "InRecentWindow",
    "InboxFailureAdmin",
    "InboxMessageAdmin",
    "OutboxMessageAdmin",
    "ReadOnlyAdmin",
    "RecentChoicesFilter",
    "RecentValuesFilter",
    "StatusFilter",
    "TaskResultAdmin",
    "WorkerHeartbeatAdmin",
    "distinct_leading",
    "pretty_json",
    "recent",
]
