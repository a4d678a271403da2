"""Named SQL statements with named parameters, loaded once from the package's ``sql/*.sql`` files.

A file holds the statements on one table (``connections.sql``: ``hubd_sidecar_connections``) or
for one use (``counts.sql``, ``embedded.sql``), and says which in its head. A table with many
statements has one file per family, each named for its family and naming the others in its
head: ``allocations.sql`` (requests, releases, reads), ``claims.sql`` (claims and leases),
``transitions.sql`` (a claim's fenced transitions) and ``sweeps.sql`` (deadlines, repair,
orphans), all on ``hubd_allocations``.

A file holds blocks that start with a header line ``-- name: <statement>``; the comment lines
right below it say what the statement does. Parameters are written ``:name`` and translated once,
at load time, to asyncpg's ``$n`` (a name used twice is one ``$n``). Casts (``::text``) and
anything inside comments, string literals, quoted identifiers and dollar quotes are left alone; a
positional ``$n`` in a file is an error, so every parameter has a name.

A block headed ``-- fragment: <name>`` is no statement but text that the statements of the same
file take in where they say ``{name}``: what several statements repeat word for word (the
fence of a claim's transitions, the head of their ledger insert) is written once. It is put in
at load time, before translation, as written (its own comment lines left out), so a statement
reads to PostgreSQL exactly as if it were spelled out there.

A statement is called with keyword arguments and returns a :class:`Bound` query; a missing or
unknown name raises :class:`TypeError` before anything reaches the database. ``tests/test_queries``
holds every file to this: each statement a store references exists and each block is used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import Final

import attrs

__all__ = ["Bound", "Queries", "Statement", "load_queries", "parse_queries", "translate"]

_HEADER: Final = re.compile(r"^--\s*(name|fragment):\s*([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)

# One pass over the text: what must be skipped whole comes first, so a ``:name`` inside it is
# never seen; ``::`` is consumed as one token, so a cast never reads as a parameter.
_TOKEN: Final = re.compile(
    r"""
      (?P<skip>
          --[^\n]*
        | /\*.*?\*/
        | (?<![A-Za-z0-9_])[Ee]'(?:[^'\\]|\\.|'')*'
        | '(?:[^']|'')*'
        | "(?:[^"]|"")*"
        | (?P<tag>\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$).*?(?P=tag)
        | ::
      )
    | :(?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | \{(?P<fragment>[a-z_][a-z0-9_]*)\}
    | (?P<positional>\$\d+)
    | (?P<open>/\*|['"]|\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$)
    """,
    re.VERBOSE | re.DOTALL,
)


@attrs.frozen
class Bound:
    """A statement with its arguments in ``$n`` order, ready for asyncpg."""

    statement: Statement
    args: tuple[object, ...]

    @property
    def sql(self) -> str:
        return self.statement.sql


@attrs.frozen
class Statement:
    """One named block: the translated SQL and its parameter names in ``$n`` order."""

    source: str
    name: str
    sql: str = attrs.field(repr=False)
    params: tuple[str, ...]

    def __call__(self, /, **values: object) -> Bound:
        missing = [name for name in self.params if name not in values]
        unknown = sorted(set(values).difference(self.params))
        if missing or unknown:
            problems = []
            if missing:
                problems.append(f"missing parameter(s) {', '.join(missing)}")
            if unknown:
                problems.append(f"unknown parameter(s) {', '.join(unknown)}")
            raise TypeError(f"{self.source}: {self.name}: {'; '.join(problems)}")
        return Bound(self, tuple(values[name] for name in self.params))


def translate(sql: str, *, where: str = "statement") -> tuple[str, tuple[str, ...]]:
    """``sql`` with each ``:name`` replaced by ``$n``, and the names in ``$n`` order."""
    params: list[str] = []

    def replace(match: re.Match[str]) -> str:
        if match.group("skip") is not None:
            return match.group(0)
        if match.group("positional") is not None:
            raise ValueError(f"{where}: positional {match.group(0)}; name the parameter")
        if match.group("open") is not None:
            raise ValueError(f"{where}: unterminated {match.group(0)!r}")
        if match.group("fragment") is not None:
            raise ValueError(f"{where}: no fragment {match.group(0)} in this file")
        name = match.group("name")
        if name not in params:
            params.append(name)
        return f"${params.index(name) + 1}"

    return _TOKEN.sub(replace, sql), tuple(params)


class Queries:
    """The statements of one ``.sql`` file, looked up by attribute or by ``[name]``."""

    def __init__(self, source: str, statements: Mapping[str, Statement]) -> None:
        self._source = source
        self._statements = MappingProxyType(dict(statements))

    def __getitem__(self, name: str) -> Statement:
        try:
            return self._statements[name]
        except KeyError:
            raise KeyError(f"{self._source} has no statement named {name!r}") from None

    def __getattr__(self, name: str) -> Statement:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError as exc:
            raise AttributeError(str(exc)) from None

    @property
    def source(self) -> str:
        return self._source

    def names(self) -> frozenset[str]:
        return frozenset(self._statements)


def parse_queries(source: str, text: str) -> Queries:
    """Split ``text`` into named statements, each with the fragments it names put in;
    duplicate or empty blocks are errors."""
    bodies: dict[str, str] = {}
    fragments: dict[str, str] = {}
    matches = list(_HEADER.finditer(text))
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        kind, name = match.group(1), match.group(2)
        if name in bodies or name in fragments:
            raise ValueError(f"{source}: {kind} {name!r} is defined twice")
        if not _strip_comments(body):
            raise ValueError(f"{source}: {kind} {name!r} is empty")
        if kind == "fragment":
            fragments[name] = _strip_leading_comments(body)
        else:
            bodies[name] = body
    statements = {}
    for name, body in bodies.items():
        where = f"{source}: {name}"
        sql, params = translate(_compose(body, fragments), where=where)
        statements[name] = Statement(source, name, sql, params)
    return Queries(source, statements)


def _compose(body: str, fragments: Mapping[str, str]) -> str:
    """``body`` with each ``{name}`` of ``fragments`` replaced by its text (one level: a
    fragment that names another is left for :func:`translate` to refuse)."""

    def replace(match: re.Match[str]) -> str:
        name = match.group("fragment")
        return fragments.get(name, match.group(0)) if name is not None else match.group(0)

    return _TOKEN.sub(replace, body)


def load_queries(filename: str) -> Queries:
    """Load ``hubd/store/sql/<filename>``."""
    text = resources.files("hubd.store").joinpath("sql", filename).read_text(encoding="utf-8")
    return parse_queries(filename, text)


def _strip_leading_comments(body: str) -> str:
    lines = body.splitlines()
    while lines and lines[0].lstrip().startswith("--"):
        lines.pop(0)
    return "\n".join(lines).strip()


def _strip_comments(body: str) -> str:
    return "\n".join(
        line for line in body.splitlines() if line.strip() and not line.strip().startswith("--")
    )
