"""The row's life: every change of an outbox row's state, and the reading of it.

:mod:`.store` owns each state change of an outbox row (claim, mark published, failed,
abandoned, requeue, skip, delete), :mod:`.retry` says when a failed row is due again,
and :mod:`.status` reads the counts, ages and blocked keys behind ``outbox_status``,
the admin, the metrics and the health check. It may import the models, the database
layer (:mod:`django_outbox.db`, where the vendor SQL lives), the settings and the
leaves; nothing above it.
"""
