"""The boundaries between a claim's durable steps, and the hook that can land a fault on them.

hubd injects no faults itself: in production the hook is ``None`` and a boundary costs a call
that tests one attribute. A simulation test passes a :class:`FaultHook` that, at a boundary,
raises or blocks the way the fault it stands for would show up there: a crash cancels the
claim, a database outage raises :class:`~hubd.errors.DatabaseUnavailable`, a pause returns only
after the lease has run out. Every statement still runs against the real database; the hook only
decides *when* things go wrong, so faults can land between every pair of durable steps.
"""

from __future__ import annotations

import enum
from typing import Protocol

import attrs

__all__ = ["Boundary", "FaultHook", "Site"]


class Boundary(enum.Enum):
    BEFORE_WRITE = "before write"
    """A write value is about to become its fenced statement."""
    AFTER_WRITE = "after write"
    """The write committed; the claim has not acted on it yet."""
    BEFORE_PLUGIN = "before plugin"
    """The call's intent is in the ledger; the call has not been made."""
    AFTER_PLUGIN = "after plugin"
    """The call returned; its outcome is not in the ledger yet."""
    BEFORE_READINESS = "before readiness"
    """The claim is about to read the connection record."""
    AFTER_READINESS = "after readiness"
    """The connection record was read; nothing was decided on it yet."""


@attrs.frozen(kw_only=True)
class Site:
    """Where a claim stands: the boundary, its allocation and generation, and the step (a write
    value's class name, a plugin call's kind, or ``readiness``)."""

    boundary: Boundary
    allocation_id: str
    generation: int
    step: str


class FaultHook(Protocol):
    async def at(self, site: Site) -> None:
        """Called at every boundary, in the task running the claim's step (the claim's body,
        or the claimer's own task when it parks the row after an error). Returning lets the
        claim go on; raising ends it as the fault would."""
