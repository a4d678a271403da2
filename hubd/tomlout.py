"""Writing TOML: enough of it for ``hubd check-config`` to print the effective configuration.

Tables, arrays of tables, and inline values (strings, numbers, booleans, dates, lists, inline
tables) inside them; ``tomllib.loads(render_toml(d)) == d`` for such documents.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["render_toml"]


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES: Final = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def render_toml(document: Mapping[str, Any]) -> str:
    """Write a document as TOML: tables, arrays of tables, and inline values inside them.

    Handles what :meth:`Config.to_display_dict` produces, including arbitrary provisioner options
    (strings, integers, floats, booleans, dates/times, arrays and nested tables);
    ``tomllib.loads(render_toml(d)) == d`` for such documents.
    """
    lines: list[str] = []
    _render_table(lines, [], document, None)
    return "\n".join(lines).lstrip("\n") + "\n"


def _render_table(
    lines: list[str], path: list[str], table: Mapping[str, Any], header: str | None
) -> None:
    if header is not None:
        lines.extend(["", header])
    nested: list[tuple[str, Any]] = []
    for key, value in table.items():
        if isinstance(value, Mapping) or _is_table_array(value):
            nested.append((key, value))
        else:
            lines.append(f"{_render_key(key)} = {_render_value(value)}")
    # TOML puts a table's own keys before its sub-tables; a key written after a [header] would
    # belong to that sub-table.
    for key, value in nested:
        sub = [*path, _render_key(key)]
        dotted = ".".join(sub)
        if isinstance(value, Mapping):
            _render_table(lines, sub, value, f"[{dotted}]")
        else:
            for item in value:
                _render_table(lines, sub, item, f"[[{dotted}]]")


def _is_table_array(value: object) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(item, Mapping) for item in value)
    )


def _render_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _render_string(key)


def _render_string(text: str) -> str:
    out = ['"']
    for char in text:
        if char in _ESCAPES:
            out.append(_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            out.append(f"\\u{ord(char):04X}")
        else:
            out.append(char)
    out.append('"')
    return "".join(out)


def _render_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _render_string(value)
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_render_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = ", ".join(f"{_render_key(k)} = {_render_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")
