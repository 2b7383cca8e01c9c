"""Operating the outbox: what the commands, the admin and the probes are made of.

:mod:`.checks` (the system checks), :mod:`.cli` (the commands' options, signals and
consumer wiring, so the commands stay thin), :mod:`.reporting` (what the commands print
and their exit status), :mod:`.text` (one-line texts and durations), :mod:`.health`
(healthy or not), :mod:`.metrics` (Prometheus text) and :mod:`.charts` (the admin's
inline SVG charts). It may import every layer below it (the relay, the consumer, the
row's life, the transports, the settings); only the commands, the admin, the views and
the app import it.
"""
