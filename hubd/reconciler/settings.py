"""The reconciler's settings and the hooks an application can plug into it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import attrs

from hubd.claimrules import DEFAULT_CLAIMS, TENANT_ROOM, claim_rules_problem
from hubd.store.inputs import DEFAULT_REPLACEMENT_LIMIT, ReplacementLimit
from hubd.store.rows import Allocation
from hubd.units import positive

__all__ = ["Hook", "HookContext", "ReconcilerSettings", "claim_rules_problem", "hook_call"]


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
    max_concurrent_claims: int = DEFAULT_CLAIMS
    max_claims_per_tenant: int = 0
    """Claim slots one tenant may hold while another is in sight; 0: half of them, at most
    :data:`TENANT_ROOM`."""
    automatic_replacement_recovery: bool = False
    replacement_limit: ReplacementLimit = DEFAULT_REPLACEMENT_LIMIT
    """How often an allocation's sidecars may fail within a window before it is given up."""
    instance_ttl: float = 20.0
    """A connection record counts only while its instance heartbeated within this time."""
    restart_window: float = 60.0
    """At a start that finds no live peer, the least time every unconnected sidecar gets to
    come back (``connect_timeout`` when longer): it covers the reference sidecar's reconnect
    backoff (at most 30 s between dials) whatever ``connect_timeout`` is."""
    ready_when: Mapping[str, str] = attrs.field(factory=dict, hash=False)
    """Provisioner id → how its allocations become ready unless requested otherwise
    (``"connected"``, the default for a provisioner not named, or ``"declared"``); written
    on the row by the claim that binds it."""

    @property
    def tenant_room(self) -> int:
        """The claim slots one tenant may hold while another tenant is in sight."""
        half = max(1, self.max_concurrent_claims // 2)
        return self.max_claims_per_tenant or min(half, TENANT_ROOM)

    def ready_when_of(self, provisioner_id: str) -> str:
        return self.ready_when.get(provisioner_id, "connected")

    def __attrs_post_init__(self) -> None:
        for name in (
            "lease_duration",
            "connect_timeout",
            "operation_timeout",
            "instance_ttl",
            "restart_window",
        ):
            try:
                positive(getattr(self, name), getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        broken = claim_rules_problem(
            lease_duration=self.lease_duration,
            operation_timeout=self.operation_timeout,
            max_concurrent_claims=self.max_concurrent_claims,
        )
        if broken is not None:
            raise ValueError(f"{broken[0]}: {broken[1]}")


def hook_call(
    hook: Hook, allocation: Allocation
) -> Callable[[HookContext], Coroutine[Any, Any, None]]:
    async def call(context: HookContext) -> None:
        await hook(allocation, context)

    return call
