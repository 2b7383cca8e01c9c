"""The chaos suite: producers, relays and a consumer under injected faults, then an audit.

    python -m chaos --profile ci|soak [--seed N] [--sabotage lease|inbox|parking|order]

See docs/chaos.md for what runs, what is injected and what the audit proves.
"""
