"""Two (or more) replicas in one test: each with its own instance row, connection store, socket
router, websocket server, reconciler and LISTEN connection, all on one database. Stores can be
paused at a named point, so a test can hold one replica's write while another replica acts.
:class:`ReplicaRig` holds one test's database, its sockets and the set-ups tests share."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
from websockets.asyncio.client import ClientConnection

from hubd.daemon.metrics import Metrics
from hubd.daemon.running import wake_listener
from hubd.daemon.wakeups import NotificationListener
from hubd.plugins.protocol import EnsureRequest
from hubd.reconciler.engine import Reconciler
from hubd.reconciler.settings import Hook, ReconcilerSettings
from hubd.server import SidecarServer, SocketRouter
from hubd.store import Allocation, AllocationStore, Database, Fence, LedgerStore
from hubd.store.channels import read_notice_key
from hubd.store.connections import ConnectionStore
from hubd.store.instances import InstanceStore
from hubd.store.transitions import Transition
from tests.reconcilerkit import ScriptedProvisioner
from tests.wskit import Sidecar, dial, welcome_of

SETTINGS = ReconcilerSettings(
    lease_duration=20, connect_timeout=60, operation_timeout=5, max_concurrent_claims=4
)


class PausePoint:
    """Holds the next call that reaches it until the test lets it go."""

    def __init__(self) -> None:
        self.armed = False
        self.reached = asyncio.Event()
        self.proceed = asyncio.Event()

    def arm(self) -> PausePoint:
        self.armed = True
        return self

    async def __call__(self) -> None:
        if self.armed:
            self.armed = False
            self.reached.set()
            await self.proceed.wait()


@attrs.define
class Pauses:
    points: dict[str, PausePoint] = attrs.field(factory=dict)

    def __getitem__(self, name: str) -> PausePoint:
        return self.points.setdefault(name, PausePoint())

    async def at(self, name: str) -> None:
        await self[name]()


class PausingConnections(ConnectionStore):
    """The real connection store; ``pauses['disconnect']`` holds a call just before its
    statement runs, ``pauses['admitted']`` holds an admission's answer just after its statement
    committed (the replica froze before acting on it)."""

    def __init__(self, db: Database, *, instance_id: str) -> None:
        super().__init__(db, instance_id=instance_id)
        self.pauses = Pauses()

    async def disconnect_many(self, closed: Any, **kw: Any) -> Any:
        # Every disconnect goes through here, the router's batches and single calls alike.
        await self.pauses.at("disconnect")
        return await super().disconnect_many(closed, **kw)

    async def admit_many(self, admissions: Any) -> Any:
        answers = await super().admit_many(admissions)
        await self.pauses.at("admitted")
        return answers


class PausingAllocations(AllocationStore):
    """The real allocation store; ``pauses['park' | 'mark_ready']`` hold the write just before
    it runs."""

    def __init__(self, db: Database, *, instance_id: str) -> None:
        super().__init__(db, instance_id=instance_id)
        self.pauses = Pauses()

    async def write(self, fence: Fence, transition: Transition) -> Allocation | None:
        pause = {"park": "park", "mark_connection_ready": "mark_ready"}.get(transition.name)
        if pause is not None:
            await self.pauses.at(pause)
        return await super().write(fence, transition)


@attrs.define(eq=False)
class Replica:
    name: str
    store: PausingAllocations
    connections: PausingConnections
    router: SocketRouter
    server: SidecarServer
    reconciler: Reconciler
    provisioner: ScriptedProvisioner
    listener: NotificationListener
    metrics: Metrics
    """What the replica's wake-up listener counts (remote closes, forged notices)."""

    @property
    def url(self) -> str:
        return self.server.url + "/v1/sidecars/connect"


def sidecar_of(request: EnsureRequest) -> Sidecar:
    """The identity a provisioner was handed, as the sidecar it starts would use it."""
    return Sidecar(
        allocation_id=request.allocation_id,
        sidecar_id=request.sidecar_id,
        generation=request.generation,
        token=request.token,
    )


@asynccontextmanager
async def replica(
    db: Database,
    database_url: str,
    name: str,
    *,
    provisioner: ScriptedProvisioner | None = None,
    on_ready: Hook | None = None,
    settings: ReconcilerSettings = SETTINGS,
) -> AsyncIterator[Replica]:
    """One running replica; it stops (sockets closed with 1001) when the block ends."""
    await InstanceStore(db).register(name, "localhost", 1, None)
    connections = PausingConnections(db, instance_id=name)
    router = SocketRouter(
        connections,
        notice_key=await read_notice_key(db),
        instance_ttl=settings.instance_ttl,
        connect_timeout=settings.connect_timeout,
        event_timeout=5,
    )
    server = SidecarServer(router=router, connections=connections, host="127.0.0.1", port=0)
    provisioner = provisioner or ScriptedProvisioner()
    store = PausingAllocations(db, instance_id=name)
    async with server:
        reconciler = Reconciler(
            store=store,
            ledger=LedgerStore(db, instance_id=name),
            connections=connections,
            provisioners={provisioner.id: provisioner},
            router=router,
            hub_ws_url=server.url,
            settings=settings,
            on_ready=on_ready,
        )

        # Wired to the router as a daemon wires it; no wake-ups: the tests drive the claims.
        metrics = Metrics()
        listener = wake_listener(
            dsn=database_url,
            db=db,
            router=router,
            metrics=metrics,
            on_wake=lambda: None,
            on_reconnected=lambda: None,
            poll_interval=5.0,
        )
        listening = asyncio.create_task(listener.run(), name=f"listener {name}")
        try:
            await listener.up.wait()
            yield Replica(
                name=name,
                store=store,
                connections=connections,
                router=router,
                server=server,
                reconciler=reconciler,
                provisioner=provisioner,
                listener=listener,
                metrics=metrics,
            )
        finally:
            listening.cancel()
            await asyncio.gather(listening, return_exceptions=True)
            await reconciler.drain()


@attrs.define(eq=False, kw_only=True)
class ReplicaRig:
    """One test's replicas on the test's database, with its store and ledger; the sidecar
    sockets the test opens stay open until ``exits`` closes, after the test."""

    db: Database
    database_url: str
    store: AllocationStore
    ledger: LedgerStore
    exits: AsyncExitStack

    def replica(self, name: str, **options: Any) -> AbstractAsyncContextManager[Replica]:
        """One running replica named ``name``; ``options`` as :func:`replica` takes them."""
        return replica(self.db, self.database_url, name, **options)

    @asynccontextmanager
    async def pair(
        self, *, on_ready: Hook | None = None, peer_on_ready: Hook | None = None
    ) -> AsyncIterator[tuple[Replica, Replica]]:
        """Replicas ``hubA`` (running ``on_ready``) and ``hubB`` (running ``peer_on_ready``),
        stopped in turn when the block ends."""
        async with (
            self.replica("hubA", on_ready=on_ready) as a,
            self.replica("hubB", on_ready=peer_on_ready) as b,
        ):
            yield a, b

    async def kinds(self, allocation_id: str) -> list[str]:
        """The kinds of the allocation's ledger rows, oldest first."""
        return [entry.kind for entry in await self.ledger.history(allocation_id)]

    async def open_socket(self, hub: Replica, sidecar: Sidecar) -> ClientConnection:
        """A socket of ``sidecar`` on ``hub``, welcomed."""
        ws: ClientConnection = await self.exits.enter_async_context(
            dial(hub.url, sidecar.headers())
        )
        assert (await welcome_of(ws))["type"] == "welcome"
        return ws

    async def ready_on(
        self, claimer: Replica, holder: Replica
    ) -> tuple[Allocation, Sidecar, ClientConnection]:
        """A new allocation ensured by ``claimer``, its sidecar's socket on ``holder``,
        ready."""
        allocation = await claimer.store.request(provisioner_id="fake")
        assert await claimer.reconciler.reconcile_next()
        sidecar = sidecar_of(claimer.provisioner.ensure_calls[-1])
        ws = await self.open_socket(holder, sidecar)
        assert await claimer.reconciler.reconcile_next()
        ready = await claimer.store.get(allocation.id)
        assert ready.ready
        return ready, sidecar, ws

    async def connect_before_the_park(
        self, claimer: Replica, holder: Replica
    ) -> tuple[Allocation, asyncio.Task[bool]]:
        """A new allocation, and the task of its claim by ``claimer``: the claim was held just
        before it parks until the allocation's sidecar was welcomed on ``holder``, and goes on
        from there."""
        allocation = await self.store.request(provisioner_id="fake")
        park = claimer.store.pauses["park"].arm()
        claim = asyncio.create_task(claimer.reconciler.reconcile_next())
        await park.reached.wait()
        await self.open_socket(holder, sidecar_of(claimer.provisioner.ensure_calls[-1]))
        park.proceed.set()
        return allocation, claim


async def until(check: Callable[[], Awaitable[bool]], within: float = 15.0) -> None:
    from tests.polling import eventually

    await eventually(check, within=within, every=0.02)
