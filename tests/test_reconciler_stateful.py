"""Random interleavings of claims, plugin outcomes, connection events, time, releases and
restarts against the real store, with the reconciler's safety properties checked after every
step.

Two replicas share the database: claims, restarts, connects and disconnects land on either, as
they would behind a load balancer, and a sidecar may take over its own socket from the other
replica.

Properties: generation never decreases; no claim writes after a newer lease has written; every
active allocation is leased, scheduled, or ready with its sidecar connected (never stranded);
terminal rows never change; at most one live lease per allocation; and no sidecar that holds a
live record of the current generation is ever abandoned for not connecting.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, ClassVar, TypeVar

import attrs
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hubd.plugins.protocol import Accepted, Destroyed
from hubd.reconciler.engine import Reconciler, ReconcilerSettings
from hubd.routing import Target
from hubd.store import AllocationStore, Database, LedgerStore, Status, connect_database
from hubd.store.connection_values import RecordOutcome
from tests.pgtime import age_row
from tests.polling import scaled
from tests.reconcilerkit import (
    Behaviour,
    Gate,
    RecordingRouter,
    ScriptedProvisioner,
    accept,
    destroyed,
    fail,
    garbage,
    make_reconciler,
    reject,
    reject_destroy,
)

T = TypeVar("T")
OUTCOMES: dict[str, int] = {}

EXAMPLES = int(os.environ.get("HUBD_HYPOTHESIS_EXAMPLES", "200"))
SETTINGS = ReconcilerSettings(
    lease_duration=60,
    connect_timeout=30,
    operation_timeout=scaled(0.5),
    max_concurrent_claims=4,
)

ENSURES: dict[str, Behaviour] = {
    "accept": accept(),
    "reject_retryable": reject("quota", retryable=True),
    "reject_permanent": reject("bad_spec", retryable=False),
    "raise": fail(RuntimeError("provider error")),
    "garbage": garbage({"not": "a result"}),
}
DESTROYS: dict[str, Behaviour] = {
    "destroyed": destroyed(),
    "raise": fail(OSError("provider down")),
    "reject_retryable": reject_destroy("busy", retryable=True),
    "reject_permanent": reject_destroy("forbidden", retryable=False),
}


@attrs.define
class Harness:
    runner: asyncio.Runner
    db: Database
    slow_db: Database

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(30):
                return await coro

        return self.runner.run(bounded())


@attrs.define
class SlowClaim:
    """A claim on another reconciler whose ensure blocks until released."""

    reconciler: Reconciler
    gate: Gate
    task: asyncio.Task[bool]


class ReconcilerMachine(RuleBasedStateMachine):
    harness: ClassVar[Harness]

    def __init__(self) -> None:
        super().__init__()
        h = self.harness
        h.run(self._truncate())
        # hubA's connects make a parked allocation ready on their own (a daemon with no
        # on-ready hook); hubB's only wake the claimers: both paths race in every example.
        self.routers = [
            RecordingRouter(h.db, instance_id="hubA", ready_on_connect=True),
            RecordingRouter(h.db, instance_id="hubB"),
        ]
        self.provisioner = ScriptedProvisioner()
        self.restarts = 0
        self.reconcilers = [self._new_reconciler(0), self._new_reconciler(1)]
        self.live: dict[str, tuple[int, str]] = {}
        """Allocation → (generation, replica) of the socket whose record is current."""
        self.ledger_seen = 0
        self.store = AllocationStore(h.db, instance_id="app")
        self.ledger = LedgerStore(h.db, instance_id="app")
        self.ids: list[str] = []
        self.generations: dict[str, int] = {}
        self.terminal: dict[str, dict[str, Any]] = {}
        self.slow: SlowClaim | None = None

    async def _truncate(self) -> None:
        async with self.harness.db.pool.acquire() as conn:
            await conn.execute(
                "TRUNCATE hubd_allocation_ledger, hubd_sidecar_connections, hubd_sidecar_secrets, "
                "hubd_allocations, "
                "hubd_instances"
            )

    def _new_reconciler(self, replica: int) -> Reconciler:
        self.restarts += 1
        return make_reconciler(
            self.harness.db,
            self.routers[replica],
            self.provisioner,
            instance_id=f"hub{replica}-{self.restarts}",
            settings=SETTINGS,
        )

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.harness.run(coro)

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.ids) < 4)
    @rule()
    def request(self) -> None:
        allocation = self.run(self.store.request(provisioner_id="fake"))
        self.ids.append(allocation.id)

    @rule(kind=st.sampled_from(sorted(ENSURES)))
    def script_ensure(self, kind: str) -> None:
        self.provisioner.ensure_script.append(ENSURES[kind])

    @rule(kind=st.sampled_from(sorted(DESTROYS)))
    def script_destroy(self, kind: str) -> None:
        self.provisioner.destroy_script.append(DESTROYS[kind])

    @rule(replica=st.integers(0, 1))
    def claim(self, replica: int) -> None:
        self.run(self.reconcilers[replica].reconcile_next())

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 3), replica=st.integers(0, 1))
    def connect(self, index: int, replica: int) -> None:
        """The sidecar (re)connects to either replica, taking over any socket it had."""
        allocation = self.run(self.store.get(self.ids[index % len(self.ids)]))
        if allocation.status not in (Status.PROVISIONING, Status.ALLOCATED):
            return
        target = Target(allocation.id, allocation.generation)
        if self.run(self.routers[replica].connect(target)) is RecordOutcome.RECORDED:
            self.live[allocation.id] = (allocation.generation, self.routers[replica].instance_id)

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 3), replica=st.integers(0, 1))
    def disconnect(self, index: int, replica: int) -> None:
        """A socket on one replica closes; if another socket took over since, this is the late
        close of the old one and must change nothing."""
        allocation_id = self.ids[index % len(self.ids)]
        router = self.routers[replica]
        held = router.current.get(allocation_id)
        if held is None:
            return
        if self.run(router.disconnect(held[0])):
            del self.live[allocation_id]

    @rule()
    def heartbeat(self) -> None:
        for router in self.routers:
            self.run(router.heartbeat())

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 3), seconds=st.sampled_from([2.0, 31.0, 61.0]))
    def pass_time(self, index: int, seconds: float) -> None:
        self.run(age_row(self.harness.db, self.ids[index % len(self.ids)], seconds))

    @precondition(lambda self: self.ids)
    @rule(index=st.integers(0, 3))
    def release(self, index: int) -> None:
        self.run(self.store.release(self.ids[index % len(self.ids)]))

    @rule(replica=st.integers(0, 1))
    def restart(self, replica: int) -> None:
        """A replica's reconciler restarts (its sockets, held by the router, stay open)."""
        self.reconcilers[replica] = self._new_reconciler(replica)
        self.run(self.reconcilers[replica].initialize())

    @rule(replica=st.integers(0, 1))
    def repair(self, replica: int) -> None:
        self.run(self.reconcilers[replica].repair_unscheduled_connections())

    @precondition(lambda self: self.slow is None)
    @rule()
    def start_slow_claim(self) -> None:
        # Every call of the slow claim blocks, whatever status it claimed: ensure of a pending
        # or replacing row, destroy of a replacing or releasing one.
        provisioner = ScriptedProvisioner()
        gate = Gate(Accepted("slow"))
        provisioner.default_ensure = gate
        provisioner.default_destroy = Gate(Destroyed(), release=gate.release)
        slow = make_reconciler(
            self.harness.slow_db,
            self.routers[1],
            provisioner,
            instance_id="slow",
            settings=SETTINGS,
        )

        destroy_gate = provisioner.default_destroy
        assert isinstance(destroy_gate, Gate)

        async def start() -> asyncio.Task[bool]:
            task = asyncio.create_task(slow.reconcile_next())
            started = {
                asyncio.create_task(gate.started.wait()),
                asyncio.create_task(destroy_gate.started.wait()),
            }
            await asyncio.wait({task, *started}, return_when=asyncio.FIRST_COMPLETED)
            for waiter in started:
                waiter.cancel()
            return task

        self.slow = SlowClaim(slow, gate, self.run(start()))

    @precondition(lambda self: self.slow is not None)
    @rule()
    def outlive_slow_claim(self) -> None:
        """The slow claim's lease runs out (its process stalled) and this hub claims the row."""
        assert self.slow is not None
        for allocation_id in self.slow.reconciler.busy_allocations():
            self.run(age_row(self.harness.db, allocation_id, SETTINGS.lease_duration + 1))
        self.run(self.reconcilers[0].reconcile_next())

    @precondition(lambda self: self.slow is not None)
    @rule()
    def finish_slow_claim(self) -> None:
        assert self.slow is not None
        slow, self.slow = self.slow, None
        slow.gate.release.set()
        self.run(self._settle(slow))

    async def _settle(self, slow: SlowClaim) -> None:
        await asyncio.wait({slow.task})
        await slow.reconciler.drain()
        async with self.harness.db.pool.acquire() as conn:
            fenced_out = await conn.fetchval(
                "SELECT count(*) FROM hubd_allocation_ledger WHERE instance_id <> 'slow' "
                "AND error_code = 'outcome_unknown'"
            )
        label = "slow claim outlived by a newer lease" if fenced_out else "slow claim finished"
        event(label)
        OUTCOMES[label] = OUTCOMES.get(label, 0) + 1

    def teardown(self) -> None:
        if self.slow is not None:
            self.slow.gate.release.set()
            self.run(self._settle(self.slow))
        for reconciler in self.reconcilers:
            self.run(reconciler.drain())

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def safety(self) -> None:
        self.run(self._check())

    async def _check(self) -> None:
        async with self.harness.db.pool.acquire() as conn:
            now = await conn.fetchval("SELECT now()")
            rows = await conn.fetch("SELECT * FROM hubd_allocations ORDER BY id")
            ledger = await conn.fetch(
                "SELECT seq, allocation_id, generation, kind, lease_id, error_code "
                "FROM hubd_allocation_ledger ORDER BY seq"
            )
        # A sidecar holding a live record of its generation is never abandoned for not
        # connecting, whichever replica holds its socket and whichever claimed the row. Rows
        # are checked as they appear: connects and disconnects happen only between steps.
        for entry in ledger:
            if entry["seq"] <= self.ledger_seen:
                continue
            if entry["error_code"] == "sidecar_connect_failed" and entry["kind"] in (
                "begin_replacement",
                "begin_unrecoverable_release",
            ):
                held = self.live.get(entry["allocation_id"])
                assert held is None or held[0] != entry["generation"] - 1, (
                    f"{entry['allocation_id']} was abandoned while its sidecar was connected"
                )
        if ledger:
            self.ledger_seen = ledger[-1]["seq"]
        for row in rows:
            aid = row["id"]
            assert row["generation"] >= self.generations.get(aid, 1), "generation went back"
            self.generations[aid] = row["generation"]
            if aid in self.terminal:
                assert dict(row) == self.terminal[aid], "a terminal row changed"
                continue
            status = Status(row["status"])
            if status.terminal:
                self.terminal[aid] = dict(row)
                continue
            leased = row["lease_expires_at"] is not None and row["lease_expires_at"] > now
            scheduled = row["next_attempt_at"] is not None
            held = self.live.get(aid)
            connected = (
                status is Status.ALLOCATED
                and row["connection_ready"]
                and held is not None
                and held[0] == row["generation"]
            )
            assert leased or scheduled or connected, f"{aid} is stranded in {status}"

        # At most one live lease per allocation: of the claims in progress on every
        # reconciler that still believe they own their allocation, at most one holds the lease
        # the database calls live, and one whose lease the database has moved past can only be
        # the stalled slow claim (every other claim ends within its step).
        by_id = {row["id"]: row for row in rows}
        believers: dict[str, list[tuple[str, bool]]] = {}
        claimants = [(r, False) for r in self.reconcilers]
        if self.slow is not None:
            claimants.append((self.slow.reconciler, True))
        for reconciler, stalled in claimants:
            for aid, lease in reconciler.leases_held().items():
                believers.setdefault(aid, []).append((lease, stalled))
        for aid, held in believers.items():
            row = by_id[aid]
            live_lease = (
                row["lease_id"]
                if row["lease_expires_at"] is not None and row["lease_expires_at"] > now
                else None
            )
            assert sum(lease == live_lease for lease, _ in held) <= 1, (
                f"{aid} has two claims on one live lease"
            )
            assert all(stalled for lease, stalled in held if lease != live_lease), (
                f"{aid} has a claim in progress whose lease is no longer live"
            )

        # A lease that has been superseded on an allocation never writes there again. Rows
        # that settle an earlier lease's open call carry that lease's id, written by the new
        # owner, and are left out.
        leases: dict[str, list[str]] = {}
        for entry in ledger:
            lease = entry["lease_id"]
            if lease is None or entry["error_code"] == "outcome_unknown":
                continue
            seen = leases.setdefault(entry["allocation_id"], [])
            if seen and seen[-1] == lease:
                continue
            assert lease not in seen, "a claim wrote after a newer lease had written"
            seen.append(lease)


@pytest.mark.timeout(900)
def test_reconciler_state_machine(database_url: str) -> None:
    """No interleaving of claims, outcomes, events, time, releases and restarts breaks the
    reconciler's safety properties."""
    with asyncio.Runner() as runner:
        db = runner.run(connect_database(database_url, pool_size=8))
        slow_db = runner.run(connect_database(database_url, pool_size=4))
        ReconcilerMachine.harness = Harness(runner=runner, db=db, slow_db=slow_db)
        try:
            run_state_machine_as_test(
                ReconcilerMachine,
                settings=settings(
                    max_examples=EXAMPLES,
                    stateful_step_count=30,
                    deadline=None,
                    database=None,
                    suppress_health_check=[HealthCheck.too_slow],
                ),
            )
            print("slow claims:", OUTCOMES)
        finally:
            runner.run(db.close())
            runner.run(slow_db.close())
