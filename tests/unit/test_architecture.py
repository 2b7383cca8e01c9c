"""The import contract ([tool.importlinter] in pyproject.toml, run by ``lint-imports`` in the
lint step) fails when an arrow of docs/architecture.md is broken.

The package and the configuration are copied twice into temporary directories: one copy
untouched, one with a forbidden import added for each contract. The real ``lint-imports``
runs once in each (a subprocess of about half a second); the repository is never touched.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(
    not LINT_IMPORTS.exists(),
    reason="lint-imports is not installed: pip install -e '.[dev]' (the import-linter package)",
)


#: (module, the import added to it, the contract it breaks, the line lint-imports prints)
BREAKS = [
    (
        "transports/base.py",
        "from django_outbox import relay",
        "Transports import neither the relay, the admin, the commands nor the test helpers",
        "django_outbox.transports.base -> django_outbox.relay",
    ),
    (
        "conf/settings.py",
        "from django_outbox import models",
        "Settings (conf) import nothing of the package but exceptions and signing",
        "django_outbox.conf.settings -> django_outbox.models",
    ),
    (
        "db/__init__.py",
        "from django_outbox.state import status",
        "Layers: Django's entry points > views > testing, ops > relay, consumer > tasks > "
        "workers, inbox, staging > state > db, transports > models > conf > leaves",
        "django_outbox.db is not allowed to import django_outbox.state",
    ),
    (
        "consumer/handling.py",
        "from django_outbox.transports import kombu",
        "The consumer imports the broker connection and declarations, not the transport classes",
        "django_outbox.consumer.handling -> django_outbox.transports.kombu",
    ),
    (  # the relay imports the row's life: the state importing the relay closes a cycle
        "state/retry.py",
        "from django_outbox import relay",
        "No import cycles in django_outbox",
        ".retry",
    ),
]


def copy_package(into: Path) -> Path:
    """A copy of django_outbox and of pyproject.toml, where lint-imports finds them."""
    shutil.copytree(
        REPO / "django_outbox",
        into / "django_outbox",
        ignore=shutil.ignore_patterns("__pycache__", "templates"),
    )
    shutil.copy(REPO / "pyproject.toml", into / "pyproject.toml")
    return into


def lint_imports(copy: Path) -> tuple[int, str]:
    """lint-imports in the copy: its exit status and its output, the tool's wrapping of
    long contract names undone."""
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.returncode, " ".join((result.stdout + result.stderr).split())


@pytest.fixture(scope="module")
def untouched(tmp_path_factory) -> str:
    return lint_imports(copy_package(tmp_path_factory.mktemp("untouched")))[1]


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> tuple[int, str]:
    copy = copy_package(tmp_path_factory.mktemp("broken"))
    for module, line, _, _ in BREAKS:
        path = copy / "django_outbox" / module
        path.write_text(f"{path.read_text()}\n{line}  # added by tests/unit/test_architecture.py\n")
    return lint_imports(copy)


def test_the_untouched_package_keeps_the_transports_and_conf_contracts(untouched):
    # (acyclic and layers are kept once engineer "store" has removed models -> db.)
    for _, _, contract, _ in [*BREAKS[:2], BREAKS[3]]:
        assert f"{contract} KEPT" in untouched, untouched


@pytest.mark.parametrize(
    ("contract", "printed"),
    [case[2:] for case in BREAKS],
    ids=[
        "transport-imports-relay",
        "conf-imports-models",
        "db-imports-status",
        "consumer-imports-a-transport-class",
        "cycle",
    ],
)
def test_a_forbidden_import_breaks_its_contract_and_is_named(broken, untouched, contract, printed):
    status, output = broken
    assert status == 1
    assert f"{contract} BROKEN" in output, output
    assert printed in output and printed not in untouched, output


#: The house rule (STYLE.md): no function of the package is longer.
MAX_FUNCTION_LINES = 50


def long_definitions(root: Path, kinds: tuple[type, ...], most: int) -> list[str]:
    """``file:line name (n lines)`` for each definition of ``kinds`` (ast node types)
    under ``root`` (migrations aside) longer than ``most`` lines, its decorators left
    out, its docstring in."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, kinds) and node.end_lineno - node.lineno + 1 > most:
                lines = node.end_lineno - node.lineno + 1
                found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines})")
    return found


def long_functions(root: Path) -> list[str]:
    """The functions under ``root`` longer than :data:`MAX_FUNCTION_LINES`."""
    import ast

    return long_definitions(root, (ast.FunctionDef, ast.AsyncFunctionDef), MAX_FUNCTION_LINES)


def test_no_function_of_the_package_is_over_fifty_lines():
    assert long_functions(REPO / "django_outbox") == []


#: The most Python modules the package's top level holds (issue 40): the rest live in
#: subpackages grouped by what they are for.
MAX_TOP_LEVEL_MODULES = 15
PACKAGE = REPO / "django_outbox"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def test_the_top_level_holds_at_most_fifteen_modules():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_every_subpackage_says_what_lives_there_and_what_it_may_import():
    import ast

    for init in sorted(PACKAGE.glob("*/__init__.py")):
        if init.parent.name in {"migrations", "management"}:
            continue
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "may import" in docstring, f"{init.relative_to(REPO)}: {docstring[:80]!r}"


def _section(title: str) -> str:
    return ARCHITECTURE.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def floor_plan() -> dict[str, str]:
    """docs/architecture.md's floor plan: each name of a row's first cell -> the row."""
    rows = {}
    for line in _section("The floor plan").splitlines():
        if line.startswith("| `"):
            first, rest = line[2:].split(" | ", 1)
            rows.update(dict.fromkeys(re.findall(r"`([^`]+)`", first), rest))
    return rows


def unnamed_modules(rows: dict[str, str]) -> list[str]:
    """The package's modules the floor plan names nowhere: a top-level module in a row's
    first cell, a subpackage's module in its subpackage's row (``__init__.py`` aside)."""
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] in {"migrations", "management"} or parts[-1] == "__init__.py" != parts[0]:
            continue
        if len(parts) == 1:
            named = parts[0] in rows
        else:
            named = f"`{parts[-1]}`" in rows.get("/".join(parts[:-1]) + "/", "")
        if not named:
            missing.append("/".join(parts))
    return missing


def test_docs_architecture_names_every_module_of_the_package():
    assert unnamed_modules(floor_plan()) == []


def test_a_module_missing_from_docs_architecture_is_named():
    rows = floor_plan()
    rows["relay/"] = rows["relay/"].replace("`pipeline.py`", "")
    del rows["signing.py"]
    assert unnamed_modules(rows) == ["relay/pipeline.py", "signing.py"]


def contract_layers() -> list[str]:
    """The layers of the import contract, optional names' parentheses dropped."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(contract for contract in contracts if contract["id"] == "layers")["layers"]
    return [re.sub(r"[()]", "", layer) for layer in layers]


def drawn_layers() -> list[str]:
    """The rows of docs/architecture.md's layer diagram, top first, without their notes."""
    block = _section("The layers").split("```text\n", 1)[1].split("```", 1)[0]
    names = (re.split(r"\s{3,}", line.strip(), maxsplit=1)[0] for line in block.splitlines())
    return [name for name in names if name not in {"", "│", "▼"}]


def test_the_layer_diagram_is_the_import_contracts_layers():
    assert drawn_layers() == contract_layers()


#: The house rule (STYLE.md): a command parses its options and calls the library.
MAX_COMMAND_LINES = 60


def long_commands(commands: Path) -> list[str]:
    """``name (n lines)`` for each module of ``commands`` longer than :data:`MAX_COMMAND_LINES`."""
    found = []
    for path in sorted(commands.glob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MAX_COMMAND_LINES:
            found.append(f"{path.name} ({lines})")
    return found


def test_no_command_is_over_sixty_lines():
    assert long_commands(REPO / "django_outbox" / "management" / "commands") == []


def test_the_command_length_rule_finds_a_long_command(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_COMMAND_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_COMMAND_LINES + 1))
    assert long_commands(tmp_path) == [f"long.py ({MAX_COMMAND_LINES + 1})"]


def names_imported_from(package: str, roots: list[Path]) -> set[str]:
    """The names every ``from <package> import name`` (or the relative form, inside
    django_outbox) under ``roots`` takes, outside the package itself."""
    import ast

    names = set()
    for root in roots:
        for path in root.rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            if module.startswith(f"{package}."):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ImportFrom):
                    continue
                base = node.module or ""
                if node.level:  # relative: resolved against the importing module's package
                    parent = module.rsplit(".", node.level)[0]
                    base = f"{parent}.{base}" if base else parent
                if base == package:
                    names |= {alias.name for alias in node.names}
    return names


def test_every_name_imported_from_conf_is_exported_by_the_package():
    import django_outbox.conf

    parts = ("django_outbox", "tests", "chaos", "benchmarks", "example_project")
    imported = names_imported_from("django_outbox.conf", [REPO / part for part in parts])
    assert imported and sorted(imported - set(django_outbox.conf.__all__)) == []
    assert all(hasattr(django_outbox.conf, name) for name in django_outbox.conf.__all__)


#: The house rule (issue 40): a class does one job; past this many lines it does several.
MAX_CLASS_LINES = 300


def long_classes(root: Path) -> list[str]:
    """The classes under ``root`` longer than :data:`MAX_CLASS_LINES`."""
    import ast

    return long_definitions(root, (ast.ClassDef,), MAX_CLASS_LINES)


def test_no_class_of_the_package_is_over_three_hundred_lines():
    assert long_classes(REPO / "django_outbox") == []


@pytest.mark.parametrize(
    ("find", "short", "long", "most"),
    [
        (long_functions, "def short():\n    pass", "def long():", MAX_FUNCTION_LINES),
        (long_classes, "class Short:\n    x = 1", "class Long:", MAX_CLASS_LINES),
    ],
    ids=["function", "class"],
)
def test_a_length_rule_finds_a_long_definition(tmp_path, find, short, long, most):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "".join(f"    x{n} = {n}\n" for n in range(most))
    (package / "long.py").write_text(f"{short}\n\n\n{long}\n{body}")
    name = long.split()[1].rstrip(":").rstrip("()")
    assert find(package) == [f"pkg/long.py:5 {name} ({most + 1})"]
