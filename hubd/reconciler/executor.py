"""The executor: one function carries out every durable write a claim decides on.

:func:`apply` runs the fenced statement a write value (:mod:`hubd.reconciler.writes`) names,
on the path its kind calls for, then tells the router and the log what changed:

- a write the claim goes on from (bind, mark allocated, begin initialization) or that ends the
  allocation (fail, destroy failed, released) must match its fence, or the claim is lost;
- a write that ends the claim (retry, park, accept and park, mark ready, abandon) runs in the
  allocation's queue (architecture §3), behind any earlier step still unsettled there. An
  abandon whose guard no longer holds writes its ``otherwise`` instead.

A write that brackets a plugin call carries the call's ledger rows (``effects``: the intent
with the bind that makes the call due, the outcome with the write decided from it) into the
same statement, so the evidence commits with the transition or not at all.

The executor knows the claim it writes for only as a :class:`Claim`: the claim's steps call
:func:`apply`, and the claim itself never calls back into the executor.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

import attrs
from structlog.typing import FilteringBoundLogger

from hubd.errors import LeaseLost
from hubd.reconciler.faults import Boundary
from hubd.reconciler.observer import ReconcilerObserver
from hubd.reconciler.writes import (
    Abandon,
    AcceptAndPark,
    BindInitial,
    BindReplacement,
    FailNow,
    MarkDestroyFailed,
    MarkReady,
    MarkReleased,
    Park,
    Retry,
    Write,
)
from hubd.routing import Router
from hubd.store.allocations import AllocationStore
from hubd.store.inputs import ReplacementLimit
from hubd.store.rows import Allocation, Fence
from hubd.store.transitions import Effects

__all__ = ["Claim", "WriteServices", "apply"]

Statement = Coroutine[Any, Any, Allocation | None]


class WriteServices(Protocol):
    """What the executor uses of the services every claim of a reconciler shares."""

    @property
    def store(self) -> AllocationStore: ...

    @property
    def router(self) -> Router: ...

    @property
    def observer(self) -> ReconcilerObserver: ...

    @property
    def replacement_limit(self) -> ReplacementLimit:
        """How often an allocation's sidecars may fail before it is given up."""


class Claim(Protocol):
    """What the executor needs of the claim it writes for
    (:class:`hubd.reconciler.claim.ClaimRun` is one): the row as last written and its fence,
    where faults may land, and the claim's two ways of running a statement, under its time
    limit and cancellation (:meth:`op`) or in the allocation's queue (:meth:`queue_step`)."""

    fenced_out: bool
    """Set when a final write matched nothing: the row moved on without this claim."""

    @property
    def services(self) -> WriteServices: ...

    @property
    def allocation(self) -> Allocation: ...

    @property
    def fence(self) -> Fence: ...

    @property
    def log(self) -> FilteringBoundLogger: ...

    async def boundary(self, boundary: Boundary, step: str) -> None: ...

    async def op(self, coro: Statement, what: str) -> Allocation | None: ...

    def track(self, allocation: Allocation) -> None:
        """Take ``allocation`` as the row the claim goes on from."""

    async def queue_step(self, step: Callable[[], Awaitable[None]]) -> None: ...


async def apply(claim: Claim, write: Write, effects: Effects = ()) -> None:
    """Carry ``write`` out for ``claim``, with the ledger rows ``effects``. Raises
    :class:`~hubd.errors.LeaseLost` when a write the claim goes on from matches nothing; a final
    write that matches nothing ends the claim."""
    await claim.boundary(Boundary.BEFORE_WRITE, type(write).__name__)
    await _carry_out(claim, write, effects)
    await claim.boundary(Boundary.AFTER_WRITE, type(write).__name__)


async def _carry_out(claim: Claim, write: Write, effects: Effects) -> None:
    if isinstance(write, Abandon):
        await _abandon(claim, write, effects)
        return
    if isinstance(write, Retry | Park | AcceptAndPark | MarkReady):
        written = await _finish(claim, write, effects)
        if written is not None:
            _report_final(claim, write, written)
        return
    done = await _must_match(claim, write, effects)
    router = claim.services.router
    if isinstance(write, BindInitial | BindReplacement):
        router.fence(done.id, done.generation)
    elif isinstance(write, FailNow):
        router.retire(done.id, done.generation)
        claim.log.warning(
            "allocation_failed", code=write.failure.code, message=write.failure.message
        )
    elif isinstance(write, MarkDestroyFailed):
        router.retire(done.id, done.generation)
        claim.log.error("destroy_failed_for_good", code=write.failure.code)
    elif isinstance(write, MarkReleased):
        router.retire(done.id, done.generation)
        claim.log.info("allocation_released")


async def _must_match(claim: Claim, write: Write, effects: Effects) -> Allocation:
    """A write the claim goes on from, or one that ends the allocation: the row it wrote;
    matching nothing means the claim is lost."""
    transition = write.transition(effects)
    updated = await claim.op(claim.services.store.write(claim.fence, transition), transition.what)
    if updated is None:
        raise LeaseLost(f"{transition.what}: the fence matched nothing")
    claim.track(updated)
    return updated


async def _finish(
    claim: Claim, write: Retry | Park | AcceptAndPark | MarkReady, effects: Effects
) -> Allocation | None:
    """End the claim with ``write``, in the allocation's queue: the row it wrote, or ``None``
    when it matched nothing (then the claim is fenced out)."""
    s, fence, transition = claim.services, claim.fence, write.transition(effects)
    written: Allocation | None = None

    async def step() -> None:
        nonlocal written
        written = await s.store.write(fence, transition)
        if written is None:
            claim.fenced_out = True
            claim.log.info("final_write_matched_nothing_claim_lost")
        elif written.status is not claim.allocation.status:
            s.observer.transition(str(claim.allocation.status), str(written.status))

    await claim.queue_step(step)
    return written


def _report_final(
    claim: Claim, write: Retry | Park | AcceptAndPark | MarkReady, written: Allocation
) -> None:
    if isinstance(write, AcceptAndPark):
        write = write.park
    if isinstance(write, MarkReady):
        if written.connection_ready:
            claim.log.info("allocation_ready")
        else:
            claim.log.info("connection_event_during_initialization_following_up")
    elif isinstance(write, Park) and write.ready_within is not None and written.ready:
        claim.log.info("allocation_ready")
    elif isinstance(write, Park) and write.connection_seq not in (None, written.connection_seq):
        claim.log.info("connection_event_while_claim_looked_due_now")


async def _abandon(claim: Claim, write: Abandon, effects: Effects) -> None:
    s, fence, status = claim.services, claim.fence, claim.allocation.status
    write = attrs.evolve(write, limit=s.replacement_limit)
    transition = write.transition(effects)
    guard_failed = False

    async def step() -> None:
        nonlocal guard_failed
        updated = await s.store.write(fence, transition)
        if updated is None:
            # The guard no longer holds, or the lease was lost (then ``otherwise`` matches
            # nothing either).
            guard_failed = True
            return
        s.observer.transition(str(status), str(updated.status))
        if updated.give_up:
            claim.log.warning("giving_up", code=write.failure.code, message=updated.failure_message)
        # Advance the fence before this step settles and the allocation becomes claimable
        # again, so the abandoned sidecar cannot linger connected.
        s.router.fence(updated.id, updated.generation)
        claim.log.warning("abandoning_sidecar", code=write.failure.code, to=str(updated.status))

    await claim.queue_step(step)
    if guard_failed and write.otherwise is not None:
        # The initialization completed (or its marker changed hands), or a connection was
        # recorded, since this claim looked: retry the ordinary path at once.
        # A guard that failed wrote nothing, so the call's rows go with ``otherwise``.
        await apply(claim, write.otherwise, effects)
