"""One claim's run: the allocation as last written, its lease, and how it does I/O.

A :class:`ClaimRun` lives from the claim to its final write; :mod:`hubd.reconciler.steps` drives
it. Every external operation it runs (store calls, plugin calls bracketed in the ledger, hooks,
waits for a connect) runs under a time limit and the claim's cancellation, plugin calls and
hooks only while the local lease deadline holds. A plugin call's ledger rows ride on the
fenced transitions around it: its intent on the write that makes it due, its outcome on the
write decided from it. Its writes are values decided in :mod:`hubd.reconciler.decisions`,
which the steps hand to :func:`hubd.reconciler.executor.apply` with the claim.

A claim that cannot prove it still owns the lease stops at once and writes nothing more: the
durable schedule survives, and the lease expires on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

import attrs
from structlog.typing import FilteringBoundLogger

from hubd.errors import LeaseLost, OperationTimeout, PluginError
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRejected,
    Ownership,
    Provisioner,
    Rejected,
)
from hubd.reconciler.clock import Clock, wait_settled
from hubd.reconciler.decisions import Raised, TimedOut, effect_phase, outcome_text
from hubd.reconciler.faults import Boundary, FaultHook, Site
from hubd.reconciler.lease import LeaseKeeper
from hubd.reconciler.observer import ReconcilerObserver
from hubd.reconciler.settings import Hook, HookContext, ReconcilerSettings
from hubd.reconciler.work import LocalWork
from hubd.routing import Router, Target
from hubd.store.allocations import AllocationStore
from hubd.store.connections import ConnectionStore
from hubd.store.inputs import ReplacementLimit
from hubd.store.ledger import LedgerStore, new_effect_id
from hubd.store.rows import Allocation, EffectRow, Fence, Phase, Status

__all__ = ["ClaimRun", "ClaimServices"]

T = TypeVar("T")
R = TypeVar("R", bound=Accepted | Rejected | Destroyed | DestroyRejected)


@attrs.frozen(kw_only=True)
class ClaimServices:
    """What every claim of one reconciler shares."""

    store: AllocationStore
    ledger: LedgerStore
    connections: ConnectionStore
    provisioners: Mapping[str, Provisioner]
    router: Router
    hub_ws_url: str
    settings: ReconcilerSettings
    on_ready: Hook | None
    on_initialization_recovery: Hook | None
    clock: Clock
    work: LocalWork
    observer: ReconcilerObserver
    active: Mapping[str, ClaimRun]
    """The reconciler's claims in progress, by allocation."""
    create_sidecar_id: Callable[[], str]
    create_token: Callable[[], str]
    faults: FaultHook | None = None
    """Tests only: lands faults at the claim's step boundaries (:mod:`hubd.reconciler.faults`)."""

    @property
    def replacement_limit(self) -> ReplacementLimit:
        return self.settings.replacement_limit


@attrs.define(eq=False, kw_only=True)
class ClaimRun:
    """A claim in progress: the allocation as last written, and how long the lease is ours."""

    services: ClaimServices
    allocation: Allocation
    lease_id: str
    lease: LeaseKeeper
    db_anchor: datetime
    local_anchor: float
    log: FilteringBoundLogger
    open_effects: bool = True
    """An earlier lease may have left a plugin call with no outcome to settle."""
    destroy_intent: str | None = None
    """The effect id of the destroy intent the claim statement wrote, if it wrote one."""
    ensure_intent: str | None = None
    """The effect id of the ensure intent the claim statement wrote when it bound the row."""
    bound_token: str | None = attrs.field(default=None, repr=False)
    """The raw token of the identity the claim statement bound (never durable)."""
    lost: LeaseLost | None = None
    fenced_out: bool = False
    """A final write matched nothing: the row moved on without this claim (a release, a peer)."""
    task: asyncio.Task[Any] | None = None
    """The task the claim's steps run in, while they run: a lost lease cancels it."""
    _cancelled: bool = attrs.field(default=False, init=False)

    @property
    def fence(self) -> Fence:
        return Fence(
            allocation_id=self.allocation.id,
            lease_id=self.lease_id,
            generation=self.allocation.generation,
        )

    @property
    def target(self) -> Target:
        return Target(self.allocation.id, self.allocation.generation)

    def owns(self) -> bool:
        """Still owned by the local reckoning: not lost, local lease deadline not passed."""
        return self.lost is None and not self.lease.expired

    def ownership(self) -> Ownership:
        """What a plugin call checks at the point of effect (see :class:`Ownership`)."""
        return Ownership(
            still_owned=self.owns,
            deadline=lambda: self.lease.deadline,
            deadline_utc=lambda: (
                self.db_anchor + timedelta(seconds=self.lease.deadline - self.local_anchor)
            ),
        )

    # -- running operations ------------------------------------------------------------------

    async def op(self, coro: Coroutine[Any, Any, T], what: str, limit: float | None = None) -> T:
        """Run an external operation under a time limit and the claim's cancellation.

        A late or cancelled operation is asked to stop, but stays tracked until it settles, so
        its allocation stays excluded from claims meanwhile.
        """
        # Cancellation is how a lost lease stops the claim, but a library can swallow one (on
        # Python 3.11 asyncio.wait_for may): the recorded loss is checked as well, so a claim
        # that lost its lease starts nothing more, whatever became of the cancellation.
        if self.lost is not None:
            coro.close()
            raise self.lost
        s = self.services
        limit = s.settings.operation_timeout if limit is None else limit
        task = s.work.spawn(
            coro, allocation_id=self.allocation.id, name=f"{what} {self.allocation.id}"
        )
        try:
            settled = await wait_settled(s.clock, task, limit)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not settled:
            task.cancel()
            raise OperationTimeout(f"{what} did not finish within {limit:g}s")
        return task.result()

    def track(self, allocation: Allocation) -> None:
        """Take ``allocation``, which a write of this claim returned, as the row it goes on
        from."""
        if allocation.status is not self.allocation.status:
            self.services.observer.transition(str(self.allocation.status), str(allocation.status))
        self.allocation = allocation
        self.db_anchor = allocation.updated_at
        self.local_anchor = self.services.clock.monotonic()

    def abort(self, cause: LeaseLost) -> None:
        if self.lost is None:
            self.lost = cause
        task = self.task
        # Inside the claim's own task the caller raises instead: cancelling ourselves would
        # surface at some unrelated await further down the error path. Cancelled once at most,
        # so that uncancel_abort can tell this cancellation from any other.
        if (
            task is not None
            and not self._cancelled
            and not task.done()
            and task is not asyncio.current_task()
        ):
            self._cancelled = True
            task.cancel()

    def uncancel_abort(self) -> bool:
        """Called where the claim's task caught a cancellation: whether it was only this
        claim's abort (then it is withdrawn, and the task goes on to end the claim); ``False``
        when the task was cancelled from outside too, or only from outside."""
        task = self.task
        if not self._cancelled or task is None:
            return False
        self._cancelled = False
        return task.uncancel() == 0

    async def queue_step(self, step: Callable[[], Awaitable[None]]) -> None:
        """Run ``step`` in the allocation's queue, behind any earlier step still unsettled."""
        s = self.services
        if s.active.get(self.allocation.id) is not self:
            raise LeaseLost("the claim is no longer active")

        async def guarded() -> None:
            if self.lost is not None:
                raise self.lost
            await step()

        task = s.work.enqueue(self.allocation.id, guarded, "reconciliation step")
        if not await wait_settled(s.clock, task, s.settings.operation_timeout):
            # Stop this claim without queueing another write behind the stalled step. The step
            # itself stays queued until it settles: a later claim's steps cannot overtake it,
            # and the allocation stays excluded from new claims.
            cause = LeaseLost("a queued step did not settle within operation_timeout")
            self.abort(cause)
            raise cause
        task.result()

    async def boundary(self, boundary: Boundary, step: str) -> None:
        """A boundary between durable steps: where an injected fault may land."""
        faults = self.services.faults
        if faults is not None:
            site = Site(
                boundary=boundary,
                allocation_id=self.allocation.id,
                generation=self.allocation.generation,
                step=step,
            )
            await faults.at(site)

    async def with_lease(
        self,
        what: str,
        call: Callable[[HookContext], Coroutine[Any, Any, T]],
        limit: float | None = None,
    ) -> T:
        """Run an external call under the claim, if the lease is still ours.

        The local deadline is proof enough: it counts from the start of the last renewal the
        database granted, so the row cannot have been claimed by anyone else before it passes;
        and a generation moved on by a release is caught by the fenced write that precedes every
        effect (a plugin call's intent, the initialization marker).
        """
        if self.lost is not None:
            raise self.lost
        if self.lease.expired:
            cause = LeaseLost("the local lease deadline passed")
            self.abort(cause)
            raise cause
        context = HookContext(
            allocation_id=self.allocation.id,
            generation=self.allocation.generation,
            lease_id=self.lease_id,
        )
        return await self.op(call(context), what, limit)

    @staticmethod
    def intend(kind: str, status: Status) -> EffectRow:
        """The intent row of a ``kind`` call to be made in ``status``, for the write that makes
        the call due to carry."""
        return EffectRow(effect_id=new_effect_id(), kind=kind, phase=Phase.INTENT, status=status)

    def claimed_ensure(self) -> tuple[EffectRow, str] | None:
        """The ensure intent the claim statement wrote when it bound the row, with the raw
        token of the identity it bound; ``None`` when it did not bind."""
        if self.ensure_intent is None or self.bound_token is None:
            return None
        intent = EffectRow(
            effect_id=self.ensure_intent,
            kind="ensure",
            phase=Phase.INTENT,
            status=Status.PROVISIONING,
        )
        return intent, self.bound_token

    def claimed_intent(self) -> EffectRow | None:
        """The destroy intent the claim statement wrote, if any."""
        if self.destroy_intent is None:
            return None
        return EffectRow(
            effect_id=self.destroy_intent,
            kind="destroy",
            phase=Phase.INTENT,
            status=self.allocation.status,
        )

    async def record_intent(self, intent: EffectRow) -> None:
        """Write ``intent`` on its own, for a call no transition of this claim makes due."""
        recorded = await self.op(
            self.services.ledger.record_effect(
                self.fence,
                effect_id=intent.effect_id,
                kind=intent.kind,
                phase=intent.phase,
                status=intent.status,
            ),
            "record intent",
        )
        if not recorded:
            raise LeaseLost(f"{intent.kind} intent: the fence matched nothing")

    async def call_plugin(
        self,
        intent: EffectRow,
        call: Callable[[], Coroutine[Any, Any, object]],
        check: Callable[[object], R],
    ) -> tuple[R | Raised | TimedOut, EffectRow]:
        """One plugin call whose ``intent`` is already in the ledger: its outcome, and the
        outcome's ledger row for the write decided from it to carry. Nothing is written here:
        a claim that stops before that write leaves the intent open, and the next owner
        records the call as ambiguous."""
        s, kind = self.services, intent.kind
        status = self.allocation.status
        await self.boundary(Boundary.BEFORE_PLUGIN, kind)
        started = s.clock.monotonic()
        outcome: R | Raised | TimedOut
        try:
            outcome = check(await self.with_lease(kind, lambda _context: call()))
        except (LeaseLost, asyncio.CancelledError):
            # No outcome is written: the next owner records this call as ambiguous.
            raise
        except OperationTimeout:
            outcome = TimedOut()
        except PluginError as exc:
            outcome = Raised(str(exc))
            self._log_plugin_exception(kind, exc)
        except Exception as exc:  # noqa: BLE001 -- any failure of a plugin is an outcome
            outcome = Raised(f"{type(exc).__name__}: {exc}")
            self._log_plugin_exception(kind, exc)
        if not self.owns():
            # The call came back after the local deadline (the process was paused, say): the
            # deadline wins over whatever the plugin says, and nothing is written. The next
            # owner settles this call as ambiguous.
            cause = self.lost or LeaseLost(f"{kind} returned after the local lease deadline")
            self.abort(cause)
            raise cause
        duration_ms = (s.clock.monotonic() - started) * 1000
        await self.boundary(Boundary.AFTER_PLUGIN, kind)
        s.observer.plugin_call(
            self.allocation.provisioner_id, kind, duration_ms / 1000, type(outcome).__name__
        )
        code, message = outcome_text(kind, outcome)
        phase = effect_phase(outcome)
        # A call that did its job is at debug: its ledger row (with the duration) and the
        # histogram keep it, and the line of what follows (ready, released) says it for an
        # operator. Any other outcome explains the retry or failure after it.
        say = self.log.debug if phase is Phase.COMMITTED else self.log.info
        say(f"{kind}_finished", outcome=type(outcome).__name__, duration_ms=round(duration_ms, 1))
        return outcome, EffectRow(
            effect_id=intent.effect_id,
            kind=kind,
            phase=phase,
            status=status,
            error_code=code,
            message=message,
            duration_ms=duration_ms,
        )

    def _log_plugin_exception(self, kind: str, exc: Exception) -> None:
        """A plugin's exception, with its traceback, for the plugin's author: at warning the
        first time for an allocation (no failed attempt recorded since it was last ready), at
        debug after that, so a plugin that always raises does not flood the log. Called from
        the ``except`` block that caught it."""
        a = self.allocation
        first = a.ensure_attempts + a.destroy_attempts == 0
        say = self.log.warning if first else self.log.debug
        say(
            f"{kind}_raised",
            provisioner=a.provisioner_id,
            hint="the traceback is the plugin's; later failures of this allocation log at debug"
            if first
            else None,
            exc_info=True,
        )
        # Logged: the traceback goes. A plugin that raises one cached exception object again and
        # again would otherwise have Python chain every earlier raise's frames (and their
        # locals) onto it, a leak that grows with every retry.
        exc.__traceback__ = None
