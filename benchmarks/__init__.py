"""The benchmark suite: the relay measured against the raw ceilings of the same machine.

Run it with ``python -m benchmarks --profile ci`` (a couple of minutes) or
``--profile full`` (by hand); see docs/benchmarks.md for what each figure means.
It is also a tiny Django app (the ``Order`` model of the staging scenarios).
"""
