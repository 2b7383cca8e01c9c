"""RetentionThread: cleanup on a thread of its own, stopped and joined with the relay.
The cleanup is a plain function (the real one is tested against PostgreSQL in
tests/integration/test_retention_thread.py); events, no sleeps."""

from __future__ import annotations

import logging
import threading

from django.db import DatabaseError
from django.test import override_settings

from django_outbox.relay.retention import RetentionThread


def test_it_cleans_up_on_its_own_thread_until_stopped():
    passes: list[tuple[str, str]] = []
    two_passes = threading.Event()

    def cleanup(using: str) -> None:
        passes.append((using, threading.current_thread().name))
        if len(passes) == 2:
            two_passes.set()

    thread = RetentionThread("other", interval=0.001, cleanup=cleanup)
    thread.start()
    assert two_passes.wait(30)
    thread.stop()
    assert not thread.is_alive()
    assert set(passes) == {("other", "outbox-retention-other")}


def test_a_database_error_is_logged_and_the_next_pass_tries_again(caplog):
    calls: list[int] = []
    retried = threading.Event()

    def cleanup(using: str) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise DatabaseError("canceling statement due to lock timeout")
        retried.set()

    thread = RetentionThread("default", interval=0.001, cleanup=cleanup)
    with caplog.at_level(logging.WARNING, logger="django_outbox.retention"):
        thread.start()
        assert retried.wait(30)
        thread.stop()
    (record,) = [r for r in caplog.records if getattr(r, "action", "") == "outbox.cleanup_failed"]
    assert record.using == "default"
    assert "lock timeout" in caplog.text  # the traceback is attached


def test_stopped_before_its_first_pass_it_never_cleans_up():
    ran: list[str] = []
    thread = RetentionThread("default", interval=300, first_in=300, cleanup=ran.append)
    thread.start()
    thread.stop()
    assert not thread.is_alive()
    assert ran == []


def test_a_password_in_a_database_error_never_reaches_the_log(caplog):
    # A driver's error text may quote the configuration (here the password of a broker
    # of OUTBOX["BROKERS"]); the retention thread logs it with its traceback.
    failed = threading.Event()

    def cleanup(using: str) -> None:
        failed.set()
        raise DatabaseError("could not connect to sqla+postgresql://u:s3cret-pw@db/outbox")

    outbox = {"BROKERS": {"default": {"URL": "sqla+postgresql://u:s3cret-pw@db/outbox"}}}
    with override_settings(OUTBOX=outbox), caplog.at_level(logging.WARNING):
        thread = RetentionThread("default", interval=300, cleanup=cleanup)
        thread.start()
        assert failed.wait(30)
        thread.stop()
    assert "outbox.cleanup_failed" in [getattr(r, "action", "") for r in caplog.records]
    assert "could not connect to sqla+postgresql://u:***@db/outbox" in caplog.text
    assert "s3cret-pw" not in caplog.text
