"""No password in what the checks say (issue 11): the masking helpers and the system checks
on malformed broker URLs. No services: the URLs are parsed, never connected to (the tests
that reach the real brokers are in tests/integration/test_secrets.py)."""

from __future__ import annotations

import pytest
from django.test import override_settings

from django_outbox.conf import outbox_settings
from django_outbox.conf.redact import mask_url, scrub, url_passwords, url_problem
from tests.integration.test_secrets import (
    AMQP_PORT,
    MALFORMED,
    MARKER,
    PASSWORD,
    WRONG_PASSWORD,
    assert_hidden,
    outbox_errors,
)


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (MALFORMED, f"amqp://guest:***@127.0.0.1:{AMQP_PORT}//"),
        (WRONG_PASSWORD, f"amqp://guest:***@127.0.0.1:{AMQP_PORT}//"),
        (f"redis://:{MARKER}@localhost:6379/0", "redis://:***@localhost:6379/0"),
        (f"amqp://guest:{MARKER}", "amqp://guest:***"),  # no host: the password is the "port"
        (f"amqp://guest:{MARKER}/more@", "amqp://guest:***@"),
        (f"amqp//guest:{MARKER}@host", "***@host"),  # no "://": nothing before the "@" shown
        (f"amqp://u:{MARKER};x@h//", "amqp://u:***;***@h//"),  # kombu's failover separator
        (f"amqp://u:p@h:1/v?ssl=1&password={MARKER}", "amqp://u:***@h:1/v?ssl=1&password=***"),
        ("memory://", "memory://"),
        ("filesystem:///var/spool/outbox", "filesystem:///var/spool/outbox"),
        ("amqp://guest@[::1]:5672//", "amqp://guest@[::1]:5672//"),
    ],
)
def test_mask_url_never_shows_a_password(url, masked):
    assert mask_url(url) == masked


@pytest.mark.parametrize(
    "url",
    [
        MALFORMED,
        f"amqp://guest:{MARKER}#1@host//",  # "#" ends the host part: port "zebra..."
        f"amqp://guest:{MARKER}?1@host//",
        f"amqp://guest:{MARKER}/1@host//",
        f"amqp://guest:{MARKER}@1@host//",
        f"amqp://guest:1234#{MARKER}@host//",  # urllib would read host "guest", port 1234
        f"amqp://guest:{MARKER}",
        f"amqp://guest:{MARKER}[@host//",
    ],
)
def test_a_malformed_url_is_named_without_quoting_it(url):
    problem = url_problem(url)
    assert problem is not None
    assert_hidden(problem, mask_url(url))


def test_scrub_masks_urls_known_secrets_and_the_pieces_a_parser_quotes():
    text = (
        f"ValueError: Port could not be cast to integer value as '{MARKER}' "
        f"while connecting to {MALFORMED} (password {PASSWORD})"
    )
    scrubbed = scrub(text, url_passwords(MALFORMED))
    assert_hidden(scrubbed)
    assert scrubbed.startswith("ValueError: Port could not be cast to integer value as '***'")


@pytest.mark.parametrize(
    ("password", "words"),
    [
        ("correct horse battery staple", ["horse", "battery", "staple"]),
        ('wombat\'s"quoted"secret', ["quoted", "secret"]),
    ],
)
def test_redact_hides_a_configured_password_that_ends_a_url_in_the_text(password, words):
    """A password with a space or a quote passes the check (URL parsers take it), but
    ends a URL in a text: the URL was masked up to there, and the rest of the password
    stayed in the text."""
    url = f"amqp://guest:{password}@127.0.0.1:{AMQP_PORT}//"
    with override_settings(OUTBOX={"BROKER_URL": url}):
        assert outbox_errors() == []
        redacted = outbox_settings.redact(f"cannot connect to {url}: refused")
    assert not [word for word in words if word in redacted], redacted


@pytest.mark.filterwarnings("ignore:Overriding setting DATABASES")
def test_redact_knows_the_database_passwords(settings):
    databases = {**settings.DATABASES, "extra": {**settings.DATABASES["default"]}}
    databases["extra"]["PASSWORD"] = PASSWORD
    with override_settings(DATABASES=databases):
        assert_hidden(outbox_settings.redact(f"FATAL: no login with {PASSWORD} or {MARKER}"))


def test_check_reports_an_unquoted_password_masked_instead_of_crashing():
    (error,) = outbox_errors(OUTBOX={"BROKER_URL": MALFORMED})
    assert error.id == "django_outbox.E010"
    assert error.msg == (
        f"The broker URL amqp://guest:***@127.0.0.1:{AMQP_PORT}// is malformed: its user name "
        'or password holds an unquoted "@", "/", "?" or "#".'
    )
    assert "Percent-encode" in error.hint
    assert_hidden(error.msg, error.hint)


def test_check_never_echoes_a_broker_url_without_a_scheme():
    (error,) = outbox_errors(OUTBOX={}, CELERY_BROKER_URL=f"amqp//guest:{PASSWORD}@host")
    assert (error.id, error.msg) == (
        "django_outbox.E010",
        "The broker URL ***@host is malformed: it is not of the form "
        "transport://user:password@host:port/vhost.",
    )


def test_a_broker_url_of_the_wrong_type_is_shown_masked():
    (error,) = outbox_errors(OUTBOX={"BROKER_URL": [MALFORMED, WRONG_PASSWORD]})
    assert error.msg == (
        'OUTBOX["BROKER_URL"] must be a non-empty string or None; got '
        f"['amqp://guest:***@127.0.0.1:{AMQP_PORT}//', 'amqp://guest:***@127.0.0.1:{AMQP_PORT}//']."
    )


def test_a_percent_encoded_password_passes_the_check():
    assert outbox_errors(OUTBOX={"BROKER_URL": WRONG_PASSWORD}) == []


class Unprintable(Exception):
    def __str__(self) -> str:  # a library's bug
        raise RuntimeError("no str for you")


def test_an_exception_that_cannot_be_printed_is_described_and_logged():
    """describe() and the logs' SecretFilter write it as Python's tracebacks do, instead
    of raising out of the code reporting it (logging does not guard a filter)."""
    import logging

    from django_outbox.conf.redact import SecretFilter, describe

    assert describe(Unprintable()) == "Unprintable: <exception str() failed>"
    assert describe(ValueError("bad name")) == "ValueError: bad name"
    records = [
        logging.LogRecord("t", logging.ERROR, __file__, 1, msg, args, None)
        for msg, args in [
            ("failed: %s: %s", ("Unprintable", Unprintable())),
            ("%(error)s", ({"error": Unprintable()},)),
            ("%d of %s", ("many", "pages")),  # a wrong format
        ]
    ]
    for record in records:
        assert SecretFilter(outbox_settings.redact).filter(record)
    assert [record.getMessage() for record in records] == [
        "failed: Unprintable: <exception str() failed>",
        "<exception str() failed>",
        "%d of %s ('many', 'pages')",
    ]
