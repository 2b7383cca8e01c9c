"""The state of an outbox row has one owner (django_outbox/state/store.py), and the
leaf modules stay leaves. Read from the source: no database, no import."""

from __future__ import annotations

import ast
import pathlib

import django_outbox

PACKAGE = pathlib.Path(django_outbox.__file__).parent


def _modules() -> dict[str, ast.Module]:
    return {
        str(path.relative_to(PACKAGE)): ast.parse(path.read_text())
        for path in PACKAGE.rglob("*.py")
        if "migrations" not in path.parts
    }


def _updating(modules: dict[str, ast.Module], fields: set[str]) -> set[str]:
    """The modules that call ``update()`` with any of ``fields``."""
    return {
        name
        for name, tree in modules.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "update"
        and fields & {k.arg for k in node.keywords}
    }


def test_only_the_store_and_the_vendor_sql_write_a_status():
    """``update(status=...)`` and ``update(lease_token=...)`` appear in state/store.py
    (and the claim in db/) only."""
    writers = _updating(_modules(), {"status", "lease_token", "locked_until"})
    assert writers == {"state/store.py", "db/__init__.py"}


def test_only_the_inbox_parks_and_unparks():
    """An ``InboxFailure``'s ``parked_at`` is written in inbox/records.py only: the
    consumer parks and the replay unparks through it."""
    assert _updating(_modules(), {"parked_at"}) == {"inbox/records.py"}


def _saving_a_status(modules: dict[str, ast.Module]) -> set[str]:
    """The modules that write a loaded row's ``status``: ``row.status = ...`` (alone or
    among other targets) or ``save(update_fields=[..., "status", ...])``."""
    found = set()
    for name, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for each in ast.walk(target):
                        if isinstance(each, ast.Attribute) and each.attr == "status":
                            found.add(name)
            elif isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg == "update_fields" and any(
                        isinstance(c, ast.Constant) and c.value == "status"
                        for c in ast.walk(keyword.value)
                    ):
                        found.add(name)
    return found


def test_only_the_task_runner_writes_a_task_results_status():
    """A ``TaskResultRecord`` is created READY by the backend (the field's default) and
    its ``status`` written after that by tasks/runner.py alone (docs/architecture.md);
    the outbox rows' status is written by UPDATEs, never on a loaded row."""
    assert _saving_a_status(_modules()) == {"tasks/runner.py"}


def test_a_status_written_on_a_loaded_row_is_found():
    modules = {
        name: ast.parse(text)
        for name, text in {
            "assigned.py": "row.status = 'x'",
            "among_others.py": "row.status, row.finished_at = 'x', now",
            "saved.py": "row.save(update_fields=['finished_at', 'status'])",
            "other_field.py": "row.statuses = 1\nrow.save(update_fields=['errors'])",
            "read.py": "status = row.status",
        }.items()
    }
    assert _saving_a_status(modules) == {"assigned.py", "among_others.py", "saved.py"}


def _package_imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or "django_outbox" in node.module):
            found.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("django_outbox")}
    return found


def test_the_models_and_the_expressions_import_nothing_of_the_package():
    """Anything may import them without a cycle (db and store import the models)."""
    modules = _modules()
    assert _package_imports(modules["models.py"]) == set()
    assert _package_imports(modules["db/expressions.py"]) == set()


def test_only_the_store_takes_the_write_lock_before_it_reads():
    """A transaction that counts or checks rows, then changes their state, is the
    store's (``db.write_first``: SQLite's write lock first; and the portable claim's, in
    db/); the admin's actions call ``store.change_counted`` instead of opening one of
    their own."""
    callers = {
        name
        for name, tree in _modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and "write_first" in {getattr(node.func, "attr", None), getattr(node.func, "id", None)}
    }
    assert callers == {"state/store.py", "db/__init__.py"}
