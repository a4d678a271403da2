"""The executor: one function carries out every durable write a claim decides on.

:func:`apply` maps a write value (:mod:`hubd.reconciler.writes`) to its one fenced statement
and runs it on the path its kind calls for, then tells the router and the log what changed:

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
from typing import Any, Protocol, TypedDict

import attrs
from structlog.typing import FilteringBoundLogger

from hubd.errors import LeaseLost
from hubd.reconciler.faults import Boundary
from hubd.reconciler.observer import ReconcilerObserver
from hubd.reconciler.writes import (
    Abandon,
    AcceptAndPark,
    BeginInitialization,
    BindInitial,
    BindReplacement,
    FailNow,
    MarkAllocated,
    MarkDestroyFailed,
    MarkReady,
    MarkReleased,
    Park,
    Retry,
    Write,
)
from hubd.routing import Router
from hubd.store.allocations import AllocationStore
from hubd.store.models import Allocation, Fence
from hubd.store.transitions import Effects
from hubd.store.values import ReplacementLimit

__all__ = ["Claim", "WriteServices", "apply", "statement"]

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


def statement(
    store: AllocationStore, fence: Fence, write: Write, effects: Effects = ()
) -> Statement:
    """The fenced statement that carries ``write`` out, with ``effects`` (not yet awaited)."""
    if effects and (
        isinstance(write, BeginInitialization | MarkReady)
        or (isinstance(write, Abandon) and write.release)
    ):
        # No plugin call's outcome leads to these (a release is never decided from an ensure,
        # which runs in provisioning); their statements take no effects.
        raise ValueError(f"{type(write).__name__} brackets no plugin call")
    match write:
        case BindInitial():
            return store.bind_initial_sidecar(
                fence,
                sidecar_id=write.sidecar_id,
                token_hash=write.token_hash,
                connect_timeout=write.connect_timeout,
                api_version=write.api_version,
                binding_fingerprint=write.binding_fingerprint,
                ready_when=write.ready_when,
                effects=effects,
            )
        case BindReplacement():
            return store.bind_replacement_sidecar(
                fence,
                sidecar_id=write.sidecar_id,
                token_hash=write.token_hash,
                connect_timeout=write.connect_timeout,
                effects=effects,
            )
        case MarkAllocated():
            return store.mark_allocated(
                fence,
                external_ref=write.external_ref,
                endpoint=write.endpoint,
                metadata=write.metadata,
                effects=effects,
            )
        case BeginInitialization():
            return store.begin_initialization(fence)
        case MarkReady():
            return store.mark_connection_ready(fence, connection_seq=write.connection_seq)
        case Retry():
            return store.schedule_retry(
                fence,
                expected_status=write.expected,
                delay=write.delay,
                attempt=write.attempt_kind,
                failure=write.failure,
                clear_initialization=write.clear_initialization,
                effects=effects,
            )
        case Park() | AcceptAndPark():
            accept = write.accepted if isinstance(write, AcceptAndPark) else None
            park = write.park if isinstance(write, AcceptAndPark) else write
            return store.park(
                fence,
                mode=park.mode,
                delay=park.delay,
                failure=park.failure,
                connection_seq=park.connection_seq,
                ready_within=park.ready_within,
                accept=accept is not None,
                external_ref=None if accept is None else accept.external_ref,
                endpoint=None if accept is None else accept.endpoint,
                metadata=None if accept is None else accept.metadata,
                effects=effects,
            )
        case Abandon(release=True):
            return store.begin_unrecoverable_release(
                fence, failure=write.failure, **_abandon_guard(write)
            )
        case Abandon():
            return store.begin_replacement(
                fence,
                expected_status=write.expected,
                delay=write.delay,
                failure=write.failure,
                limit=write.limit,
                effects=effects,
                **_abandon_guard(write),
            )
        case FailNow():
            return store.fail_without_infrastructure(
                fence, expected_status=write.expected, failure=write.failure, effects=effects
            )
        case MarkDestroyFailed():
            return store.mark_destroy_failed(fence, failure=write.failure, effects=effects)
        case MarkReleased():
            return store.mark_released(fence, effects=effects)


class _AbandonGuard(TypedDict):
    only_if_initialization_incomplete: bool
    expected_initialization_lease_id: str | None
    expected_connection_seq: int | None


def _abandon_guard(write: Abandon) -> _AbandonGuard:
    """The guards a replacement and a release share, as the store takes them."""
    return _AbandonGuard(
        only_if_initialization_incomplete=write.only_if_initialization_incomplete,
        expected_initialization_lease_id=write.expected_initialization_lease_id,
        expected_connection_seq=write.expected_connection_seq,
    )


_WHAT: dict[type[Write], str] = {
    BindInitial: "bind sidecar",
    BindReplacement: "bind sidecar",
    MarkAllocated: "mark allocated",
    BeginInitialization: "begin initialization",
    FailNow: "fail",
    MarkDestroyFailed: "mark destroy failed",
    MarkReleased: "mark released",
}


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
    what = _WHAT[type(write)]
    updated = await claim.op(statement(claim.services.store, claim.fence, write, effects), what)
    if updated is None:
        raise LeaseLost(f"{what}: the fence matched nothing")
    claim.track(updated)
    return updated


async def _finish(
    claim: Claim, write: Retry | Park | AcceptAndPark | MarkReady, effects: Effects
) -> Allocation | None:
    """End the claim with ``write``, in the allocation's queue: the row it wrote, or ``None``
    when it matched nothing (then the claim is fenced out)."""
    s, fence = claim.services, claim.fence
    written: Allocation | None = None

    async def step() -> None:
        nonlocal written
        written = await statement(s.store, fence, write, effects)
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
    guard_failed = False

    async def step() -> None:
        nonlocal guard_failed
        updated = await statement(s.store, fence, write, effects)
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
