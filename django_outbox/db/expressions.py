"""Database-clock expressions shared by the models, the store and retention.

A leaf module: it imports only Django, so every part of the package may use it
without an import cycle.
"""

from __future__ import annotations

import datetime as dt

from django.db import models
from django.db.models.functions import Now


def now_plus(seconds: float) -> models.Expression:
    """The database clock plus ``seconds`` (negative: before now), for ``update()``
    and filters."""
    return models.ExpressionWrapper(
        Now() + models.Value(dt.timedelta(seconds=seconds), output_field=models.DurationField()),
        output_field=models.DateTimeField(),
    )


def now_minus(period: dt.timedelta) -> models.Expression:
    """The database clock ``period`` ago: the cut-off of a retention period."""
    return now_plus(-period.total_seconds())
