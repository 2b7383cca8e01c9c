"""A griffe extension for the API reference (mkdocs.yml): the package's docstrings are
written with Sphinx roles (:func:`drain`, :class:`~django_outbox.testing.OutboxEvent`) and
``::`` before a literal block; Markdown knows neither. Each role becomes a code span (the
last dotted part when the target starts with ``~``, as Sphinx shows it), and ``::`` ending
a paragraph becomes ``:``, so the docstrings stay as they are in the code and render clean.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:func|class|meth|data|attr|mod|exc|obj):`(~?)([^`]+)`")
LITERAL_BLOCK = re.compile(r"(\S)::\n\n")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


def markdown(text: str) -> str:
    """The docstring ``text`` with Sphinx roles and ``::`` markers made Markdown."""
    return LITERAL_BLOCK.sub(r"\1:\n\n", ROLE.sub(_code, text))


class SphinxRoles(griffe.Extension):
    """Rewrites each docstring once griffe has loaded its object."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
