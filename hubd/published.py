"""What a generation publishes about its sidecar: an endpoint and a metadata object.

A provisioner's ``Accepted`` and a sidecar may both hand these to hubd, and neither is code
hubd controls, so both are checked here before anything reaches the database: the columns'
domains (``hubd_endpoint``: 1 to 1,024 characters; ``hubd_metadata``: a JSON object whose
``jsonb`` text is at most 16 KiB) would otherwise refuse them inside a fenced transition,
which would take the transition with them.

The size is measured as PostgreSQL prints the ``jsonb`` value (``", "`` and ``": "``
separators, numbers in plain notation: ``1e300`` is 301 digits there), not as Python encodes
it, so a value accepted here is never refused by the domain.
"""

from __future__ import annotations

import decimal
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Final

__all__ = [
    "MAX_ENDPOINT_LENGTH",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_DEPTH",
    "check_endpoint",
    "check_metadata",
    "encode_metadata",
]

MAX_ENDPOINT_LENGTH: Final = 1024
MAX_METADATA_BYTES: Final = 16 * 1024
MAX_METADATA_DEPTH: Final = 16
"""Containers nested deeper than this are refused (the walk below is iterative; json and the
CLI's printing are not)."""

_HUGE: Final = 10**4300
"""Python refuses to print an integer this long (``sys.set_int_max_str_digits``)."""

# C0 and C1 controls, DEL and the bidirectional marks, embeddings, overrides and isolates: an
# endpoint is printed by the CLI and logged, and must read as what it is.
_UNPRINTABLE: Final = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)

# Every refusal below is a ValueError, a wrong type included (hence the TRY004 silences): a
# caller turns one exception into its own error (a plugin's, a protocol close).


def check_endpoint(value: object) -> str:
    """``value`` if it is an endpoint hubd stores; :class:`ValueError` saying why not."""
    if not isinstance(value, str):
        raise ValueError(f"endpoint is {type(value).__name__}, not a string")  # noqa: TRY004
    if not value:
        raise ValueError("endpoint is empty")
    if len(value) > MAX_ENDPOINT_LENGTH:
        raise ValueError(f"endpoint is longer than {MAX_ENDPOINT_LENGTH} characters")
    if _UNPRINTABLE.search(value):
        raise ValueError("endpoint contains control characters or bidirectional formatting")
    _check_text(value, "endpoint")
    return value


def check_metadata(value: object) -> dict[str, Any]:
    """A plain copy of ``value`` if it is a metadata object hubd stores; :class:`ValueError`
    saying why not (the first problem found, with its path)."""
    if not isinstance(value, Mapping):
        raise ValueError(f"metadata is {type(value).__name__}, not a JSON object")  # noqa: TRY004
    size = 0
    # Iterative, so a hostile depth is refused before anything recurses over it.
    stack: list[tuple[object, str, int]] = [(value, "metadata", 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, Mapping | list | tuple):
            if depth > MAX_METADATA_DEPTH:
                raise ValueError(f"metadata nests deeper than {MAX_METADATA_DEPTH} levels")
            size += 2 + 2 * max(len(item) - 1, 0)  # the brackets, ", " between members
            if isinstance(item, Mapping):
                for key, child in item.items():
                    if not isinstance(key, str):
                        problem = f"{path} has a key that is not a string: {key!r:.40}"
                        raise ValueError(problem)  # noqa: TRY004
                    _check_text(key, f"{path} key")
                    size += _string_size(key) + 2  # ": "
                    stack.append((child, f"{path}.{key:.40}", depth + 1))
            else:
                stack.extend(
                    (child, f"{path}[{index}]", depth + 1) for index, child in enumerate(item)
                )
        else:
            size += _scalar_size(item, path)
        if size > MAX_METADATA_BYTES:
            raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES} bytes as JSON")
    copy: dict[str, Any] = json.loads(encode_metadata(value) or "{}")
    return copy


def encode_metadata(value: Mapping[str, Any] | None) -> str | None:
    """Checked metadata as the JSON text the store's statements take."""
    if value is None:
        return None
    return json.dumps(value, allow_nan=False, ensure_ascii=False, default=_plain)


def _plain(value: object) -> object:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _scalar_size(item: object, path: str) -> int:
    if item is None:
        return 4
    if isinstance(item, bool):
        return 4 if item else 5
    if isinstance(item, int):
        if abs(item) >= _HUGE:
            raise ValueError(f"{path} is an integer of more than 4,300 digits")
        return len(str(item))
    if isinstance(item, float):
        if not math.isfinite(item):
            raise ValueError(f"{path} is {item!r}, which JSON cannot carry")
        # PostgreSQL's numeric prints in plain notation.
        return len(format(decimal.Decimal(repr(item)), "f"))
    if isinstance(item, str):
        _check_text(item, path)
        return _string_size(item)
    raise ValueError(f"{path} is {type(item).__name__}, which JSON cannot carry")


def _check_text(value: str, what: str) -> None:
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL character")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate)") from exc


def _string_size(value: str) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode())
