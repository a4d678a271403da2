"""A seeded simulation of two replicas on one real database, with faults landed at every step
boundary of a claim (:mod:`hubd.reconciler.faults`) and of a connection event.

One seed fixes the whole run: the schedule of requests, releases, claims, connects, disconnects
and passing time, and the fault (if any) at every boundary. The run is sequential (one step at a
time, each to its end) so the same seed replays the same history; only the database's own clock
differs between replays. After the schedule, faults stop and the world is driven to convergence:
every sidecar the plugin started at its allocation's current generation keeps dialling, and time
passes for every row until each allocation is ready or released as asked.

The oracle trusts committed data only: the observer triggers of :mod:`tests.faultkit`, the rows,
and the plugin's own record of what it started and stopped (a stand-in for the external system).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import random
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

import attrs

from hubd.errors import DatabaseUnavailable
from hubd.liveness import swept_reconnect_window
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRejected,
    DestroyRequest,
    EnsureRequest,
    Rejected,
)
from hubd.reconciler.clock import ManualClock
from hubd.reconciler.engine import Reconciler
from hubd.reconciler.faults import Boundary, Site
from hubd.reconciler.settings import HookContext, ReconcilerSettings
from hubd.routing import Target
from hubd.store import Allocation, AllocationStore, Database, LedgerStore, Status
from hubd.store.connection_values import RecordOutcome
from hubd.store.connections import ConnectionStore
from tests.faultkit import violations
from tests.pgtime import age_row, expire_lease
from tests.reconcilerkit import RecordingRouter

SETTINGS = ReconcilerSettings(
    lease_duration=60,
    connect_timeout=30,
    operation_timeout=0.2,
    max_concurrent_claims=4,
    automatic_replacement_recovery=True,
)


class Fault(enum.Enum):
    CRASH = "crash"
    DATABASE_UNAVAILABLE = "database unavailable"
    PAUSE = "pause past the lease"
    PLUGIN_ERROR = "plugin error"
    PLUGIN_TIMEOUT = "plugin timeout"


class Event(enum.Enum):
    """Boundaries of connection events, on the replica that holds the socket."""

    CONNECT = "connect"
    DISCONNECT = "disconnect"


CLAIM_FAULTS = (Fault.CRASH, Fault.DATABASE_UNAVAILABLE, Fault.PAUSE)
PLUGIN_FAULTS = (*CLAIM_FAULTS, Fault.PLUGIN_ERROR, Fault.PLUGIN_TIMEOUT)
EVENT_FAULTS = (Fault.CRASH, Fault.DATABASE_UNAVAILABLE)


def expected_pairs() -> set[tuple[str, Fault]]:
    """Every (boundary, fault) pair a large enough seed set must exercise."""
    pairs = {(b.value, f) for b in Boundary for f in CLAIM_FAULTS}
    pairs |= {(Boundary.BEFORE_PLUGIN.value, f) for f in PLUGIN_FAULTS}
    pairs |= {(e.value, f) for e in Event for f in EVENT_FAULTS}
    return pairs


def faults_at(boundary: str) -> tuple[Fault, ...]:
    if boundary == Boundary.BEFORE_PLUGIN.value:
        return PLUGIN_FAULTS
    if boundary in {e.value for e in Event}:
        return EVENT_FAULTS
    return CLAIM_FAULTS


# -- the external system and the plugin ------------------------------------------------------


@attrs.define
class FakeSidecar:
    allocation_id: str
    generation: int
    sidecar_id: str
    alive: bool = True


@attrs.define
class World:
    """What the plugin started and stopped, and every effect made by a claim that the database
    no longer considered the owner."""

    db: Database
    sidecars: dict[str, FakeSidecar] = attrs.field(factory=dict)
    late_effects: list[str] = attrs.field(factory=list)

    async def owner_is_current(self, allocation_id: str, generation: int, sidecar_id: str) -> bool:
        async with self.db.pool.acquire() as conn:
            return bool(
                await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM hubd_allocations WHERE id = $1 "
                    "AND generation = $2 AND sidecar_id = $3 "
                    "AND lease_expires_at > clock_timestamp())",
                    allocation_id,
                    generation,
                    sidecar_id,
                )
            )

    def live(self, allocation_id: str) -> list[FakeSidecar]:
        return [s for s in self.sidecars.values() if s.alive and s.allocation_id == allocation_id]


Behaviour = Callable[[], Awaitable[None]]


class SimProvisioner:
    """A plugin that checks ownership right before each effect, as docs/plugins.md asks, and
    records in :class:`World` whether the database agreed at that moment."""

    id = "fake"
    api_version = "1"
    binding_fingerprint = "fp"

    def __init__(self, world: World, clock: ManualClock) -> None:
        self.world = world
        self.clock = clock
        self.next_call: Behaviour | None = None
        """A fault for the next call: runs before the call does anything."""

    async def _prelude(self) -> None:
        behaviour, self.next_call = self.next_call, None
        if behaviour is not None:
            await behaviour()

    async def ensure(self, request: EnsureRequest) -> object:
        await self._prelude()
        if not request.ownership.still_owned():
            return Rejected(code="claim_lost", message="not owned", retryable=True)
        await self._effect("ensure", request)
        self.world.sidecars[request.sidecar_id] = FakeSidecar(
            request.allocation_id, request.generation, request.sidecar_id
        )
        return Accepted(
            request.sidecar_id,
            endpoint=f"sim://{request.sidecar_id}",
            metadata={"generation": request.generation},
        )

    async def destroy(self, request: DestroyRequest) -> object:
        await self._prelude()
        if not request.ownership.still_owned():
            return DestroyRejected(code="claim_lost", message="not owned", retryable=True)
        await self._effect("destroy", request)
        sidecar = self.world.sidecars.get(request.sidecar_id)
        if sidecar is not None:
            sidecar.alive = False
        return Destroyed()

    async def _effect(self, kind: str, request: EnsureRequest | DestroyRequest) -> None:
        """The database's view at the moment of the effect: the claim must still own it."""
        aid, generation = request.allocation_id, request.generation
        if not await self.world.owner_is_current(aid, generation, request.sidecar_id):
            self.world.late_effects.append(f"{kind} {aid} gen {generation}")

    def fail_next(self) -> None:
        async def fail() -> None:
            raise RuntimeError("simulated plugin failure")

        self.next_call = fail

    def time_out_next(self, limit: float) -> None:
        clock = self.clock

        async def hang() -> None:
            # Wait for the claim's timer on this call to start on the manual clock, then move
            # past it: the call is abandoned as timed out and cancelled here.
            await clock.next_sleeper(clock.monotonic() + limit)
            clock.advance(limit + 0.01)
            await asyncio.Event().wait()

        self.next_call = hang


# -- the fault policy ------------------------------------------------------------------------


@attrs.define
class Coverage:
    """How often each boundary was reached, and each (boundary, fault) pair landed."""

    pairs: collections.Counter[tuple[str, Fault]] = attrs.field(factory=collections.Counter)
    boundaries: collections.Counter[str] = attrs.field(factory=collections.Counter)
    stopped_judged: int = 0
    """Healthy allocations of a stopped replica judged at its resumption, with time passed."""

    def saw(self, boundary: str) -> None:
        self.boundaries[boundary] += 1

    def missing(self) -> set[tuple[str, Fault]]:
        return expected_pairs() - set(self.pairs)


@attrs.define(eq=False)
class Policy:
    """The seeded chooser of faults, shared by both replicas (one stream of choices)."""

    rng: random.Random
    rate: float
    coverage: Coverage
    trace: list[str]
    quiet: bool = False

    def choose(self, boundary: str) -> Fault | None:
        self.coverage.saw(boundary)
        if self.quiet or self.rng.random() >= self.rate:
            return None
        fault = self.rng.choice(faults_at(boundary))
        self.coverage.pairs[boundary, fault] += 1
        return fault

    @contextmanager
    def silenced(self) -> Iterator[None]:
        was, self.quiet = self.quiet, True
        try:
            yield
        finally:
            self.quiet = was


class Crashed(Exception):
    """A replica crashed at a connection event (the simulation restarts it)."""


@attrs.define
class Freeze:
    """A replica stopped while it held sockets, and what its peer did about it: the allocated
    rows whose records it held, at their generations, and the seconds each has aged since."""

    held: dict[str, int]
    released_before: frozenset[str]
    aged: collections.Counter[str] = attrs.field(factory=collections.Counter)


@attrs.define(eq=False)
class SimReplica:
    """One replica: its clock, plugin, router (real connection statements) and reconciler."""

    sim: Simulation
    index: int
    clock: ManualClock
    provisioner: SimProvisioner
    router: RecordingRouter
    reconciler: Reconciler = attrs.field(init=False)
    restarts: int = 0
    crashed: bool = False
    frozen: Freeze | None = None
    """Set while the process is stopped (SIGSTOP): it takes no step, its sockets stay open."""

    @property
    def other(self) -> SimReplica:
        return self.sim.replicas[1 - self.index]

    async def at(self, site: Site) -> None:
        """The fault hook of this replica's reconciler."""
        fault = self.sim.policy.choose(site.boundary.value)
        if fault is None:
            return
        self.sim.trace.append(f"  fault {fault.value} at {site.boundary.value} {site.step}")
        if fault is Fault.CRASH:
            # The process dies here: this claim does nothing more, its lease is left to lapse,
            # and the replica comes back with a new reconciler after the step.
            self.crashed = True
            raise asyncio.CancelledError
        if fault is Fault.DATABASE_UNAVAILABLE:
            raise DatabaseUnavailable("simulated outage")
        if fault is Fault.PLUGIN_ERROR:
            self.provisioner.fail_next()
        elif fault is Fault.PLUGIN_TIMEOUT:
            self.provisioner.time_out_next(SETTINGS.operation_timeout)
        else:
            await self._pause(site)

    async def _pause(self, site: Site) -> None:
        """The process stops here until its lease has run out in the database; the other
        replica may take the allocation over meanwhile. Then its own clock jumps, and the
        claim resumes exactly where it stood."""
        await expire_lease(self.sim.db, site.allocation_id)
        if self.sim.rng.random() < 0.5 and self.other.frozen is None:
            with self.sim.policy.silenced():
                # Its own task: this claim must not see the other replica's claim as its own.
                other = asyncio.create_task(self.other.reconciler.reconcile_next())
                await asyncio.shield(other)
        self.clock.advance(SETTINGS.lease_duration + 1)

    def new_reconciler(self) -> Reconciler:
        self.restarts += 1
        counter = itertools.count()
        name = f"hub{self.index}-{self.restarts}"

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            return None

        return Reconciler(
            store=AllocationStore(self.sim.db, instance_id=name),
            ledger=LedgerStore(self.sim.db, instance_id=name),
            connections=ConnectionStore(self.sim.db, instance_id=self.router.instance_id),
            provisioners={self.provisioner.id: self.provisioner},
            router=self.router,
            hub_ws_url="ws://127.0.0.1:1",
            settings=SETTINGS,
            on_ready=on_ready,
            clock=self.clock,
            create_lease_id=lambda: f"lease-{name}-{next(counter)}",
            create_sidecar_id=lambda: f"sc-{name}-{next(counter)}",
            faults=self,
        )

    async def restart_if_crashed(self) -> None:
        if not self.crashed:
            return
        self.crashed = False
        self.sim.trace.append(f"  replica {self.index} restarts")
        await self.reconciler.drain()
        # The sockets it held died with it; their records stay until a peer or a takeover
        # replaces them, as after a real crash.
        self.router.current.clear()
        self.reconciler = self.new_reconciler()
        await self.reconciler.initialize()

    # -- connection events, with their own boundaries -----------------------------------

    async def connect(self, sidecar: FakeSidecar) -> None:
        target = Target(sidecar.allocation_id, sidecar.generation)
        fault = self.sim.policy.choose(Event.CONNECT.value)
        if fault is not None:
            self.sim.trace.append(f"  fault {fault.value} at connect")
        if fault is Fault.DATABASE_UNAVAILABLE:
            return  # the record statement failed; the sidecar dials again later
        outcome = await self.router.connect(target)
        if outcome is RecordOutcome.RECORDED and fault is Fault.CRASH:
            self.crashed = True  # recorded, then the replica died with the socket

    async def disconnect(self, allocation_id: str) -> None:
        held = self.router.current.get(allocation_id)
        if held is None:
            return
        fault = self.sim.policy.choose(Event.DISCONNECT.value)
        if fault is not None:
            self.sim.trace.append(f"  fault {fault.value} at disconnect")
        if fault is None:
            await self.router.disconnect(held[0], connect_timeout=SETTINGS.connect_timeout)
            return
        # The socket closed but its disconnect was never written: the statement failed, or the
        # replica died before running it.
        del self.router.current[allocation_id]
        if fault is Fault.CRASH:
            self.crashed = True


# -- the simulation --------------------------------------------------------------------------


@attrs.define(eq=False)
class Simulation:
    seed: int
    db: Database
    dsn: str
    steps: int = 40
    rate: float = 0.2
    rng: random.Random = attrs.field(init=False)
    trace: list[str] = attrs.field(factory=list)
    coverage: Coverage = attrs.field(factory=Coverage)
    policy: Policy = attrs.field(init=False)
    world: World = attrs.field(init=False)
    replicas: list[SimReplica] = attrs.field(factory=list)
    store: AllocationStore = attrs.field(init=False)
    ids: list[str] = attrs.field(factory=list)
    released: set[str] = attrs.field(factory=set)
    given_up: list[str] = attrs.field(factory=list)
    """Healthy allocations of a stopped replica that were given up within the window."""

    def __attrs_post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.policy = Policy(self.rng, self.rate, self.coverage, self.trace)
        self.world = World(self.db)
        self.store = AllocationStore(self.db, instance_id="app")
        for index in range(2):
            clock = ManualClock()
            router = RecordingRouter(self.db, instance_id=f"hub{index}")
            provisioner = SimProvisioner(self.world, clock)
            replica = SimReplica(self, index, clock, provisioner, router)
            replica.reconciler = replica.new_reconciler()
            self.replicas.append(replica)

    async def run(self) -> dict[str, list[str]]:
        for replica in self.replicas:
            await replica.router.heartbeat()
            await replica.reconciler.initialize()
        for number in range(self.steps):
            await self._step(number)
        with self.policy.silenced():
            await self._converge()
        for replica in self.replicas:
            await replica.reconciler.drain()
        return await self.judge()

    async def _step(self, number: int) -> None:
        rng = self.rng
        for each in self.replicas:
            if each.frozen is not None and rng.random() < 0.15:
                await self._resume(each, number)
        replica = self.replicas[rng.randrange(2)]
        roll = rng.random()
        if replica.frozen is not None and (roll < 0.12 or 0.17 <= roll < 0.68 or roll >= 0.94):
            # A stopped process takes no step of its own: no claim, no connect, no repair.
            self.trace.append(f"{number}: replica {replica.index} is stopped")
            return
        if roll < 0.12 and len(self.ids) < 6:
            allocation = await self.store.request(provisioner_id="fake")
            self.ids.append(allocation.id)
            self.trace.append(f"{number}: request {self.label(allocation.id)}")
        elif roll < 0.17 and self.ids:
            allocation_id = rng.choice(self.ids)
            self.trace.append(f"{number}: release {self.label(allocation_id)}")
            self.released.add(allocation_id)
            await self.store.release(allocation_id)
        elif roll < 0.52:
            self.trace.append(f"{number}: claim on replica {replica.index}")
            try:
                await replica.reconciler.reconcile_next()
            except asyncio.CancelledError:
                # A crash landed on the error path, which runs in the claimer's task.
                if not replica.crashed:
                    raise
        elif roll < 0.68:
            sidecars = [s for s in self.world.sidecars.values() if s.alive]
            if sidecars:
                sidecar = rng.choice(sidecars)
                self.trace.append(f"{number}: {sidecar.sidecar_id} connects to {replica.index}")
                await replica.connect(sidecar)
        elif roll < 0.84:
            # A stopped replica's sockets stay open: nothing of it reports a close.
            held = [
                (r.index, a)
                for r in self.replicas
                if r.frozen is None
                for a in sorted(r.router.current)
            ]
            if held:
                index, allocation_id = rng.choice(held)
                replica = self.replicas[index]
                label = self.label(allocation_id)
                self.trace.append(f"{number}: {label} disconnects from {index}")
                await replica.disconnect(allocation_id)
        elif roll < 0.94 and self.ids:
            stopped_held = sorted(
                h for r in self.replicas if r.frozen is not None for h in r.frozen.held
            )
            # While a replica is stopped, time passes mostly for what it held: the window
            # its peer's sweep gave is what is on trial.
            pool = stopped_held if stopped_held and rng.random() < 0.7 else self.ids
            allocation_id, seconds = rng.choice(pool), rng.choice([2.0, 31.0, 61.0])
            self.trace.append(f"{number}: {seconds:g}s pass for {self.label(allocation_id)}")
            await age_row(self.db, allocation_id, seconds)
            for each in self.replicas:
                if each.frozen is not None:
                    each.frozen.aged[allocation_id] += int(seconds)
        elif (
            roll < 0.98
            and replica.frozen is None
            and replica.other.frozen is None
            and await self._freeze(number)
        ):
            pass
        else:
            self.trace.append(f"{number}: repair on replica {replica.index}")
            await replica.reconciler.repair_unscheduled_connections()
        await replica.reconciler.drain()
        for each in self.replicas:
            await each.restart_if_crashed()

    async def _freeze(self, number: int) -> bool:
        """The replica holding the records of the most allocated rows stops with its sockets
        open; its heartbeat ages past the TTL and its peer sweeps its records, as the daemon's
        repair sweep does. False (nothing done) when no replica holds such a record."""
        async with self.db.pool.acquire() as conn:
            found = await conn.fetch(
                "SELECT c.instance_id, c.allocation_id, c.generation "
                "FROM hubd_sidecar_connections AS c "
                "JOIN hubd_allocations AS a ON a.id = c.allocation_id "
                "WHERE a.status = 'allocated'"
            )
            by_replica = {
                r.index: [row for row in found if row["instance_id"] == r.router.instance_id]
                for r in self.replicas
            }
            index = max(by_replica, key=lambda i: (len(by_replica[i]), -i))
            rows = by_replica[index]
            if not rows:
                return False
            replica = self.replicas[index]
            await conn.execute(
                "UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour' WHERE id = $1",
                replica.router.instance_id,
            )
        replica.frozen = Freeze(
            held={r["allocation_id"]: r["generation"] for r in rows},
            released_before=frozenset(self.released),
        )
        swept = await replica.other.router.connections.sweep_stale(
            SETTINGS.instance_ttl,
            connect_timeout=swept_reconnect_window(SETTINGS.connect_timeout),
        )
        labels = sorted(self.label(s.allocation_id) for s in swept)
        self.trace.append(f"{number}: replica {replica.index} stops; its records swept {labels}")
        return True

    async def _resume(self, replica: SimReplica, number: int) -> None:
        """The replica goes on: it heartbeats, writes back the records of the sockets it still
        holds, and a healthy allocation it held is still at its generation, unless its own
        release or the passing of the whole reconnect window since could end it."""
        frozen = replica.frozen
        assert frozen is not None
        # The race on trial: the peer acts on every deadline due just before the stopped
        # replica goes on.
        with self.policy.silenced():
            await replica.other.reconciler.reconcile_until_idle()
            await replica.other.reconciler.drain()
        replica.frozen = None
        await replica.router.heartbeat()
        window = swept_reconnect_window(SETTINGS.connect_timeout)
        written = []
        for allocation_id, (target, connection_id) in sorted(replica.router.current.items()):
            row = await self.store.get(allocation_id)
            if row.generation != target.generation or row.sidecar_id is None:
                continue
            seq = await replica.router.connections.reassert(connection_id, target, row.sidecar_id)
            if seq is not None:
                written.append(self.label(allocation_id))
        self.trace.append(f"{number}: replica {replica.index} resumes; wrote back {written}")
        for allocation_id, generation in sorted(frozen.held.items()):
            if allocation_id in self.released and allocation_id not in frozen.released_before:
                continue
            if frozen.aged[allocation_id] >= window:
                continue
            if frozen.aged[allocation_id] > 0:
                self.coverage.stopped_judged += 1
            row = await self.store.get(allocation_id)
            if row.status is not Status.ALLOCATED or row.generation != generation:
                self.given_up.append(
                    f"{self.label(allocation_id)} held by stopped replica {replica.index} at gen "
                    f"{generation}: {row.status} gen {row.generation} after "
                    f"{frozen.aged[allocation_id]}s"
                )

    async def _converge(self, rounds: int = 30) -> None:
        """No faults: sidecars of current generations dial until connected, both replicas
        claim until idle, and time passes for every row, until all is settled as asked."""
        self.trace.append("converge")
        for each in self.replicas:
            if each.frozen is not None:
                await self._resume(each, -1)
        for _ in range(rounds):
            rows = {i: await self.store.get(i) for i in self.ids}
            if all(self._settled(row) for row in rows.values()):
                return
            for row in rows.values():
                await self._dial(row)
            for replica in self.replicas:
                await replica.router.heartbeat()
                await replica.reconciler.reconcile_until_idle()
                await replica.reconciler.drain()
            for allocation_id in self.ids:
                await age_row(self.db, allocation_id, 61)
        pending = [
            f"{r.id} {r.status} gen {r.generation} ready {r.ready}"
            for r in [await self.store.get(i) for i in self.ids]
            if not self._settled(r)
        ]
        raise AssertionError(f"seed {self.seed} did not converge: {pending}")

    def label(self, allocation_id: str) -> str:
        """The allocation by request order: ids are random, traces must compare across
        replays."""
        return f"a{self.ids.index(allocation_id)}"

    def _settled(self, row: Allocation) -> bool:
        if row.id in self.released:
            return row.status is Status.RELEASED
        return row.ready

    async def _dial(self, row: Allocation) -> None:
        if row.status not in (Status.PROVISIONING, Status.ALLOCATED) or row.ready:
            return
        target = Target(row.id, row.generation)
        if any(r.router.current.get(row.id, (None,))[0] == target for r in self.replicas):
            return
        for sidecar in self.world.live(row.id):
            if sidecar.generation == row.generation:
                await self.rng.choice(self.replicas).connect(sidecar)

    async def judge(self) -> dict[str, list[str]]:
        """Every invariant broken, by name; committed data only."""
        found = await violations(self.dsn)
        found["late_plugin_effects"] = list(self.world.late_effects)
        found["frozen_replica_given_up"] = list(self.given_up)
        sidecars: list[str] = []
        published: list[str] = []
        for allocation_id in self.ids:
            row = await self.store.get(allocation_id)
            live = self.world.live(allocation_id)
            current = [s for s in live if s.generation == row.generation]
            if row.status is Status.RELEASED and live:
                sidecars.append(f"{allocation_id} released with {len(live)} live sidecars")
            elif row.ready and [s.sidecar_id for s in current] != [row.sidecar_id]:
                sidecars.append(
                    f"{allocation_id} ready at gen {row.generation} with "
                    f"{[s.sidecar_id for s in current]} live, bound {row.sidecar_id}"
                )
            stale = [s for s in live if s.generation != row.generation]
            if row.status is not Status.RELEASED and stale:
                sidecars.append(f"{allocation_id} has live sidecars of old generations: {stale}")
            # What an acceptance recorded belongs to the current generation's sidecar only:
            # a stale acceptance is fenced, and a new generation clears it.
            if row.endpoint is not None and (
                row.status is not Status.ALLOCATED
                or row.endpoint != f"sim://{row.sidecar_id}"
                or row.metadata != {"generation": row.generation}
            ):
                published.append(
                    f"{allocation_id} {row.status} gen {row.generation} bound {row.sidecar_id} "
                    f"shows {row.endpoint} {row.metadata}"
                )
        found["sidecars"] = sidecars
        found["published"] = published
        return found


async def reset(db: Database) -> None:
    """An empty database for the next seed, the observer triggers kept."""
    async with db.pool.acquire() as conn:
        await conn.execute(
            "TRUNCATE hubd_allocation_ledger, hubd_sidecar_connections, hubd_sidecar_secrets, "
            "hubd_allocations, "
            "hubd_instances, hubd_observed_versions"
        )


def describe(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: items for name, items in found.items() if items}
