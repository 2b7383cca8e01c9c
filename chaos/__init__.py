"""The chaos suite: producers, relays and a consumer under injected faults, then an audit.

    python -m chaos --profile ci|soak [--seed N] [--sabotage KIND]

See docs/chaos.md for what runs, what is injected and what the audit proves.
"""
