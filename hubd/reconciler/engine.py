"""The reconciler: claims allocations, keeps their leases, and carries out each decision.

One claim at a time per allocation, at most ``max_concurrent_claims`` at once. A claim owns its
allocation through a lease renewed every ``lease_duration / 3``; every write it makes is fenced by
that lease and the generation it claimed. A claim that cannot prove it still owns the lease stops
at once and writes nothing more: the durable schedule survives, and the lease expires on its own.

Connection truth lives in the database, not here. Every look at readiness returns the
allocation's connection number with the answer, and the writes that act on that look (park
until the connect deadline, mark ready, give up on a sidecar that never connected) are fenced
on it: a connect or disconnect recorded on any replica since makes them fall through to "due
now", so the next claim looks again. Nothing a claim decides rests on which process happened
to hold the socket.

The claim's final writes run through one FIFO queue per allocation
(:mod:`hubd.reconciler.work`). Allocations with any local work still running (a queued step, a
query or plugin call that outlived its time limit) are excluded from claims until that work
settles.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

import attrs
import structlog

from hubd.errors import (
    InitializationUncertain,
    LeaseLost,
    OperationTimeout,
    PluginError,
    StoreError,
)
from hubd.plugins.protocol import (
    DestroyRequest,
    EnsureRequest,
    Ownership,
    Provisioner,
    check_destroy_result,
    check_ensure_result,
)
from hubd.reconciler.clock import Clock, SystemClock, wait_settled
from hubd.reconciler.decisions import (
    AUTOMATIC_RECOVERY_DISABLED,
    MAX_BACKOFF_ATTEMPT,
    DestroyFailed,
    DestroyOutcome,
    EnsureOutcome,
    Fail,
    Proceed,
    Raised,
    Replace,
    Step,
    TimedOut,
    after_destroy,
    after_ensure,
    effect_phase,
    provisioner_mismatch,
    replacement_becomes_release,
    retry_delay,
    step_for,
    unavailable_provisioner,
)
from hubd.reconciler.lease import LeaseKeeper
from hubd.reconciler.observer import NullObserver, ReconcilerObserver
from hubd.reconciler.settings import Hook, HookContext, ReconcilerSettings, hook_call
from hubd.reconciler.work import LocalWork
from hubd.routing import Router, SidecarNotConnected, Target
from hubd.store.allocations import AllocationStore, AttemptKind, ParkMode
from hubd.store.connections import ConnectionStore, Readiness
from hubd.store.ledger import LedgerStore, new_effect_id
from hubd.store.models import Allocation, Fence, Phase, Status
from hubd.store.values import Failure
from hubd.tokens import hash_token, new_lease_id, new_sidecar_id, new_token

__all__ = ["HookContext", "Reconciler", "ReconcilerSettings"]

T = TypeVar("T")
log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class _Claim:
    """A claim in progress: the allocation as last written, and how long the lease is ours."""

    allocation: Allocation
    lease_id: str
    lease: LeaseKeeper
    db_anchor: datetime
    local_anchor: float
    log: Any
    lost: LeaseLost | None = None
    task: asyncio.Task[None] | None = None

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


class Reconciler:
    """The allocation state machine of architecture §1-§3, carried out under leases and fences."""

    def __init__(
        self,
        *,
        store: AllocationStore,
        ledger: LedgerStore,
        connections: ConnectionStore,
        provisioners: Mapping[str, Provisioner],
        router: Router,
        hub_ws_url: str,
        settings: ReconcilerSettings | None = None,
        on_ready: Hook | None = None,
        on_initialization_recovery: Hook | None = None,
        clock: Clock | None = None,
        create_lease_id: Callable[[], str] = new_lease_id,
        create_sidecar_id: Callable[[], str] = new_sidecar_id,
        create_token: Callable[[], str] = new_token,
        observer: ReconcilerObserver | None = None,
        on_settled: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._ledger = ledger
        self._connections = connections
        self._provisioners = provisioners
        self._router = router
        self._hub_ws_url = hub_ws_url
        self.settings = settings or ReconcilerSettings()
        self._on_ready = on_ready
        self._on_initialization_recovery = on_initialization_recovery
        self._clock = clock or SystemClock()
        self._create_lease_id = create_lease_id
        self._create_sidecar_id = create_sidecar_id
        self._create_token = create_token
        self._observer: ReconcilerObserver = observer or NullObserver()

        self._active: dict[str, _Claim] = {}
        self._work = LocalWork(on_settled)
        self._admitted = 0

    # -- introspection (metrics, tests) ----------------------------------------------------------

    @property
    def active_claims(self) -> int:
        return len(self._active)

    @property
    def queue_depth(self) -> int:
        return self._work.queue_depth

    def busy_allocations(self) -> frozenset[str]:
        """Allocations with local work still running; they are excluded from claims."""
        return frozenset(self._active) | self._work.busy()

    async def drain(self) -> None:
        """Wait until every task this reconciler started has settled."""
        await self._work.drain()

    # -- task bookkeeping ------------------------------------------------------------------------

    async def _op(
        self, claim: _Claim, coro: Coroutine[Any, Any, T], what: str, limit: float | None = None
    ) -> T:
        """Run an external operation for ``claim`` under a time limit and the claim's cancellation.

        A late or cancelled operation is asked to stop, but stays tracked until it settles, so
        its allocation stays excluded from claims meanwhile.
        """
        # Cancellation is how a lost lease stops the claim, but a library can swallow one (on
        # Python 3.11 asyncio.wait_for may): the recorded loss is checked as well, so a claim
        # that lost its lease starts nothing more, whatever became of the cancellation.
        if claim.lost is not None:
            coro.close()
            raise claim.lost
        limit = self.settings.operation_timeout if limit is None else limit
        task = self._work.spawn(
            coro, allocation_id=claim.allocation.id, name=f"{what} {claim.allocation.id}"
        )
        try:
            settled = await wait_settled(self._clock, task, limit)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not settled:
            task.cancel()
            raise OperationTimeout(f"{what} did not finish within {limit:g}s")
        return task.result()

    async def _write(
        self, claim: _Claim, coro: Coroutine[Any, Any, Allocation | None], what: str
    ) -> Allocation:
        """A fenced transition that must match: ``None`` means the claim is lost."""
        updated = await self._op(claim, coro, what)
        if updated is None:
            raise LeaseLost(f"{what}: the fence matched nothing")
        self._track(claim, updated)
        return updated

    def _track(self, claim: _Claim, allocation: Allocation) -> None:
        if allocation.status is not claim.allocation.status:
            self._observer.transition(str(claim.allocation.status), str(allocation.status))
        claim.allocation = allocation
        claim.db_anchor = allocation.updated_at
        claim.local_anchor = self._clock.monotonic()

    def _abort(self, claim: _Claim, cause: LeaseLost) -> None:
        if claim.lost is None:
            claim.lost = cause
        task = claim.task
        # Inside the claim's own task the caller raises instead: cancelling ourselves would
        # surface at some unrelated await further down the error path.
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()

    # -- the per-allocation queue ----------------------------------------------------------------

    async def _queue_step(self, claim: _Claim, step: Callable[[], Awaitable[None]]) -> None:
        """Run ``step`` in the allocation's queue, after connection events queued before it."""
        if self._active.get(claim.allocation.id) is not claim:
            raise LeaseLost("the claim is no longer active")

        async def guarded() -> None:
            if claim.lost is not None:
                raise claim.lost
            await step()

        task = self._work.enqueue(claim.allocation.id, guarded, "reconciliation step")
        if not await wait_settled(self._clock, task, self.settings.operation_timeout):
            # Stop this claim without queueing another write behind the stalled step. The step
            # itself stays queued until it settles: that keeps its order with later connection
            # events, and keeps the allocation excluded from new claims.
            cause = LeaseLost("a queued step did not settle within operation_timeout")
            self._abort(claim, cause)
            raise cause
        task.result()

    async def _finish(
        self,
        claim: _Claim,
        write: Callable[[], Coroutine[Any, Any, Allocation | None]],
    ) -> Allocation | None:
        """End the claim with a queued write; the row it wrote, or ``None`` if the claim was
        lost."""
        written: Allocation | None = None

        async def step() -> None:
            nonlocal written
            written = await write()
            if written is None:
                claim.log.info("final write matched nothing; the claim was lost")
            elif written.status is not claim.allocation.status:
                self._observer.transition(str(claim.allocation.status), str(written.status))

        await self._queue_step(claim, step)
        return written

    # -- claims ----------------------------------------------------------------------------------

    async def reconcile_next(self) -> bool:
        """Claim one due allocation and reconcile it; ``False`` when there was nothing to do or
        no capacity."""
        retained = self._work.busy() - frozenset(self._active)
        if self._admitted + len(retained) >= self.settings.max_concurrent_claims:
            return False
        self._admitted += 1
        query: asyncio.Task[Allocation | None] | None = None
        try:
            lease_id = self._create_lease_id()
            started = self._clock.monotonic()
            query = self._work.spawn(
                self._store.claim_next(
                    lease_id=lease_id,
                    lease_duration=self.settings.lease_duration,
                    exclude=self.busy_allocations(),
                ),
                allocation_id=None,
                name="claim",
            )
            try:
                settled = await wait_settled(self._clock, query, self.settings.operation_timeout)
            except asyncio.CancelledError:
                query.cancel()
                raise
            if not settled:
                query.cancel()
                raise OperationTimeout("the claim query did not finish within operation_timeout")
            allocation = query.result()
            if allocation is None:
                return False
            await self._reconcile_claim(allocation, lease_id, started)
            return True
        finally:
            if query is None or query.done():
                self._admitted -= 1
            else:
                # A claim query that outlived its limit still holds capacity until it settles.
                query.add_done_callback(lambda _: self._release_admission())

    def _release_admission(self) -> None:
        self._admitted -= 1

    async def reconcile_until_idle(self, max_iterations: int = 100) -> int:
        done = 0
        while done < max_iterations and await self.reconcile_next():
            done += 1
        return done

    async def _reconcile_claim(self, allocation: Allocation, lease_id: str, started: float) -> None:
        bound = log.bind(
            allocation_id=allocation.id, generation=allocation.generation, lease_id=lease_id
        )
        if allocation.id in self._active or self._work.is_busy(allocation.id):
            # Local work started after this claim's exclusion snapshot. Let the lease expire
            # rather than put another write behind that work.
            bound.info("claim raced local work; leaving its lease to expire")
            return
        aid = allocation.id
        lease = LeaseKeeper(
            renew=lambda: self._store.renew_lease(aid, lease_id, self.settings.lease_duration),
            clock=self._clock,
            lease_duration=self.settings.lease_duration,
            started=started,
            spawn=lambda coro: self._work.spawn(coro, allocation_id=aid, name="lease renewal"),
            on_lost=lambda cause: self._abort(claim, cause),
        )
        claim = _Claim(
            allocation=allocation,
            lease_id=lease_id,
            lease=lease,
            db_anchor=allocation.updated_at,
            local_anchor=self._clock.monotonic(),
            log=bound,
        )
        self._active[aid] = claim
        self._observer.claimed()
        body = self._work.spawn(self._reconcile(claim), allocation_id=aid, name="claim body")
        claim.task = body
        keeper = self._work.spawn(lease.run(), allocation_id=None, name="lease keeper")
        try:
            try:
                await asyncio.wait({body})
            except asyncio.CancelledError:
                body.cancel()
                raise
            failure = None if body.cancelled() else body.exception()
            if body.cancelled() or isinstance(failure, LeaseLost):
                self._observer.lease_lost()
                cause = claim.lost or failure
                claim.log.info("claim stopped: lease no longer held", reason=str(cause))
            elif failure is not None:
                await self._park_after_error(claim, failure)
        finally:
            keeper.cancel()
            del self._active[aid]

    async def _park_after_error(self, claim: _Claim, error: BaseException) -> None:
        claim.log.error("reconciliation failed", error=f"{type(error).__name__}: {error}")
        if claim.lost is not None:
            return
        failure = Failure("reconcile_error", f"{type(error).__name__}: {error}")
        try:
            await self._finish(
                claim,
                lambda: self._store.park(
                    claim.fence,
                    mode=ParkMode.RETRY_AFTER_ERROR,
                    delay=retry_delay(MAX_BACKOFF_ATTEMPT),
                    failure=failure,
                ),
            )
        except (LeaseLost, OperationTimeout, StoreError) as exc:
            # The row keeps its past schedule; once the lease expires any claimer retries it.
            claim.log.warning("could not park after an error", error=str(exc))

    async def _with_lease(
        self,
        claim: _Claim,
        what: str,
        call: Callable[[HookContext], Coroutine[Any, Any, T]],
        limit: float | None = None,
    ) -> T:
        """Re-check the lease, then run an external call under the claim."""
        try:
            current = await self._op(
                claim, self._store.lease_is_current(claim.fence), "lease check"
            )
        except (OperationTimeout, StoreError) as exc:
            raise LeaseLost(f"the lease could not be confirmed: {exc}") from exc
        if not current:
            raise LeaseLost("the lease is no longer current")
        if claim.lease.expired:
            cause = LeaseLost("the local lease deadline passed")
            self._abort(claim, cause)
            raise cause
        context = HookContext(
            allocation_id=claim.allocation.id,
            generation=claim.allocation.generation,
            lease_id=claim.lease_id,
        )
        return await self._op(claim, call(context), what, limit)

    # -- the state machine -------------------------------------------------------------------------

    def _provisioner_problem(self, allocation: Allocation) -> str | None:
        return provisioner_mismatch(
            provisioner_id=allocation.provisioner_id,
            bound_api_version=allocation.provisioner_api_version,
            bound_fingerprint=allocation.provisioner_binding_fingerprint,
            configured=self._provisioners,
        )

    async def _reconcile(self, claim: _Claim) -> None:
        a = claim.allocation
        self._router.fence(a.id, a.generation)
        if a.status.terminal:
            return
        if a.status in (Status.PROVISIONING, Status.REPLACING, Status.RELEASING):
            settled = await self._op(
                claim, self._ledger.settle_open_effects(claim.fence), "settle open effects"
            )
            if settled:
                claim.log.warning("earlier plugin calls ended without an outcome", count=settled)
        if a.status is Status.ALLOCATED and self._on_initialization_recovery is not None:
            hook = self._on_initialization_recovery
            await self._with_lease(claim, "initialization recovery", hook_call(hook, a))

        problem = self._provisioner_problem(a)
        if problem is not None:
            failed = unavailable_provisioner(a.status, problem)
            if failed is not None:
                await self._fail(claim, Status.PENDING, failed.failure)
            else:
                claim.log.warning("provisioner unavailable; retrying later", problem=problem)
                await self._finish(
                    claim,
                    lambda: self._store.schedule_retry(
                        claim.fence,
                        expected_status=a.status,
                        delay=retry_delay(a.ensure_attempts + a.destroy_attempts),
                        failure=Failure("provisioner_unavailable", problem),
                    ),
                )
            return
        provisioner = self._provisioners[a.provisioner_id]

        step = step_for(a.status, initialization_recorded=a.initialization_lease_id is not None)
        if step is Step.BIND_AND_ENSURE:
            await self._bind_and_ensure(claim, provisioner, replacement=False)
        elif step is Step.REPLACE_UNKNOWN_ENSURE:
            await self._replace_after_failure(
                claim,
                Failure(
                    "ensure_outcome_unknown",
                    "a hub stopped before ensure's acceptance was recorded",
                ),
            )
        elif step is Step.REPLACE_UNCERTAIN_INITIALIZATION:
            await self._replace_after_failure(
                claim,
                Failure(
                    "sidecar_initialization_uncertain",
                    "a previous initialization did not record completion",
                ),
                only_if_initialization_incomplete=True,
            )
        elif step is Step.WAIT_UNTIL_READY:
            await self._wait_until_ready(claim)
        elif step is Step.DESTROY_THEN_REBIND:
            if await self._destroy_current(claim, provisioner):
                await self._bind_and_ensure(claim, provisioner, replacement=True)
        elif step is Step.DESTROY_THEN_RELEASE and await self._destroy_current(claim, provisioner):
            released = await self._write(
                claim, self._store.mark_released(claim.fence), "mark released"
            )
            self._router.retire(released.id, released.generation)
            claim.log.info("released")

    async def _fail(self, claim: _Claim, expected: Status, failure: Failure) -> None:
        failed = await self._write(
            claim,
            self._store.fail_without_infrastructure(
                claim.fence, expected_status=expected, failure=failure
            ),
            "fail",
        )
        self._router.retire(failed.id, failed.generation)
        claim.log.warning("failed", code=failure.code, message=failure.message)

    async def _bind_and_ensure(
        self, claim: _Claim, provisioner: Provisioner, *, replacement: bool
    ) -> None:
        token = self._create_token()
        sidecar_id = self._create_sidecar_id()
        if replacement:
            bind = self._store.bind_replacement_sidecar(
                claim.fence,
                sidecar_id=sidecar_id,
                token_hash=hash_token(token),
                connect_timeout=self.settings.connect_timeout,
            )
        else:
            bind = self._store.bind_initial_sidecar(
                claim.fence,
                sidecar_id=sidecar_id,
                token_hash=hash_token(token),
                connect_timeout=self.settings.connect_timeout,
                api_version=provisioner.api_version,
                binding_fingerprint=provisioner.binding_fingerprint,
            )
        bound = await self._write(claim, bind, "bind sidecar")
        self._router.fence(bound.id, bound.generation)
        await self._accept_ensure(claim, provisioner, token)

    async def _call_plugin(
        self,
        claim: _Claim,
        kind: str,
        call: Callable[[], Coroutine[Any, Any, object]],
        check: Callable[[object], Any],
    ) -> Any:
        """One plugin call, bracketed in the ledger by its intent and its outcome."""
        effect_id = new_effect_id()
        status = claim.allocation.status
        recorded = await self._op(
            claim,
            self._ledger.record_effect(
                claim.fence, effect_id=effect_id, kind=kind, phase=Phase.INTENT, status=status
            ),
            "record intent",
        )
        if not recorded:
            raise LeaseLost(f"{kind} intent: the fence matched nothing")
        started = self._clock.monotonic()
        outcome: EnsureOutcome | DestroyOutcome
        try:
            outcome = check(await self._with_lease(claim, kind, lambda _ctx: call()))
        except (LeaseLost, asyncio.CancelledError):
            # No outcome is written: the next owner records this call as ambiguous.
            raise
        except OperationTimeout:
            outcome = TimedOut()
        except PluginError as exc:
            outcome = Raised(str(exc))
            self._log_plugin_exception(claim, kind)
        except Exception as exc:  # noqa: BLE001 -- any failure of a plugin is an outcome
            outcome = Raised(f"{type(exc).__name__}: {exc}")
            self._log_plugin_exception(claim, kind)
        if not claim.owns():
            # The call came back after the local deadline (the process was paused, say): the
            # deadline wins over whatever the plugin says, and nothing is written. The next
            # owner settles this call as ambiguous.
            cause = claim.lost or LeaseLost(f"{kind} returned after the local lease deadline")
            self._abort(claim, cause)
            raise cause
        duration_ms = (self._clock.monotonic() - started) * 1000
        self._observer.plugin_call(
            claim.allocation.provisioner_id, kind, duration_ms / 1000, type(outcome).__name__
        )
        code, message = _outcome_text(kind, outcome)
        recorded = await self._op(
            claim,
            self._ledger.record_effect(
                claim.fence,
                effect_id=effect_id,
                kind=kind,
                phase=effect_phase(outcome),
                status=status,
                error_code=code,
                message=message,
                duration_ms=duration_ms,
            ),
            "record outcome",
        )
        if not recorded:
            raise LeaseLost(f"{kind} outcome: the fence matched nothing")
        claim.log.info(
            f"{kind} finished", outcome=type(outcome).__name__, duration_ms=round(duration_ms, 1)
        )
        return outcome

    def _log_plugin_exception(self, claim: _Claim, kind: str) -> None:
        """A plugin's exception, with its traceback, for the plugin's author: at warning the
        first time for an allocation (no failed attempt recorded since it was last ready), at
        debug after that, so a plugin that always raises does not flood the log. Called from
        the ``except`` block that caught it."""
        a = claim.allocation
        first = a.ensure_attempts + a.destroy_attempts == 0
        say = claim.log.warning if first else claim.log.debug
        say(
            f"{kind} raised",
            provisioner=a.provisioner_id,
            hint="the traceback is the plugin's; later failures of this allocation log at debug"
            if first
            else None,
            exc_info=True,
        )

    async def _accept_ensure(self, claim: _Claim, provisioner: Provisioner, token: str) -> None:
        a = claim.allocation
        assert a.sidecar_id is not None
        request = EnsureRequest(
            allocation_id=a.id,
            generation=a.generation,
            tenant_id=a.tenant_id,
            session_id=a.session_id,
            spec=a.spec,
            sidecar_id=a.sidecar_id,
            token=token,
            hub_ws_url=self._hub_ws_url,
            ownership=claim.ownership(),
        )
        outcome = await self._call_plugin(
            claim, "ensure", lambda: provisioner.ensure(request), check_ensure_result
        )
        decision = after_ensure(outcome)
        if isinstance(decision, Replace):
            await self._replace_after_failure(claim, decision.failure)
            return
        if isinstance(decision, Fail):
            await self._fail(claim, Status.PROVISIONING, decision.failure)
            return
        await self._write(
            claim,
            self._store.mark_allocated(claim.fence, external_ref=decision.external_ref),
            "mark allocated",
        )
        readiness = await self._readiness(claim)
        if readiness.connected:
            await self._wait_until_ready(claim, readiness)
            return
        # Acceptance and readiness are separate durable steps. Rather than hold a claim slot
        # for the whole connect timeout, park until the connect deadline; the sidecar's
        # connect (recorded on any replica) wakes the allocation, and one recorded since the
        # look above makes the park itself fall through to "due now".
        await self._park_awaiting_connection(claim, readiness)

    async def _readiness(self, claim: _Claim) -> Readiness:
        return await self._op(
            claim,
            self._connections.readiness(claim.target, self.settings.instance_ttl),
            "readiness check",
        )

    async def _park_awaiting_connection(self, claim: _Claim, seen: Readiness) -> None:
        fence = claim.fence
        parked = await self._finish(
            claim,
            lambda: self._store.park(
                fence,
                mode=ParkMode.AWAIT_CONNECTION,
                delay=retry_delay(MAX_BACKOFF_ATTEMPT),
                connection_seq=seen.connection_seq,
            ),
        )
        if parked is not None and parked.connection_seq != seen.connection_seq:
            claim.log.info("a connection event arrived while the claim looked; due now")

    def _seconds_until(self, claim: _Claim, moment: datetime | None) -> float:
        """Seconds from now to ``moment`` on the database clock, estimated from the last row
        the claim wrote or read (no local wall clock involved)."""
        if moment is None:
            return 0.0
        elapsed = self._clock.monotonic() - claim.local_anchor
        db_now = claim.db_anchor + timedelta(seconds=elapsed)
        return (moment - db_now).total_seconds()

    async def _wait_for_connect(
        self, claim: _Claim, target: Target, within: float, remaining: float
    ) -> None:
        if within <= 0:
            # The look-up just before said "not connected" and no time is left to wait.
            raise SidecarNotConnected(
                f"the sidecar did not connect before its deadline ({-remaining:.0f}s ago)"
            )
        await self._with_lease(
            claim,
            "sidecar connection",
            lambda _ctx: self._router.wait_ready(target, within),
            limit=within + self.settings.operation_timeout,
        )

    async def _wait_until_ready(self, claim: _Claim, seen: Readiness | None = None) -> None:
        a = claim.allocation
        target = claim.target
        remaining = self._seconds_until(claim, a.connect_deadline)
        # A readiness look-up that fails is not evidence the sidecar missed its deadline: the
        # error propagates and the allocation is retried without giving up the generation.
        readiness = seen or await self._readiness(claim)
        if not readiness.connected:
            within = max(0.0, min(remaining, self.settings.operation_timeout))
            try:
                await self._wait_for_connect(claim, target, within, remaining)
            except SidecarNotConnected as exc:
                if remaining > within:
                    # The deadline is further away than one wait: give the slot back and come
                    # back at the deadline (or earlier, when the sidecar connects).
                    await self._park_awaiting_connection(claim, readiness)
                    return
                # Fenced on the connection number: a sidecar that connected anywhere since the
                # look above is not abandoned for not connecting.
                await self._replace_after_failure(
                    claim,
                    Failure("sidecar_connect_failed", str(exc)),
                    expected_connection_seq=readiness.connection_seq,
                )
                return
            # A notification is a hint: what counts is the record, and its number.
            readiness = await self._readiness(claim)
            if not readiness.connected:
                await self._park_awaiting_connection(claim, readiness)
                return

        if self._on_ready is not None:
            hook = self._on_ready
            # The marker is durable before the hook runs: a crash inside the hook leaves it for
            # the next claim, which then knows the initialization's outcome is uncertain.
            marked = await self._write(
                claim, self._store.begin_initialization(claim.fence), "begin initialization"
            )
            try:
                await self._with_lease(claim, "on_ready", hook_call(hook, marked))
            except (LeaseLost, asyncio.CancelledError):
                raise
            except (InitializationUncertain, OperationTimeout) as exc:
                # A hook that timed out may still be running, or may have done half its work:
                # its outcome is uncertain, never a clean failure, and the marker stays the
                # evidence until the replacement settles it.
                await self._replace_after_failure(
                    claim,
                    Failure("sidecar_initialization_uncertain", str(exc)),
                    only_if_initialization_incomplete=True,
                )
                return
            except Exception as exc:  # noqa: BLE001 -- any failure of a hook is an outcome
                fence = claim.fence
                failure = Failure("sidecar_initialization_failed", f"{type(exc).__name__}: {exc}")
                claim.log.warning("on_ready hook failed", error=failure.message)
                # No durable counter exists for hook attempts: the capped delay keeps a hook
                # that always fails from becoming a hot loop.
                await self._finish(
                    claim,
                    lambda: self._store.schedule_retry(
                        fence,
                        expected_status=Status.ALLOCATED,
                        delay=retry_delay(MAX_BACKOFF_ATTEMPT),
                        failure=failure,
                        clear_initialization=True,
                    ),
                )
                return

        # Fenced on the connection number seen above: a connect that landed during
        # initialization, on any replica, may be a restarted sidecar whose takeover hid the
        # disconnect, so the write becomes an immediate follow-up instead of "ready".
        fence, seq = claim.fence, readiness.connection_seq
        written = await self._finish(
            claim, lambda: self._store.mark_connection_ready(fence, connection_seq=seq)
        )
        if written is None:
            return
        if written.connection_ready:
            claim.log.info("ready")
        else:
            claim.log.info("a connection event arrived during initialization; following up")

    async def _replace_after_failure(
        self,
        claim: _Claim,
        failure: Failure,
        *,
        only_if_initialization_incomplete: bool = False,
        expected_connection_seq: int | None = None,
    ) -> None:
        a = claim.allocation
        fence = claim.fence
        expected_init = a.initialization_lease_id if only_if_initialization_incomplete else None
        follow_up = False

        async def step() -> None:
            nonlocal follow_up
            if replacement_becomes_release(
                a.status, automatic_recovery=self.settings.automatic_replacement_recovery
            ):
                updated = await self._store.begin_unrecoverable_release(
                    fence,
                    failure=Failure(failure.code, AUTOMATIC_RECOVERY_DISABLED + failure.message),
                    only_if_initialization_incomplete=only_if_initialization_incomplete,
                    expected_initialization_lease_id=expected_init,
                    expected_connection_seq=expected_connection_seq,
                )
            else:
                updated = await self._store.begin_replacement(
                    fence,
                    expected_status=(
                        Status.ALLOCATED if a.status is Status.ALLOCATED else Status.PROVISIONING
                    ),
                    delay=retry_delay(a.ensure_attempts + a.destroy_attempts),
                    failure=failure,
                    only_if_initialization_incomplete=only_if_initialization_incomplete,
                    expected_initialization_lease_id=expected_init,
                    expected_connection_seq=expected_connection_seq,
                )
            if updated is not None:
                self._observer.transition(str(a.status), str(updated.status))
                # Advance the fence before this step settles and the allocation becomes
                # claimable again, so the abandoned sidecar cannot linger connected.
                self._router.fence(updated.id, updated.generation)
                claim.log.warning(
                    "abandoning the sidecar", code=failure.code, to=str(updated.status)
                )
            else:
                follow_up = only_if_initialization_incomplete or expected_connection_seq is not None

        await self._queue_step(claim, step)
        if follow_up:
            # The initialization completed (or its marker changed hands), or a connection was
            # recorded, since this claim looked: retry the ordinary path at once. If the lease
            # was lost instead, this matches nothing.
            await self._finish(
                claim,
                lambda: self._store.schedule_retry(fence, expected_status=a.status, delay=0),
            )

    async def _destroy_current(self, claim: _Claim, provisioner: Provisioner) -> bool:
        """Destroy the bound sidecar; ``True`` when it is gone and the claim may go on."""
        a = claim.allocation
        if a.sidecar_id is None:
            return True
        request = DestroyRequest(
            allocation_id=a.id,
            generation=a.generation,
            sidecar_id=a.sidecar_id,
            external_ref=a.external_ref,
            ownership=claim.ownership(),
        )
        outcome = await self._call_plugin(
            claim, "destroy", lambda: provisioner.destroy(request), check_destroy_result
        )
        decision = after_destroy(outcome)
        if isinstance(decision, Proceed):
            return True
        if isinstance(decision, DestroyFailed):
            failed = await self._write(
                claim,
                self._store.mark_destroy_failed(claim.fence, failure=decision.failure),
                "mark destroy failed",
            )
            self._router.retire(failed.id, failed.generation)
            claim.log.error("destroy failed for good", code=decision.failure.code)
            return False
        fence, status = claim.fence, a.status
        await self._finish(
            claim,
            lambda: self._store.schedule_retry(
                fence,
                expected_status=status,
                delay=retry_delay(a.destroy_attempts),
                attempt=AttemptKind.DESTROY,
                failure=decision.failure,
            ),
        )
        return False

    # -- start-up and repair -----------------------------------------------------------------------

    async def initialize(self) -> None:
        """Start-up repair: fence every active allocation at its generation, treat allocated
        sidecars that hold no live connection as lost, and schedule anything unscheduled.

        Safe to run while sockets are already being accepted and while peers claim: each write
        decides in its own statement (unleased rows only, fenced on the connection number).
        """
        for allocation in await self._store.list_active():
            self._router.fence(allocation.id, allocation.generation)
            if allocation.status is not Status.ALLOCATED and allocation.next_attempt_at is None:
                # Only an unscheduled row is woken: moving an existing schedule earlier would
                # erase a provisioner's backoff on every restart.
                await self._store.wake(allocation.id, allocation.generation)
        await self.repair_unscheduled_connections()

    async def repair_unscheduled_connections(self) -> int:
        """Give allocated rows that read ready, or that nothing would revisit, a connect
        deadline when no live connection record exists; returns how many were repaired."""
        return await self._store.mark_unconnected(
            instance_ttl=self.settings.instance_ttl,
            connect_timeout=self.settings.connect_timeout,
        )


def _outcome_text(kind: str, outcome: object) -> tuple[str | None, str | None]:
    """The ledger's error code and message for a plugin call's outcome."""
    from hubd.plugins.protocol import DestroyRejected, Rejected

    if isinstance(outcome, Rejected | DestroyRejected):
        return outcome.code, outcome.message
    if isinstance(outcome, TimedOut):
        return f"{kind}_timeout", f"{kind} did not finish within operation_timeout"
    if isinstance(outcome, Raised):
        return f"{kind}_failed", outcome.message
    return None, None
