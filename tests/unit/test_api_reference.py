"""The API reference (docs/api/, rendered by mkdocstrings from the docstrings) has a page
entry for every public name; the strict docs build (tests/integration/test_docs.py) fails
on an entry that names nothing."""

from __future__ import annotations

import importlib
import importlib.util
import re

import pytest

import django_outbox
from tests.support import REPO

DIRECTIVE = re.compile(r"^::: ([\w.]+)$", re.MULTILINE)


def targets() -> list[str]:
    """The dotted names of the ``::: name`` entries of docs/api/*.md."""
    pages = sorted((REPO / "docs" / "api").glob("*.md"))
    return [name for page in pages for name in DIRECTIVE.findall(page.read_text())]


def documented() -> set[str]:
    """The names the entries render: a module's public names, or an object's own."""
    names: set[str] = set()
    for target in targets():
        try:
            module = importlib.import_module(target)
        except ImportError:
            names.add(target.rsplit(".", 1)[1])
        else:
            names |= {name for name in vars(module) if not name.startswith("_")}
    return names


def test_every_public_name_of_the_package_has_an_entry():
    public = set(django_outbox.__all__) - {"__version__"}
    assert sorted(public - documented()) == []


def test_the_reference_covers_the_test_helpers_settings_models_relay_and_transports():
    expected = {
        "django_outbox.testing",
        "django_outbox.conf.from_env",
        "django_outbox.models.OutboxMessage",
        "django_outbox.models.InboxMessage",
        "django_outbox.signals",
        "django_outbox.exceptions",
        "django_outbox.relay.Relay",
        "django_outbox.transports.base.Transport",
    }
    assert sorted(expected - set(targets())) == []


def sphinx_roles():
    """docs/_ext/sphinx_roles.py, the griffe extension of the API reference (not a package)."""
    path = REPO / "docs" / "_ext" / "sphinx_roles.py"
    spec = importlib.util.spec_from_file_location("sphinx_roles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sphinx_roles_and_literal_block_markers_become_markdown():
    text = (
        "Reads :func:`sent` and :class:`~django_outbox.testing.OutboxEvent` "
        "(see :mod:`django_outbox.consumer`), like this::\n\n    memory.clear()\n"
    )
    assert sphinx_roles().markdown(text) == (
        "Reads `sent` and `OutboxEvent` (see `django_outbox.consumer`), like this:\n\n"
        "    memory.clear()\n"
    )


#: The dotted names of the contract (DESIGN section 8) and of the pages a user copies from
#: (docs/tasks.md, docs/health.md, docs/consuming.md, docs/testing.md): each keeps working
#: whatever module now holds it.
CONTRACT_NAMES = [
    "django_outbox.stage",
    "django_outbox.stage_many",
    "django_outbox.publish_on_success",
    "django_outbox.process_once",
    "django_outbox.cancel",
    "django_outbox.models.OutboxMessage.Status",
    "django_outbox.models.InboxMessage",
    "django_outbox.testing.captured_events",
    "django_outbox.testing.drain",
    "django_outbox.testing.run_tasks",
    "django_outbox.testing.OutboxEvent",
    "django_outbox.conf.from_env",
    "django_outbox.conf.outbox_settings",
    "django_outbox.pytest_plugin",
    "django_outbox.celery.InboxTask",
    "django_outbox.celery.run_django_task",
    "django_outbox.consumer.InboxConsumer",
    "django_outbox.relay.Relay",
    "django_outbox.inbox.process_once",
    "django_outbox.inbox.inbox_handler",
    "django_outbox.staging.stage",
    "django_outbox.views.health",
    "django_outbox.urls.urlpatterns",
    "django_outbox.healthcheck",
    "django_outbox.tracing.continue_trace",
    "django_outbox.envelope.ReceivedEvent",
    "django_outbox.transports.base.Transport",
]


def resolve(dotted: str) -> object:
    """The object ``dotted`` names: its longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ImportError(dotted)


def test_every_documented_import_path_imports():
    """Each name of the contract and each ``::: name`` of docs/api/ imports from the path
    the docs give (a move into a subpackage keeps it or moves the docs with it)."""
    for dotted in CONTRACT_NAMES + targets():
        if dotted == "django_outbox.healthcheck" and not importlib.util.find_spec("health_check"):
            continue  # needs django-health-check, an extra
        if dotted.startswith("django_outbox.tasks.") and not importlib.util.find_spec(
            "django.tasks"
        ):
            continue  # Django 6.0+; the next test shows the line Django 5.2 gets
        assert resolve(dotted) is not None, dotted


def test_the_tasks_backend_imports_from_its_documented_path_or_names_django_6():
    import django

    if django.VERSION >= (6,):
        assert resolve("django_outbox.tasks.OutboxTaskBackend").__name__ == "OutboxTaskBackend"
    else:
        with pytest.raises(ImportError, match=r"Django 6\.0 added"):
            resolve("django_outbox.tasks.OutboxTaskBackend")
