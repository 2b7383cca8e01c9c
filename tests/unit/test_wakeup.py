"""WakeUp: an idle relay waits for the first of a NOTIFY, the poll interval, or stop.
A fake clock, a fake stop event and a fake listener; no services, no sleeps."""

from __future__ import annotations

import logging

import pytest

from django_outbox.relay.wakeup import WAIT_SLICE, WakeUp


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stop:
    """A stop event whose waits pass on the fake clock; set after ``set_after`` waits."""

    def __init__(self, clock: Clock, set_after: int | None = None) -> None:
        self.clock, self.set_after, self.waits = clock, set_after, []
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.clock.now += timeout
        if self.set_after is not None and len(self.waits) >= self.set_after:
            self._set = True
        return self._set


class Listener:
    """Answers each wait from ``script``: True (a NOTIFY), False (timed out), or an
    exception (the LISTEN connection broke)."""

    def __init__(self, clock: Clock, script: list[bool | Exception]) -> None:
        self.clock, self.script, self.waits, self.closed = clock, script, [], False

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if not answer:
            self.clock.now += timeout
        return answer

    def close(self) -> None:
        self.closed = True


def wakeup(clock: Clock, stop: Stop, listener: Listener | None, poll: float = 2.0) -> WakeUp:
    return WakeUp(stop, lambda: listener, poll, clock=clock)  # type: ignore[arg-type]


def test_a_notify_ends_the_wait():
    clock = Clock()
    listener = Listener(clock, [False, True])
    waiting = wakeup(clock, Stop(clock), listener)
    waiting.listen()
    assert waiting.wait() is True
    assert listener.waits == [WAIT_SLICE, WAIT_SLICE]
    assert clock.now == WAIT_SLICE


def test_without_a_notify_the_wait_lasts_the_poll_interval_in_slices():
    clock = Clock()
    listener = Listener(clock, [False] * 10)
    waiting = wakeup(clock, Stop(clock), listener, poll=1.2)
    waiting.listen()
    assert waiting.wait() is False
    assert listener.waits == pytest.approx([0.5, 0.5, 0.2])
    assert clock.now == pytest.approx(1.2)


@pytest.mark.parametrize(("notified", "waited"), [(True, 0.0), (False, 0.05)])
def test_a_wait_of_its_own_timeout_says_whether_it_was_woken(notified, waited):
    """The relay's short wait after a batch that caught up (CAUGHT_UP_WAIT): one slice
    of that timeout, not of the 30 s poll interval."""
    clock = Clock()
    listener = Listener(clock, [notified])
    waiting = wakeup(clock, Stop(clock), listener, poll=30.0)
    waiting.listen()
    assert waiting.wait(0.05) is notified
    assert listener.waits == [0.05]
    assert clock.now == pytest.approx(waited)


def test_heard_says_a_notify_came_on_the_open_listener():
    """The relay rests after a batch that caught up only once NOTIFYs are known to reach
    it: a LISTEN that works proves nothing (the trigger dropped, a transaction pooler)."""
    clock = Clock()
    listener = Listener(clock, [False, False, True])  # two slices of the poll, then a NOTIFY
    waiting = wakeup(clock, Stop(clock), listener, poll=1.0)
    waiting.listen()
    waiting.wait()  # the poll interval, unheard
    assert waiting.heard is False
    waiting.wait()
    assert waiting.heard is True
    waiting.close()  # a new listener has heard nothing yet
    assert waiting.heard is False


def test_without_a_listener_the_wait_is_on_the_stop_event():
    clock = Clock()
    stop = Stop(clock)
    waiting = wakeup(clock, stop, None, poll=3.0)
    waiting.listen()  # the database cannot notify: it polls
    waiting.wait()
    assert stop.waits == [3.0]


def test_stop_ends_the_wait():
    clock = Clock()
    stop = Stop(clock, set_after=1)
    waiting = wakeup(clock, stop, None, poll=30.0)
    stop.wait(0.1)  # set
    waiting.wait()
    assert stop.waits == [0.1]  # no wait at all once stop is set


def test_a_lost_listen_connection_is_logged_closed_and_the_wait_polls_on(caplog):
    clock = Clock()
    stop = Stop(clock)
    listener = Listener(clock, [OSError("server closed the connection")])
    waiting = wakeup(clock, stop, listener, poll=2.0)
    waiting.listen()
    with caplog.at_level(logging.WARNING, logger="django_outbox.wakeup"):
        waiting.wait()
    (record,) = caplog.records
    assert record.action == "outbox.listen_lost"
    assert record.getMessage() == (
        "LISTEN connection lost (server closed the connection); polling every 2.0s"
    )
    assert listener.closed and waiting.listener is None
    assert stop.waits == [2.0]  # the rest of the interval, polling
    assert clock.now == 2.0


def test_listen_opens_a_listener_only_when_there_is_none():
    clock = Clock()
    opened: list[Listener] = []

    def listen() -> Listener:
        opened.append(Listener(clock, []))
        return opened[-1]

    waiting = WakeUp(Stop(clock), listen, 1.0, clock=clock)  # type: ignore[arg-type]
    waiting.listen()
    waiting.listen()
    assert len(opened) == 1
    waiting.close()
    assert opened[0].closed and waiting.listener is None
    waiting.listen()
    assert len(opened) == 2
