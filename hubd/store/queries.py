"""Named SQL statements, loaded once from the package's ``sql/*.sql`` files.

A file holds blocks that start with a header line ``-- name: <statement>``; the comment lines
right below it say what the statement does. Statements are referenced by name, so a typo fails
at import, not at the first call in production.
"""

from __future__ import annotations

import re
from importlib import resources
from types import MappingProxyType
from typing import Final

__all__ = ["Queries", "load_queries"]

_HEADER: Final = re.compile(r"^--\s*name:\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


class Queries:
    """The statements of one ``.sql`` file, looked up by attribute or by ``[name]``."""

    def __init__(self, source: str, statements: dict[str, str]) -> None:
        self._source = source
        self._statements = MappingProxyType(statements)

    def __getitem__(self, name: str) -> str:
        try:
            return self._statements[name]
        except KeyError:
            raise KeyError(f"{self._source} has no statement named {name!r}") from None

    def __getattr__(self, name: str) -> str:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(str(exc)) from None

    def names(self) -> frozenset[str]:
        return frozenset(self._statements)


def parse_queries(source: str, text: str) -> Queries:
    """Split ``text`` into named statements; duplicate or empty blocks are errors."""
    statements: dict[str, str] = {}
    matches = list(_HEADER.finditer(text))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        name = match.group(1)
        if name in statements:
            raise ValueError(f"{source}: statement {name!r} is defined twice")
        if not _strip_comments(body):
            raise ValueError(f"{source}: statement {name!r} is empty")
        statements[name] = body
    return Queries(source, statements)


def load_queries(filename: str) -> Queries:
    """Load ``hubd/store/sql/<filename>``."""
    text = resources.files("hubd.store").joinpath("sql", filename).read_text(encoding="utf-8")
    return parse_queries(filename, text)


def _strip_comments(body: str) -> str:
    return "\n".join(
        line for line in body.splitlines() if line.strip() and not line.strip().startswith("--")
    )
