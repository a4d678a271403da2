"""The provisioner plugin contract (architecture §5) and the checks applied to what plugins return.

Plugins are code hubd does not control: a result of the wrong type is an error, never a success,
and every string a plugin hands back is bounded before it reaches the database or a log.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from hubd.errors import PluginError

__all__ = [
    "Accepted",
    "DestroyRejected",
    "DestroyRequest",
    "DestroyResult",
    "Destroyed",
    "EnsureRequest",
    "EnsureResult",
    "Provisioner",
    "Rejected",
    "check_destroy_result",
    "check_ensure_result",
]

MAX_EXTERNAL_REF = 500


@attrs.frozen(kw_only=True)
class EnsureRequest:
    allocation_id: str
    generation: int
    tenant_id: str | None
    session_id: str | None
    spec: Mapping[str, Any]
    sidecar_id: str
    token: str = attrs.field(repr=False)
    hub_ws_url: str


@attrs.frozen
class Accepted:
    """The sidecar exists or is being created; ``external_ref`` names it for ``destroy``."""

    external_ref: str | None = None


@attrs.frozen(kw_only=True)
class Rejected:
    """The provisioner refused; ``retryable`` says whether a new sidecar may succeed."""

    code: str
    message: str
    retryable: bool


EnsureResult = Accepted | Rejected


@attrs.frozen(kw_only=True)
class DestroyRequest:
    allocation_id: str
    generation: int
    sidecar_id: str
    external_ref: str | None


@attrs.frozen
class Destroyed:
    """The sidecar is gone (or never existed)."""


@attrs.frozen(kw_only=True)
class DestroyRejected:
    code: str
    message: str
    retryable: bool


DestroyResult = Destroyed | DestroyRejected


@runtime_checkable
class Provisioner(Protocol):
    """What a provisioner plugin provides. Both calls must be idempotent per ``sidecar_id``;
    cancelling the call's task is how hubd aborts it."""

    id: str
    api_version: str
    binding_fingerprint: str

    async def ensure(self, request: EnsureRequest) -> EnsureResult: ...

    async def destroy(self, request: DestroyRequest) -> DestroyResult: ...


def _check_rejection(value: Rejected | DestroyRejected, what: str) -> None:
    if not isinstance(value.code, str) or not value.code:
        raise PluginError(f"{what} rejection has no code")
    if not isinstance(value.message, str):
        raise PluginError(f"{what} rejection message is not a string")
    if not isinstance(value.retryable, bool):
        raise PluginError(f"{what} rejection 'retryable' is not a bool")


def check_ensure_result(value: object) -> EnsureResult:
    """``value`` if it is a well-formed ensure result; :class:`PluginError` otherwise."""
    if isinstance(value, Accepted):
        ref = value.external_ref
        if ref is not None and (not isinstance(ref, str) or len(ref) > MAX_EXTERNAL_REF):
            raise PluginError(
                f"ensure returned an external_ref that is not a string of at most "
                f"{MAX_EXTERNAL_REF} characters"
            )
        return value
    if isinstance(value, Rejected):
        _check_rejection(value, "ensure")
        return value
    raise PluginError(f"ensure returned {type(value).__name__}, not Accepted or Rejected")


def check_destroy_result(value: object) -> DestroyResult:
    """``value`` if it is a well-formed destroy result; :class:`PluginError` otherwise."""
    if isinstance(value, Destroyed):
        return value
    if isinstance(value, DestroyRejected):
        _check_rejection(value, "destroy")
        return value
    raise PluginError(f"destroy returned {type(value).__name__}, not Destroyed or DestroyRejected")
