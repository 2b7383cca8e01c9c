"""How an idle relay waits: for the first of a wake-up (PostgreSQL ``NOTIFY`` on
commit of staged rows), the poll interval, or its stop event."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ..conf import outbox_settings
from ..conf.redact import SecretFilter

logger = logging.getLogger("django_outbox.wakeup")
logger.addFilter(SecretFilter(outbox_settings.redact))  # the driver's error texts

#: How long one slice of a wait on the listener lasts, so a stop request is seen promptly.
WAIT_SLICE = 0.5


class Listener(Protocol):
    """What :class:`WakeUp` needs of a LISTEN connection (``db.postgresql.Listener``)."""

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True when woken by a NOTIFY."""
        ...

    def close(self) -> None:
        """Close the LISTEN connection."""
        ...


class WakeUp:
    """The wait of an idle relay.

    ``listen`` opens a listener (None where the database cannot notify: then the
    relay only polls). When the LISTEN connection breaks, the wait logs it
    (``outbox.listen_lost``) and polls until the next :meth:`listen` opens a new one.
    ``heard`` says whether a NOTIFY came on the open listener: a LISTEN that works is
    no proof that notifications arrive (the trigger dropped, a transaction pooler).
    """

    def __init__(
        self,
        stop: threading.Event,
        listen: Callable[[], Listener | None],
        poll_interval: float,
        *,
        using: str = "default",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stop = stop
        self.poll_interval = poll_interval
        self.using = using
        self.listener: Listener | None = None
        self.heard = False
        self._listen = listen
        self._clock = clock

    def listen(self) -> None:
        """Open the listener if there is none (before a claim, so that rows staged
        while the claim runs wake the next wait). A database error is raised."""
        if self.listener is None:
            self.listener, self.heard = self._listen(), False

    def wait(self, timeout: float | None = None) -> bool:
        """Return True on a wake-up; False after ``timeout`` seconds (default: the poll
        interval) or once stop is set."""
        deadline = self._clock() + (self.poll_interval if timeout is None else timeout)
        while not self.stop.is_set() and (remaining := deadline - self._clock()) > 0:
            if self.listener is None:
                self.stop.wait(remaining)
            elif self._woken(min(remaining, WAIT_SLICE)):
                self.heard = True
                return True
        return False

    def close(self) -> None:
        """Close the listener, if any (after a database outage, and when the relay stops)."""
        listener, self.listener, self.heard = self.listener, None, False
        if listener is not None:
            try:
                listener.close()
            except Exception:  # already broken
                logger.debug("closing a broken LISTEN connection failed", exc_info=True)

    def _woken(self, timeout: float) -> bool:
        assert self.listener is not None
        try:
            return self.listener.wait(timeout)
        except Exception as exc:  # the LISTEN connection broke: poll until the next listen()
            logger.warning(
                "LISTEN connection lost (%s); polling every %ss",
                exc,
                self.poll_interval,
                extra={"action": "outbox.listen_lost", "using": self.using},
            )
            self.close()
            return False
