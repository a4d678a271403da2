"""The reconciler's settings and the hooks an application can plug into it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import attrs

from hubd.store.models import Allocation

__all__ = ["Hook", "HookContext", "ReconcilerSettings", "hook_call"]


@attrs.frozen(kw_only=True)
class HookContext:
    """What a hook is told about the claim it runs under."""

    allocation_id: str
    generation: int
    lease_id: str


Hook = Callable[[Allocation, HookContext], Awaitable[None]]


@attrs.frozen(kw_only=True)
class ReconcilerSettings:
    lease_duration: float = 60.0
    connect_timeout: float = 120.0
    operation_timeout: float = 30.0
    max_concurrent_claims: int = 16
    automatic_replacement_recovery: bool = False
    instance_ttl: float = 20.0
    """A connection record counts only while its instance heartbeated within this time."""

    def __attrs_post_init__(self) -> None:
        for name in ("lease_duration", "connect_timeout", "operation_timeout", "instance_ttl"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.operation_timeout >= self.lease_duration:
            raise ValueError("operation_timeout must be shorter than lease_duration")
        if self.max_concurrent_claims < 1:
            raise ValueError("max_concurrent_claims must be at least 1")


def hook_call(
    hook: Hook, allocation: Allocation
) -> Callable[[HookContext], Coroutine[Any, Any, None]]:
    async def call(context: HookContext) -> None:
        await hook(allocation, context)

    return call
