"""A scripted provisioner plugin, a router that writes real connection records, and a
reconciler wired to the real store for tests; :class:`ReconcilerRig` holds them together for one
test, with the set-ups tests share (a claim held inside ensure, an allocation driven to ready)."""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Awaitable, Callable
from typing import Any

import attrs

from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRejected,
    DestroyRequest,
    EnsureRequest,
    Rejected,
)
from hubd.reconciler.clock import Clock
from hubd.reconciler.engine import Reconciler
from hubd.reconciler.faults import FaultHook
from hubd.reconciler.settings import Hook, ReconcilerSettings
from hubd.routing import MemoryRouter, Target
from hubd.server.sockets import new_connection_id
from hubd.store import Allocation, AllocationStore, Database, LedgerStore, Status
from hubd.store.connection_values import RecordOutcome
from hubd.store.connections import ConnectionStore
from hubd.store.instances import InstanceStore
from tests.polling import eventually

Behaviour = Callable[[Any], Awaitable[object]]

SETTINGS = ReconcilerSettings(
    lease_duration=6.0, connect_timeout=30.0, operation_timeout=1.0, max_concurrent_claims=4
)


def accept(external_ref: str | None = "ref-1") -> Behaviour:
    async def run(_request: Any) -> object:
        return Accepted(external_ref)

    return run


def reject(code: str, *, retryable: bool) -> Behaviour:
    async def run(_request: Any) -> object:
        return Rejected(code=code, message=f"{code} happened", retryable=retryable)

    return run


def reject_destroy(code: str, *, retryable: bool) -> Behaviour:
    async def run(_request: Any) -> object:
        return DestroyRejected(code=code, message=f"{code} happened", retryable=retryable)

    return run


def destroyed() -> Behaviour:
    async def run(_request: Any) -> object:
        return Destroyed()

    return run


def fail(exc: BaseException) -> Behaviour:
    async def run(_request: Any) -> object:
        # Each raise starts a fresh traceback: re-raising one object would chain every earlier
        # raise's frames onto it, and a test that logs each one would slow with every retry.
        raise exc.with_traceback(None)

    return run


def garbage(value: object) -> Behaviour:
    async def run(_request: Any) -> object:
        return value

    return run


class Gate:
    """A plugin call that blocks until released; records that it started and how it ended."""

    def __init__(
        self,
        result: object = None,
        *,
        ignore_cancel: bool = False,
        release: asyncio.Event | None = None,
    ) -> None:
        self.started = asyncio.Event()
        self.release = release or asyncio.Event()
        self.cancelled = asyncio.Event()
        self.finished = asyncio.Event()
        self.result = result if result is not None else Accepted("gated")
        self.ignore_cancel = ignore_cancel

    async def __call__(self, _request: Any) -> object:
        self.started.set()
        try:
            while True:
                try:
                    await self.release.wait()
                    return self.result
                except asyncio.CancelledError:
                    self.cancelled.set()
                    if not self.ignore_cancel:
                        raise
        finally:
            self.finished.set()


class ScriptedProvisioner:
    """A provisioner plugin whose every call follows a script (then a default)."""

    def __init__(self, provisioner_id: str = "fake", api_version: str = "1") -> None:
        self.id = provisioner_id
        self.api_version = api_version
        self.binding_fingerprint = "fp"
        self.ensure_script: collections.deque[Behaviour] = collections.deque()
        self.destroy_script: collections.deque[Behaviour] = collections.deque()
        self.default_ensure: Behaviour = accept()
        self.default_destroy: Behaviour = destroyed()
        self.ensure_calls: list[EnsureRequest] = []
        self.destroy_calls: list[DestroyRequest] = []

    async def ensure(self, request: EnsureRequest) -> Any:
        self.ensure_calls.append(request)
        behaviour = self.ensure_script.popleft() if self.ensure_script else self.default_ensure
        return await behaviour(request)

    async def destroy(self, request: DestroyRequest) -> Any:
        self.destroy_calls.append(request)
        behaviour = self.destroy_script.popleft() if self.destroy_script else self.default_destroy
        return await behaviour(request)


class RecordingRouter(MemoryRouter):
    """A router without sockets that writes connection records exactly as the websocket
    router does (the same statements), on behalf of one hub instance. ``connect`` and
    ``disconnect`` stand for a sidecar's socket opening and closing on that instance."""

    def __init__(
        self, db: Database, *, instance_id: str = "in_test", ready_on_connect: bool = False
    ) -> None:
        super().__init__()
        self.instance_id = instance_id
        self.connections = ConnectionStore(
            db, instance_id=instance_id, ready_on_connect=ready_on_connect
        )
        self._instances = InstanceStore(db)
        self._db = db
        self.current: dict[str, tuple[Target, str]] = {}
        """Allocation id → the target and connection id of the socket open here."""

    async def heartbeat(self) -> None:
        await self._instances.register(self.instance_id, "test-host", 1, None)

    async def connect(self, target: Target) -> RecordOutcome:
        """A sidecar of ``target`` opens a socket here (taking over any older one)."""
        await self.heartbeat()
        async with self._db.pool.acquire() as conn:
            sidecar_id = await conn.fetchval(
                "SELECT sidecar_id FROM hubd_allocations WHERE id = $1", target.allocation_id
            )
        connection_id = new_connection_id()
        record = await self.connections.record(connection_id, target, sidecar_id or "sc_none")
        if record.outcome is RecordOutcome.RECORDED:
            self.current[target.allocation_id] = (target, connection_id)
            self.notify_connected(target)
        return record.outcome

    async def disconnect(self, target: Target, *, connect_timeout: float = 30.0) -> bool:
        """The socket of ``target`` open here closes; ``True`` if its record was current."""
        held = self.current.get(target.allocation_id)
        if held is None or held[0] != target:
            return False
        del self.current[target.allocation_id]
        return await self.connections.disconnect(
            target.allocation_id, held[1], connect_timeout=connect_timeout
        )

    def connected(self) -> set[Target]:
        return {target for target, _ in self.current.values()}


def make_reconciler(
    db: Database,
    router: MemoryRouter,
    provisioner: ScriptedProvisioner | None,
    *,
    instance_id: str = "in_test",
    settings: ReconcilerSettings = SETTINGS,
    on_ready: Hook | None = None,
    on_initialization_recovery: Hook | None = None,
    clock: Clock | None = None,
    faults: FaultHook | None = None,
) -> Reconciler:
    return Reconciler(
        store=AllocationStore(db, instance_id=instance_id),
        ledger=LedgerStore(db, instance_id=instance_id),
        connections=ConnectionStore(db, instance_id=instance_id),
        provisioners={provisioner.id: provisioner} if provisioner is not None else {},
        router=router,
        hub_ws_url="ws://127.0.0.1:1",
        settings=settings,
        on_ready=on_ready,
        on_initialization_recovery=on_initialization_recovery,
        clock=clock,
        faults=faults,
    )


async def poll_until(
    check: Callable[[], Awaitable[bool]], *, within: float = 10.0, every: float = 0.02
) -> None:
    """Poll ``check`` until it is true; fail the test when ``within`` seconds pass first."""
    await eventually(check, within=within, every=every)


@attrs.frozen(kw_only=True)
class BlockedClaim:
    """A claim held inside ensure: what it claimed, the gate holding its ensure, and the task
    running the claim (it answers what ``reconcile_next`` answers)."""

    allocation: Allocation
    gate: Gate
    task: asyncio.Task[bool]


@attrs.define(eq=False, kw_only=True)
class ReconcilerRig:
    """One test's reconciler on the test's database: its store and ledger, a recording router,
    a scripted provisioner (``fake``), and :attr:`reconciler` over them with :data:`SETTINGS`,
    made on first use; :meth:`make` makes another over the same router and provisioner."""

    db: Database
    database_url: str
    store: AllocationStore
    ledger: LedgerStore
    router: RecordingRouter = attrs.field(
        init=False, default=attrs.Factory(lambda rig: RecordingRouter(rig.db), takes_self=True)
    )
    provisioner: ScriptedProvisioner = attrs.field(init=False, factory=ScriptedProvisioner)

    @functools.cached_property
    def reconciler(self) -> Reconciler:
        return self.make()

    def make(self, **options: Any) -> Reconciler:
        """A reconciler over the rig's router and provisioner; ``options`` as
        :func:`make_reconciler` takes them."""
        return make_reconciler(self.db, self.router, self.provisioner, **options)

    async def effects(self, allocation_id: str, kind: str) -> list[str]:
        """The phases of the ledger rows of the ``kind`` plugin calls, oldest first."""
        return [str(e.phase) for e in await self.ledger.history(allocation_id) if e.kind == kind]

    async def connect(self, target: Target) -> None:
        """A sidecar of ``target`` connects: its record is written, as the websocket router
        writes it, and any reconciler reads it from the database."""
        assert await self.router.connect(target) is RecordOutcome.RECORDED

    async def allocated_and_connected(self, reconciler: Reconciler | None = None) -> Allocation:
        """A new allocation ensured and parked, whose sidecar has just connected (not yet
        ready)."""
        allocation = await self.store.request(provisioner_id="fake")
        assert await (reconciler or self.reconciler).reconcile_next()
        await self.connect(Target(allocation.id, 1))
        return allocation

    async def after_on_ready(self, on_ready: Hook) -> Allocation:
        """A new allocation whose sidecar connected, claimed by a reconciler that runs
        ``on_ready``: the row as that claim left it."""
        reconciler = self.make(on_ready=on_ready)
        allocation = await self.allocated_and_connected(reconciler)
        assert await reconciler.reconcile_next()
        return await self.store.get(allocation.id)

    async def to_ready(self, reconciler: Reconciler | None = None) -> Allocation:
        """A new allocation driven to ready: ensure accepted, parked, sidecar connects, marked
        ready."""
        claims = reconciler or self.reconciler
        allocation = await self.store.request(provisioner_id="fake")
        assert await claims.reconcile_next()
        parked = await self.store.get(allocation.id)
        assert parked.status is Status.ALLOCATED
        await self.connect(Target(parked.id, parked.generation))
        assert await claims.reconcile_next()
        ready = await self.store.get(allocation.id)
        assert ready.ready
        return ready

    async def blocked_in_ensure(
        self, reconciler: Reconciler | None = None, gate: Gate | None = None
    ) -> BlockedClaim:
        """A new allocation whose claim by ``reconciler`` is inside ensure, held there by
        ``gate`` (a plain :class:`Gate` by default) until the test releases it."""
        gate = gate or Gate()
        self.provisioner.ensure_script.append(gate)
        allocation = await self.store.request(provisioner_id="fake")
        task = asyncio.create_task((reconciler or self.reconciler).reconcile_next())
        await gate.started.wait()
        return BlockedClaim(allocation=allocation, gate=gate, task=task)
