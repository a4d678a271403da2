"""What the parts that print their own table share (``bench.http``, ``bench.pools``): a value
by its dotted path in a result, a label's names filled from the load, numbers, and columns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["columns", "labels", "lookup", "number"]


def lookup(node: Any, path: str) -> Any:
    """``node["a"]["b"]`` for ``"a.b"``; ``None`` where a part is missing (the part did not
    run, or failed)."""
    for key in path.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


class _Names(dict[str, str]):
    def __missing__(self, key: str) -> str:
        return "N"  # the part did not run


def labels(load: Mapping[str, Any], **more: str) -> dict[str, str]:
    """The names a row's label is filled with: the load's figures (whole numbers with
    thousands separators) and ``more``; ``N`` for a name the result does not have."""
    names = _Names({k: f"{v:,}" if isinstance(v, int) else f"{v:g}" for k, v in load.items()})
    names.update(more)
    return names


def number(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}" if abs(value) >= 100 else f"{value:.1f}"


def columns(lines: Sequence[Sequence[str]], *, right: Sequence[int]) -> list[str]:
    """``lines`` (a header first) as aligned text, a rule under the header; the columns in
    ``right`` are numbers, aligned right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ).rstrip()
        for line in lines
    ]
    out.insert(1, "  ".join("-" * width for width in widths))
    return out
