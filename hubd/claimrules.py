"""The rules every claim runs by, as one function over settings: the reconciler's settings and
the configuration's ``[reconciler]`` section both check them, so neither imports the other."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["claim_rules_problem"]


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
