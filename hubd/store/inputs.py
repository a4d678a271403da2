"""Validation and shaping of values that cross into the store: ids, specs, failures, and the
words a transition's caller chooses among (which attempt a retry bumps, why a claim parks).

Driver-free, as is :mod:`hubd.store.rows`: the reconciler's pure modules import their values
from here without loading the driver.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Mapping
from typing import Any, Final

import attrs

from hubd.errors import InvalidRequest
from hubd.redaction import scrub

__all__ = [
    "DEFAULT_REPLACEMENT_LIMIT",
    "MAX_CODE_LENGTH",
    "MAX_MESSAGE_LENGTH",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_DEPTH",
    "NO_REPLACEMENT_LIMIT",
    "AttemptKind",
    "Failure",
    "ParkMode",
    "ReplacementLimit",
    "bounded_code",
    "bounded_message",
    "new_allocation_id",
    "new_effect_id",
    "spec_depth_ok",
    "validate_allocation_id",
    "validate_label",
    "validate_provisioner_id",
    "validate_spec",
]

MAX_CODE_LENGTH: Final = 64
MAX_MESSAGE_LENGTH: Final = 500
MAX_SPEC_BYTES: Final = 64 * 1024
MAX_LABEL_LENGTH: Final = 200
MAX_SPEC_DEPTH: Final = 32
"""Nesting deeper than this is refused before anything recurses over it (json, PostgreSQL's
jsonb and the CLI's printing all recurse)."""

_ALLOCATION_ID: Final = re.compile(r"^al_[0-9a-f]{32}$")
_PROVISIONER_ID: Final = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_CODE_CHARS: Final = re.compile(r"[^a-z0-9_.:-]+")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
# C0 and C1 controls (U+009B is a one-character terminal escape) and the bidirectional marks,
# embeddings, overrides and isolates that make a label read differently from what it is.
_UNPRINTABLE_LABEL: Final = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def new_effect_id() -> str:
    """The id that ties a plugin call's intent to its outcome in the ledger."""
    return f"ef_{secrets.token_hex(8)}"


def new_allocation_id() -> str:
    return f"al_{secrets.token_hex(16)}"


def validate_allocation_id(value: object) -> str:
    if not isinstance(value, str) or not _ALLOCATION_ID.match(value):
        raise InvalidRequest(
            f"malformed allocation id {_preview(value)}: expected 'al_' and 32 hex digits"
        )
    return value


def validate_provisioner_id(value: object) -> str:
    if not isinstance(value, str) or not _PROVISIONER_ID.match(value):
        raise InvalidRequest(
            f"malformed provisioner id {_preview(value)}: expected 1-64 characters of "
            "a-z, 0-9, '_', '.', '-', starting with a letter or digit"
        )
    return value


def validate_label(name: str, value: object) -> str | None:
    """A tenant or session id: optional, short, printable."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_LABEL_LENGTH:
        raise InvalidRequest(f"{name} must be a non-empty string of at most {MAX_LABEL_LENGTH}")
    if _UNPRINTABLE_LABEL.search(value):
        raise InvalidRequest(
            f"{name} must not contain control characters or bidirectional formatting"
        )
    return value


def spec_depth_ok(value: object, limit: int = MAX_SPEC_DEPTH) -> bool:
    """Whether ``value`` nests at most ``limit`` containers deep; iterative, so a hostile
    depth costs no recursion."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def validate_spec(value: object) -> dict[str, Any]:
    """A spec is a JSON object of at most 64 KiB; anything else is refused before the database."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"spec must be a JSON object, not {type(value).__name__}")
    if not spec_depth_ok(value):
        raise InvalidRequest(f"spec nests deeper than {MAX_SPEC_DEPTH} levels")
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"spec is not JSON-serializable: {exc}") from exc
    if len(encoded.encode()) > MAX_SPEC_BYTES:
        raise InvalidRequest(f"spec is larger than {MAX_SPEC_BYTES} bytes")
    if "\\u0000" in encoded:
        raise InvalidRequest("spec must not contain NUL characters")
    decoded: dict[str, Any] = json.loads(encoded)
    return decoded


def bounded_code(code: str) -> str:
    """A failure code as the ledger stores it: a short lowercase token."""
    cleaned = _CODE_CHARS.sub("_", code.strip().lower()).strip("_")
    return (cleaned or "unknown")[:MAX_CODE_LENGTH]


def bounded_message(message: str) -> str:
    """A failure message with secrets removed, one line, at most 500 characters."""
    cleaned = _CONTROL.sub(" ", scrub(message)).strip()
    if len(cleaned) > MAX_MESSAGE_LENGTH:
        cleaned = cleaned[: MAX_MESSAGE_LENGTH - 1] + "…"
    return cleaned


class AttemptKind(enum.StrEnum):
    """Which durable attempt counter a retry bumps."""

    ENSURE = "ensure"
    DESTROY = "destroy"


class ParkMode(enum.StrEnum):
    """Why a claim parks: to wait for its sidecar to connect, or to retry after an error."""

    AWAIT_CONNECTION = "await_connection"
    RETRY_AFTER_ERROR = "retry_after_error"


@attrs.frozen
class Failure:
    """Why a step failed, bounded and scrubbed on construction."""

    code: str = attrs.field(converter=bounded_code)
    message: str = attrs.field(converter=bounded_message)


@attrs.frozen
class ReplacementLimit:
    """How many sidecars of one allocation may be abandoned within ``window`` seconds of the
    first of a streak before it is given up (ends ``failed``); a limit of 0: never."""

    limit: int = 0
    window: float = 600.0


NO_REPLACEMENT_LIMIT: Final = ReplacementLimit()
"""Replace for ever."""
DEFAULT_REPLACEMENT_LIMIT: Final = ReplacementLimit(5, 600.0)
"""``[reconciler] replacement_limit`` and ``replacement_window`` as shipped."""


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
