"""The rules every claim runs by, as one function over settings: the reconciler's settings and
the configuration's ``[reconciler]`` section both check them, so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

__all__ = ["DEFAULT_CLAIMS", "TENANT_ROOM", "claim_rules_problem"]

DEFAULT_CLAIMS: Final = 64
"""Claims a daemon works on at once unless configured: at 64 the claims of a backlog overlap
(the statements of one cohort run while the last one's sidecars connect) where at 16 they went
in lockstep, for 1.24 to 1.49 times the lifecycle and two thirds of the CPU per allocation
(docs/performance.md, "Claims at once")."""

TENANT_ROOM: Final = 4
"""The most claim slots one tenant holds, unless configured, while another tenant is in sight
(half the slots when fewer). Another tenant's p99 under a burst of ten times its load, on two
cores at 64 claims: 55-82 ms with the burst at 4 claims (1.26-1.79 times its p99 alone), 48-88
ms at 8 (1.66-2.47 times), 3.5 times alone at 32; the burst's rate two thirds of 8's
(docs/measurements.md, "Fair claiming among tenants")."""


def claim_rules_problem(
    *,
    lease_duration: float,
    operation_timeout: float,
    max_concurrent_claims: int,
    prefix: str = "",
    show: Callable[[float], str] = lambda seconds: f"{seconds:g}s",
) -> tuple[str, str] | None:
    """The rules claims run by: ``(setting, problem)`` for the first one broken. The problem
    names other settings with ``prefix`` and durations through ``show``; the configuration
    checks its ``[reconciler]`` section by the same rules."""
    # A plugin call may not outlive the lease that authorised it: once the lease can expire
    # mid-call, another replica may claim the allocation and act on it concurrently.
    if operation_timeout >= lease_duration:
        return "operation_timeout", (
            f"must be shorter than {prefix}lease_duration "
            f"({show(operation_timeout)} ≥ {show(lease_duration)})"
        )
    if max_concurrent_claims < 1:
        return "max_concurrent_claims", f"must be at least 1, not {max_concurrent_claims}"
    return None
