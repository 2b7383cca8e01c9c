"""A griffe extension for the API reference (mkdocs.yml): the package's docstrings are
written for Sphinx: roles (:func:`drain`, :class:`~django_outbox.testing.OutboxEvent`),
``::`` before a literal block, and ``#:`` comments above an attribute as its docstring;
Markdown and griffe know none of them. Each role becomes a code span (the last dotted part
when the target starts with ``~``, as Sphinx shows it), ``::`` ending a paragraph becomes
``:``, and the ``#:`` lines become the attribute's docstring, so the code stays as it is
and renders clean.
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


def comment_docstring(obj: griffe.Object) -> str | None:
    """The ``#:`` lines right above attribute ``obj``, without their markers, or None."""
    if not obj.lineno or obj.filepath not in obj.lines_collection:
        return None
    lines = obj.lines_collection[obj.filepath]
    comment: list[str] = []
    for line in reversed(lines[: obj.lineno - 1]):
        if not line.strip().startswith("#:"):
            break
        comment.insert(0, line.strip()[2:].strip())
    return "\n".join(comment) or None


class SphinxRoles(griffe.Extension):
    """Rewrites each docstring once griffe has loaded its object."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.is_attribute:
            text = comment_docstring(obj)
            if text is not None:
                obj.docstring = griffe.Docstring(text, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
