"""The passwords of the project's configuration, for redaction: those of the broker URLs,
of the transport options and of the databases, and the signing keys.

They are read once and kept until the settings change (:meth:`Passwords.reset`, called
by :meth:`~django_outbox.conf.OutboxSettings.reload`): redaction runs for every log
record of the relay and the consumer.
"""

from __future__ import annotations

from collections.abc import Mapping

from django.conf import settings

from ..signing import MIN_KEY_BYTES
from .catalog import raw
from .redact import option_secrets, scrub, url_passwords

#: Celery's settings that hold URLs with passwords.
CELERY_URLS = ("CELERY_BROKER_URL", "CELERY_RESULT_BACKEND")
#: Celery's transport options, which may hold a password (``sentinel_kwargs`` ...).
CELERY_OPTIONS = "CELERY_BROKER_TRANSPORT_OPTIONS"


class Passwords:
    """The secrets of the configuration, read on first use after a reset."""

    def __init__(self) -> None:
        self._found: list[str] | None = None

    def reset(self) -> None:
        self._found = None

    def get(self) -> list[str]:
        found = self._found
        if found is None:
            found = self._found = _read()
        return found

    def redact(self, text: str) -> str:
        """``text`` without any URL's password or any password of the configuration."""
        return scrub(text, self.get())


def _read() -> list[str]:
    urls = [raw("BROKER_URL"), *(getattr(settings, name, None) for name in CELERY_URLS)]
    options = [raw("BROKER_TRANSPORT_OPTIONS"), getattr(settings, CELERY_OPTIONS, None)]
    table = raw("BROKERS")
    for spec in table.values() if isinstance(table, Mapping) else ():
        if isinstance(spec, Mapping):
            urls.append(spec.get("URL"))
            options.append(spec.get("OPTIONS"))
    found = [secret for url in urls if isinstance(url, str) for secret in url_passwords(url)]
    found += option_secrets(options)
    keys = raw("SIGNING_KEYS")
    for key in keys if isinstance(keys, list | tuple) else ():
        if isinstance(key, str) and len(key) >= MIN_KEY_BYTES:
            found.append(key)
    for database in settings.DATABASES.values():
        password = database.get("PASSWORD")
        if isinstance(password, str) and password:
            found.append(password)
    return found


#: The one reader (:meth:`~django_outbox.conf.OutboxSettings.secrets` hands out its list).
passwords = Passwords()
