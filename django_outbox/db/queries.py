"""Named queries: the vendor SQL of ``queries.sql``, loaded by name.

Each section of ``queries.sql`` starts with a ``-- name: NAME`` line; the
comment lines that follow describe it. Placeholders in braces are filled in by
:func:`sql`: identifiers (table names) quoted as identifiers, literals (status
values, the NOTIFY channel) quoted as SQL strings, fragments (SQL built from
other named queries) as they are. Values never reach the SQL any other way: the
rest travels as driver parameters (``%s``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from importlib import resources

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


class UnknownQuery(LookupError):
    """No section of ``queries.sql`` has this name, or a placeholder has no value."""


def parse(text: str) -> dict[str, str]:
    """The named queries of ``text``: each section's SQL, its comment lines left out."""
    queries: dict[str, str] = {}
    parts = _NAME.split(text)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        queries[name] = "\n".join(lines).strip()
    return queries


@functools.cache
def _queries() -> dict[str, str]:
    return parse(resources.files(__package__).joinpath("queries.sql").read_text("utf-8"))


def quote_identifier(name: str) -> str:
    """``name`` as a PostgreSQL/SQLite identifier (double quotes, doubled inside)."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """``value`` as an SQL string literal (single quotes, doubled inside)."""
    return "'" + value.replace("'", "''") + "'"


def sql(
    name: str,
    *,
    identifiers: Mapping[str, str] | None = None,
    literals: Mapping[str, str | Sequence[str]] | None = None,
    fragments: Mapping[str, str] | None = None,
) -> str:
    """The query ``name`` with its placeholders filled in.

    A literal given as a sequence becomes a comma-separated list (for ``IN``).
    Raises :class:`UnknownQuery` naming the query, or the placeholder left
    without a value.
    """
    try:
        template = _queries()[name]
    except KeyError:
        raise UnknownQuery(f"no query named {name!r} in django_outbox/db/queries.sql") from None
    values: dict[str, str] = {**(fragments or {})}
    values.update({key: quote_identifier(v) for key, v in (identifiers or {}).items()})
    for key, value in (literals or {}).items():
        items = [value] if isinstance(value, str) else list(value)
        values[key] = ", ".join(quote_literal(item) for item in items)

    def fill(match: re.Match[str]) -> str:
        try:
            return values[match.group(1)]
        except KeyError:
            raise UnknownQuery(f"query {name!r} needs a value for {{{match.group(1)}}}") from None

    return _PLACEHOLDER.sub(fill, template)
