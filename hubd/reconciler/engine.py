"""The reconciler: admits claims, keeps their leases, and repairs state at start-up.

One claim at a time per allocation, at most ``max_concurrent_claims`` at once. A claim owns its
allocation through a lease renewed every ``lease_duration / 3``; every write it makes is fenced by
that lease and the generation it claimed. Each claim runs as a :class:`ClaimRun`
(:mod:`hubd.reconciler.claim`) through the steps of :mod:`hubd.reconciler.steps`; what it writes
is decided in :mod:`hubd.reconciler.decisions` and carried out by
:mod:`hubd.reconciler.executor`.

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
import contextlib
import functools
from collections.abc import Callable, Mapping

import structlog

from hubd.errors import DatabaseUnavailable, LeaseLost, OperationTimeout, StoreError
from hubd.plugins.protocol import Provisioner
from hubd.reconciler.claim import ClaimRun, ClaimServices
from hubd.reconciler.clock import Clock, SystemClock, wait_settled
from hubd.reconciler.decisions import after_error, wake_on_start
from hubd.reconciler.executor import apply
from hubd.reconciler.faults import FaultHook
from hubd.reconciler.lease import LeaseKeeper, LeaseRenewer
from hubd.reconciler.observer import NullObserver, ReconcilerObserver
from hubd.reconciler.settings import Hook, HookContext, ReconcilerSettings
from hubd.reconciler.steps import reconcile
from hubd.reconciler.work import LocalWork
from hubd.routing import Router
from hubd.store.allocations import AllocationStore
from hubd.store.connections import ConnectionStore
from hubd.store.ledger import LedgerStore
from hubd.store.rows import Claimed, InitialBinds
from hubd.tokens import hash_token, new_lease_id, new_sidecar_id, new_token

__all__ = ["HookContext", "Reconciler", "ReconcilerSettings"]

log = structlog.get_logger(__name__)

TENANTS_IN_SIGHT = 60.0
"""Seconds a tenant stays in sight after its last claim here (``Reconciler.rooms``)."""


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
        faults: FaultHook | None = None,
    ) -> None:
        self.settings = settings or ReconcilerSettings()
        self._store = store
        self._router = router
        self._clock = clock or SystemClock()
        self._create_lease_id = create_lease_id
        self._observer: ReconcilerObserver = observer or NullObserver()
        self._active: dict[str, ClaimRun] = {}
        self._work = LocalWork(on_settled)
        self._on_settled = on_settled or (lambda: None)
        self._admitted = 0
        self._claims: set[asyncio.Task[None]] = set()
        # Claims in progress by tenant ('' for none), and when each tenant was last claimed for.
        self._held: dict[str, int] = {}
        self._seen: dict[str, float] = {}
        self._renewer = LeaseRenewer(
            renew_many=lambda leases: store.renew_leases(leases, self.settings.lease_duration),
            clock=self._clock,
            lease_duration=self.settings.lease_duration,
            spawn=functools.partial(self._work.spawn, allocation_id=None),
        )
        self._services = ClaimServices(
            store=store,
            ledger=ledger,
            connections=connections,
            provisioners=provisioners,
            router=router,
            hub_ws_url=hub_ws_url,
            settings=self.settings,
            on_ready=on_ready,
            on_initialization_recovery=on_initialization_recovery,
            clock=self._clock,
            work=self._work,
            observer=self._observer,
            active=self._active,
            create_sidecar_id=create_sidecar_id,
            create_token=create_token,
            faults=faults,
        )

    # -- introspection (metrics, tests) ----------------------------------------------------------

    @property
    def active_claims(self) -> int:
        return len(self._active)

    def leases_held(self) -> dict[str, str]:
        """Allocation → lease id of each claim in progress that still owns its lease by the
        local reckoning."""
        return {aid: claim.lease_id for aid, claim in self._active.items() if claim.owns()}

    @property
    def queue_depth(self) -> int:
        return self._work.queue_depth

    def busy_allocations(self) -> frozenset[str]:
        """Allocations with local work still running; they are excluded from claims."""
        return frozenset(self._active) | self._work.busy()

    async def drain(self) -> None:
        """Wait until every task this reconciler started has settled."""
        await self._work.drain()

    # -- claims ----------------------------------------------------------------------------------

    def _free_slots(self) -> int:
        # Local work that outlived its claim (a late query or plugin call) holds its slot.
        retained = self._work.busy() - frozenset(self._active)
        return max(0, self.settings.max_concurrent_claims - self._admitted - len(retained))

    @property
    def free_capacity(self) -> int:
        """Claims this reconciler may still admit for the tenant holding the most, by which the
        dispatcher sizes its batches; a claim statement offers every free slot to the others."""
        free = self._free_slots()
        if not self._held:
            return free
        busiest = max(self._held, key=self._held.__getitem__)
        room, rooms = self.rooms()
        return min(free, max(0, rooms.get(busiest, free if room is None else room)))

    def rooms(self) -> tuple[int | None, dict[str, int]]:
        """How many more claims each tenant ('' for none) may hold here: the room of a tenant
        not in the mapping, ``None`` for no bound, and the mapping. While another tenant is in
        sight (claimed for within ``TENANTS_IN_SIGHT``), a tenant holds ``tenant_room`` slots
        at most: its burst would otherwise hold every slot, and the other tenant's request
        would wait for one of its claims to end, then share the daemon with all of them."""
        slots = self.settings.max_concurrent_claims
        now = self._clock.monotonic()
        for tenant, at in list(self._seen.items()):
            if now - at > TENANTS_IN_SIGHT:
                del self._seen[tenant]
        if not self._seen or slots < 2:
            return None, {}
        most = self.settings.tenant_room
        return most, {
            tenant: (most if self._seen.keys() - {tenant} else slots) - self._held.get(tenant, 0)
            for tenant in self._seen.keys() | self._held.keys()
        }

    @property
    def holding_back(self) -> bool:
        """Whether slots are kept from a tenant now: two tenants or more are in sight."""
        return len(self.rooms()[1]) > 1

    async def claim_batch(self) -> int:
        """Claim as many due allocations as there is capacity for, in one statement, and start
        a tracked task for each claim; how many were claimed. The tasks run on their own: the
        reconciler's ``on_settled`` callback says when capacity frees up."""
        claimed = await self._claim(self._free_slots(), shared=True)
        now = self._clock.monotonic()
        for row, started, token in claimed:
            self._admitted += 1
            tenant = row.allocation.tenant_id or ""
            self._held[tenant] = self._held.get(tenant, 0) + 1
            self._seen[tenant] = now
            claim = self._work.spawn(
                self._reconcile_claim(row, started, token),
                allocation_id=None,
                name=f"claim {row.allocation.id}",
            )
            self._claims.add(claim)
            claim.add_done_callback(functools.partial(self._claim_ended, tenant))
        return len(claimed)

    def _claim_ended(self, tenant: str, task: asyncio.Task[None]) -> None:
        self._claims.discard(task)
        self._release_admission()
        if held := self._held.pop(tenant) - 1:
            self._held[tenant] = held
        # Only now is the allocation out of the active set (and so claimable here), and its slot
        # free: a wake-up sent when its local work settled came a moment too early for both.
        self._on_settled()

    async def wait_claims(self) -> None:
        """Wait until every claim started by :meth:`claim_batch` has ended."""
        while self._claims:
            await asyncio.wait(set(self._claims))

    def cancel_claims(self) -> int:
        """Cancel the claims still in progress (their leases expire on their own); how many."""
        for task in self._claims:
            task.cancel()
        return len(self._claims)

    async def reconcile_next(self) -> bool:
        """Claim one due allocation and reconcile it to the end of its claim; ``False`` when
        there was nothing to do or no capacity."""
        if self.free_capacity < 1:
            return False
        self._admitted += 1
        try:
            claimed = await self._claim(1)
            if not claimed:
                return False
            await self._reconcile_claim(*claimed[0])
            return True
        finally:
            self._admitted -= 1

    async def _claim(
        self, capacity: int, *, shared: bool = False
    ) -> list[tuple[Claimed, float, str | None]]:
        """Lease up to ``capacity`` due allocations (``shared``: each tenant within its room);
        each with its lease id, the moment the claim statement started (the lease's local
        deadline counts from there) and the raw token of the identity it bound, if any."""
        if capacity < 1:
            return []
        lease_ids = [self._create_lease_id() for _ in range(capacity)]
        # An identity per slot, for the pending rows among those leased: binding them in the
        # claim statement saves each its own bind, a round trip and a commit before its ensure.
        # The tokens of slots that lease no pending row are never stored anywhere.
        s = self._services
        tokens = {s.create_sidecar_id(): s.create_token() for _ in range(capacity)}
        binds = InitialBinds(
            sidecar_ids=list(tokens),
            token_hashes=[hash_token(token) for token in tokens.values()],
            provisioners={
                pid: (p.api_version, p.binding_fingerprint) for pid, p in s.provisioners.items()
            },
            ready_when={pid: self.settings.ready_when_of(pid) for pid in s.provisioners},
            connect_timeout=self.settings.connect_timeout,
        )
        room, rooms = self.rooms() if shared else (None, None)
        self._admitted += capacity
        query: asyncio.Task[list[Claimed]] | None = None
        try:
            started = self._clock.monotonic()
            query = self._work.spawn(
                self._store.claim_due(
                    lease_ids=lease_ids,
                    lease_duration=self.settings.lease_duration,
                    exclude=self.busy_allocations(),
                    binds=binds,
                    room=room,
                    rooms=rooms,
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
            rows = query.result()
            self._observer.claim_statement(len(rows))
            return [
                (
                    row,
                    started,
                    None
                    if row.ensure_intent is None or row.allocation.sidecar_id is None
                    else tokens[row.allocation.sidecar_id],
                )
                for row in rows
            ]
        finally:
            if query is None or query.done():
                self._admitted -= capacity
            else:
                # A claim query that outlived its limit still holds capacity until it settles.
                query.add_done_callback(lambda _: self._release_admission(capacity))

    def _release_admission(self, count: int = 1) -> None:
        self._admitted -= count

    async def reconcile_until_idle(self, max_iterations: int = 100) -> int:
        done = 0
        while done < max_iterations and await self.reconcile_next():
            done += 1
        return done

    async def _reconcile_claim(
        self, claimed: Claimed, started: float, token: str | None = None
    ) -> None:
        allocation, lease_id = claimed.allocation, claimed.lease_id
        bound = log.bind(
            allocation_id=allocation.id, generation=allocation.generation, lease_id=lease_id
        )
        aid = allocation.id
        if aid in self._active or self._work.is_busy(aid):
            # Local work started after this claim's exclusion snapshot. Give the lease back
            # rather than put another write behind that work; the row is claimable again once
            # the work settles, which wakes the claimers.
            bound.info("claim_raced_local_work")
            with contextlib.suppress(StoreError):
                await self._store.drop_lease(aid, lease_id)
            return

        def lost(cause: LeaseLost) -> None:
            # The claim is built below, around this keeper; the keeper reports a loss only
            # once it runs, and by then the claim exists.
            claim.abort(cause)

        lease = LeaseKeeper(
            allocation_id=aid,
            lease_id=lease_id,
            clock=self._clock,
            lease_duration=self.settings.lease_duration,
            started=started,
            on_lost=lost,
        )
        claim = ClaimRun(
            services=self._services,
            allocation=allocation,
            lease_id=lease_id,
            lease=lease,
            db_anchor=allocation.updated_at,
            local_anchor=self._clock.monotonic(),
            log=bound,
            open_effects=claimed.open_effects,
            destroy_intent=claimed.destroy_intent,
            ensure_intent=None if token is None else claimed.ensure_intent,
            bound_token=token,
        )
        self._active[aid] = claim
        self._renewer.register(lease)
        self._observer.claimed()
        # The claim's steps run in this task, and the lease's deadline is a timer: a task for
        # each cost more than a quick claim's own work. A lost lease cancels this task (see
        # ClaimRun.abort), which is told apart from a cancellation from outside (shutdown).
        claim.task = asyncio.current_task()
        lease.watch()
        try:
            failure: BaseException | None = None
            try:
                await reconcile(claim)
            except asyncio.CancelledError as cancelled:
                if not claim.uncancel_abort():
                    raise
                failure = cancelled
            except Exception as exc:  # noqa: BLE001 -- every failure parks the row or is a loss
                failure = exc
            finally:
                # From here on a loss only marks the claim lost: nothing is left to interrupt.
                claim.task = None
            if isinstance(failure, LeaseLost | asyncio.CancelledError):
                self._observer.lease_lost()
                cause = claim.lost or failure
                claim.log.info("claim_stopped_lease_lost", reason=str(cause))
                await self._give_back(claim)
            elif failure is not None:
                await self._park_after_error(claim, failure)
            elif claim.fenced_out:
                await self._give_back(claim)
        finally:
            lease.stop()
            self._renewer.unregister(lease)
            del self._active[aid]

    async def _give_back(self, claim: ClaimRun) -> None:
        """End the lease of a claim whose writes no longer match. A release keeps the lease of
        the claim it fences, so the row would otherwise wait out the lease (and then the poll)
        before anyone destroys. Nothing of the claim runs any more, so ending the lease now is
        what its expiry would do; while a plugin call of it still runs, the lease stays that
        call's bound."""
        aid = claim.allocation.id
        if self._work.is_busy(aid):
            return
        with contextlib.suppress(StoreError):
            if await self._store.give_back_lease(aid, claim.lease_id):
                claim.log.info("lease_given_back")

    async def _park_after_error(self, claim: ClaimRun, error: BaseException) -> None:
        # A database that cannot answer is an expected condition, handled by parking the row
        # (or letting its lease lapse): a warning. Anything else is a fault worth an error.
        report = claim.log.warning if isinstance(error, DatabaseUnavailable) else claim.log.error
        report("reconciliation_failed", error=f"{type(error).__name__}: {error}")
        if claim.lost is not None:
            return
        try:
            await apply(claim, after_error(error))
        except (LeaseLost, OperationTimeout, StoreError) as exc:
            # The row keeps its past schedule; once the lease expires any claimer retries it.
            claim.log.warning("park_after_error_failed", error=str(exc))

    # -- start-up and repair -----------------------------------------------------------------------

    async def initialize(self) -> None:
        """Start-up repair: fence every active allocation at its generation, treat allocated
        sidecars that hold no live connection as lost, and schedule anything unscheduled. When
        no peer is alive, every unconnected sidecar gets the restart window from now: a stop,
        however long, is not a failure of the sidecars that waited it out.

        Safe to run while sockets are already being accepted and while peers claim: each write
        decides in its own statement (unleased rows only, fenced on the connection number).
        """
        for allocation in await self._store.list_active():
            self._router.fence(allocation.id, allocation.generation)
            if wake_on_start(allocation):
                await self._store.wake(allocation.id, allocation.generation)
        await self.repair_unscheduled_connections()
        reopened = await self._store.open_reconnect_windows(
            instance_ttl=self.settings.instance_ttl,
            window=max(self.settings.restart_window, self.settings.connect_timeout),
        )
        if reopened:
            log.info("reconnect_windows_opened", count=reopened)

    async def repair_unscheduled_connections(self) -> int:
        """Give allocated rows that read ready, or that nothing would revisit, a connect
        deadline when no live connection record exists; returns how many were repaired."""
        return await self._store.mark_unconnected(
            instance_ttl=self.settings.instance_ttl,
            connect_timeout=self.settings.connect_timeout,
        )
