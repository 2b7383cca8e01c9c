"""Guard tests: what the code defines, the docs must name."""

from __future__ import annotations

import re
from pathlib import Path

import django_outbox
from django_outbox.conf import CHECK_IDS, SETTINGS

DOCS = Path(__file__).resolve().parent.parent / "docs"


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
