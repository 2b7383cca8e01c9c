"""Guard tests: what the code defines, the docs must name; and the docs must build."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import BaseCommand, get_commands, load_command_class

import django_outbox
from django_outbox.conf import CHECK_IDS, SETTINGS
from tests import hostile

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PACKAGE = REPO / "django_outbox"


def test_every_setting_is_in_the_settings_reference():
    text = (DOCS / "reference" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", text, re.MULTILINE))
    assert documented == set(SETTINGS)


def test_every_check_id_is_in_the_checks_reference():
    text = (DOCS / "reference" / "checks.md").read_text()
    documented = set(re.findall(r"`(django_outbox\.[EW]\d{3})`", text))
    assert documented == {*CHECK_IDS.values(), "django_outbox.W001"}


def test_every_public_name_is_documented_somewhere():
    text = "\n".join(path.read_text() for path in DOCS.rglob("*.md"))
    missing = [name for name in django_outbox.__all__ if name != "__version__" and name not in text]
    assert missing == []


@pytest.mark.slow  # mkdocs, not Django: one run (Django 5.2) says it
def test_the_docs_build_without_warnings(tmp_path):
    """mkdocs.yml sets strict mode and turns broken links, unknown anchors and pages
    missing from the nav into warnings, so this fails on any of them."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output
    assert (tmp_path / "runbook" / "index.html").exists()


# -- hostile input and misconfiguration ------------------------------------------------

HOSTILE_ROW = re.compile(r"^\| `([a-z0-9-]+)` \| .+ \| `(.+)` \|$", re.MULTILINE)


def hostile_page() -> dict[str, str]:
    """The rows of docs/hostile-input.md: case name -> the line the user gets."""
    text = (DOCS / "hostile-input.md").read_text()
    rows = HOSTILE_ROW.findall(text)
    page = {name: line.replace("\\|", "|") for name, line in rows}
    assert len(page) == len(rows), "a case name appears twice on docs/hostile-input.md"
    return page


def documented_line(line: str) -> re.Pattern[str]:
    """The page's line as a pattern: each ``…`` stands for any text."""
    return re.compile(".*?".join(map(re.escape, line.split("…"))), re.DOTALL)


def test_every_hostile_case_has_a_row_and_every_row_a_case():
    assert sorted(hostile.load()) == sorted(hostile_page())


@pytest.mark.django_db(transaction=True, databases=["default", "other"])
@pytest.mark.parametrize("name", sorted(hostile_page()))
def test_the_hostile_input_page_says_what_the_code_does(name, request):
    """Each row's trigger provokes the failure for real; its line must match the page."""
    line = hostile.load()[name](request)
    assert "\n" not in line.strip(), f"{name}: not one line: {line!r}"
    assert documented_line(hostile_page()[name]).fullmatch(line), (name, line)


# -- log actions ------------------------------------------------------------------------

ACTION = re.compile(r"""["']action["']\s*:\s*(f?)["']([^"']+)["']""")


def emitted_actions() -> tuple[set[str], list[re.Pattern[str]]]:
    """Every ``extra={"action": ...}`` in the package: literal strings, and f-strings
    as patterns in which each ``{...}`` stands for a lowercase word."""
    literal: set[str] = set()
    patterns: list[re.Pattern[str]] = []
    for path in PACKAGE.rglob("*.py"):
        for is_f, value in ACTION.findall(path.read_text()):
            if is_f and "{" in value:
                parts = re.split(r"\{[^}]*\}", value)
                patterns.append(re.compile("[a-z_]+".join(map(re.escape, parts))))
            else:
                literal.add(value)
    return literal, patterns


def runbook_actions() -> set[str]:
    text = (DOCS / "runbook.md").read_text()
    return set(re.findall(r"^\| `((?:outbox|inbox|tasks)\.[a-z_]+)` \|", text, re.MULTILINE))


def test_every_logged_action_is_in_the_runbook():
    literal, patterns = emitted_actions()
    documented = runbook_actions()
    assert len(literal) > 10  # the scan found the package's log calls
    assert sorted(literal - documented) == []
    for pattern in patterns:
        assert any(pattern.fullmatch(action) for action in documented), pattern.pattern


def test_the_runbook_documents_no_action_the_code_does_not_log():
    literal, patterns = emitted_actions()
    stale = [
        action
        for action in runbook_actions()
        if action not in literal and not any(p.fullmatch(action) for p in patterns)
    ]
    assert stale == []


# -- management commands ----------------------------------------------------------------

OUR_COMMANDS = sorted(name for name, app in get_commands().items() if app == "django_outbox")


def options_of(command: BaseCommand, name: str) -> set[str]:
    parser = command.create_parser("manage.py", name)
    return {s for action in parser._actions for s in action.option_strings if s.startswith("--")}


def commands_doc_section(name: str) -> str:
    text = (DOCS / "commands.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    matching = [s for s in sections if s.startswith(f"`{name}`")]
    assert len(matching) == 1, f"docs/commands.md has no section '## `{name}`'"
    return matching[0]


def test_the_package_has_the_commands_the_docs_describe():
    assert OUR_COMMANDS == [
        "outbox_cleanup",
        "outbox_health",
        "outbox_inbox_start",
        "outbox_partition",
        "outbox_replay_parked",
        "outbox_requeue",
        "outbox_skip",
        "outbox_status",
        "run_outbox_consumer",
        "run_outbox_relay",
    ]


@pytest.mark.parametrize("name", OUR_COMMANDS)
def test_every_command_option_is_in_the_commands_reference(name):
    """The options table of each command names exactly the options its parser has,
    Django's standard options aside."""
    standard = options_of(BaseCommand(), name)
    own = options_of(load_command_class("django_outbox", name), name) - standard
    section = commands_doc_section(name)
    documented = set(re.findall(r"^\| `(--[a-z-]+)", section, re.MULTILINE))
    assert documented == own
