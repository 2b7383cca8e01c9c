"""The API reference (docs/api/, rendered by mkdocstrings from the docstrings) has a page
entry for every public name; the strict docs build (tests/integration/test_docs.py) fails
on an entry that names nothing."""

from __future__ import annotations

import importlib
import importlib.util
import re

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
