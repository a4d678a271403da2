"""A sidecar's death, as its provisioner reports it, and the limit on replacing a sidecar that
keeps failing: decided in the statement that writes, against a real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest

from hubd.backoff import Retries
from hubd.daemon.exits import ExitWatch
from hubd.daemon.metrics import Metrics
from hubd.errors import PluginError
from hubd.plugins.protocol import SidecarExit, check_sidecar_exit
from hubd.routing import Target
from hubd.store import (
    Allocation,
    AllocationStore,
    Database,
    LedgerStore,
    Status,
    connect_database,
)
from hubd.store.inputs import NO_REPLACEMENT_LIMIT, ReplacementLimit
from hubd.store.rows import SidecarDeath
from tests.pgtime import age_row
from tests.polling import eventually, scaled
from tests.reconcilerkit import SETTINGS, ReconcilerRig, reject, reject_destroy

DIED = "the sidecar exited with exit code 3: boom | bye"


@pytest.fixture
def rig(
    db: Database, database_url: str, store: AllocationStore, ledger: LedgerStore
) -> ReconcilerRig:
    return ReconcilerRig(db=db, database_url=database_url, store=store, ledger=ledger)


def death(allocation: Allocation, message: str = DIED) -> SidecarDeath:
    assert allocation.sidecar_id is not None
    return SidecarDeath(allocation.id, allocation.generation, allocation.sidecar_id, message)


async def ledger_kinds(ledger: LedgerStore, allocation_id: str) -> list[str]:
    return [entry.kind for entry in await ledger.history(allocation_id)]


class TestReportedDeath:
    async def test_a_ready_sidecar_reported_dead_is_replaced_at_once_with_its_evidence(
        self, rig: ReconcilerRig
    ) -> None:
        """Its record stays (the socket has not closed yet), yet it reads not connected; the
        next claim abandons it for what its provisioner said, long before connect_timeout."""
        reconciler = rig.make(settings=attrs.evolve(SETTINGS, automatic_replacement_recovery=True))
        ready = await rig.to_ready(reconciler)
        target = Target(ready.id, ready.generation)
        assert await rig.store.report_exits([death(ready)]) == [target]

        row = await rig.store.get(ready.id)
        assert row.exit_message == DIED
        assert not row.ready
        assert row.next_attempt_at is not None
        assert row.connect_deadline is not None
        readiness = await rig.router.connections.readiness(target, 30.0)
        assert not readiness.connected
        assert readiness.exit_message == DIED
        assert readiness.deadline_in is not None
        assert readiness.deadline_in <= 0
        assert target in rig.router.connected()  # the record is still there

        assert await reconciler.reconcile_next()
        replaced = await rig.store.get(ready.id)
        assert replaced.status is Status.REPLACING
        assert replaced.generation == ready.generation + 1
        assert replaced.failure_code == "sidecar_exited"
        assert replaced.failure_message == DIED
        entries = await rig.ledger.history(ready.id)
        reported = [e for e in entries if e.kind == "sidecar_exited"]
        assert len(reported) == 1
        assert reported[0].message == DIED

    async def test_a_report_matches_only_the_current_sidecar_once(self, rig: ReconcilerRig) -> None:
        """A second report of one death, a report naming another sidecar or an older
        generation, and a report of a sidecar being released all write nothing."""
        ready = await rig.to_ready()
        assert ready.sidecar_id is not None
        other = SidecarDeath(ready.id, ready.generation, "sc_someone_else", DIED)
        older = SidecarDeath(ready.id, ready.generation - 1, ready.sidecar_id, DIED)
        assert await rig.store.report_exits([other, older]) == []
        assert (await rig.store.get(ready.id)).exit_message is None

        assert len(await rig.store.report_exits([death(ready)])) == 1
        assert await rig.store.report_exits([death(ready, "again")]) == []
        assert (await rig.store.get(ready.id)).exit_message == DIED

    async def test_two_replicas_reporting_one_death_at_once_write_it_once(
        self, rig: ReconcilerRig
    ) -> None:
        """Every replica serving a provisioner follows its watch: the same death arrives at two
        at the same moment, on pools of their own, and is written once."""
        ready = await rig.to_ready()
        other_db = await connect_database(rig.database_url, pool_size=2)
        try:
            other = AllocationStore(other_db, instance_id="in_other")
            written = await asyncio.gather(
                rig.store.report_exits([death(ready)]), other.report_exits([death(ready)])
            )
        finally:
            await other_db.close()
        assert sorted(len(w) for w in written) == [0, 1]
        assert (await ledger_kinds(rig.ledger, ready.id)).count("sidecar_exited") == 1

    async def test_a_sidecar_hubd_is_releasing_is_not_reported(self, rig: ReconcilerRig) -> None:
        """hubd's own destroy makes the engine report a death too: it matches nothing."""
        releasing = await rig.to_ready()
        await rig.store.release(releasing.id)
        assert await rig.store.report_exits([death(releasing)]) == []
        assert "sidecar_exited" not in await ledger_kinds(rig.ledger, releasing.id)

    async def test_without_automatic_recovery_a_dead_sidecar_is_released(
        self, rig: ReconcilerRig
    ) -> None:
        ready = await rig.to_ready()
        await rig.store.report_exits([death(ready)])
        assert await rig.reconciler.reconcile_next()
        released = await rig.store.get(ready.id)
        assert released.status is Status.RELEASING
        assert released.failure_code == "sidecar_exited"
        assert released.failure_message is not None
        assert released.failure_message.endswith(DIED)

    async def test_the_end_keeps_its_reason_through_a_retried_destroy(
        self, rig: ReconcilerRig
    ) -> None:
        """The destroy of a dead sidecar's release fails while its engine is away and is
        retried: failure_code then names the destroy's error, but the end's reason stays the
        death, in the application's view and on its events."""
        ready = await rig.to_ready()
        await rig.store.report_exits([death(ready)])
        assert await rig.reconciler.reconcile_next()  # releasing
        rig.provisioner.destroy_script.append(reject_destroy("engine_unavailable", retryable=True))
        await age_row(rig.db, ready.id, 60)
        assert await rig.reconciler.reconcile_next()  # the destroy fails, retried later
        retried = await rig.store.get(ready.id)
        assert retried.failure_code == "engine_unavailable"
        await age_row(rig.db, ready.id, 60)
        assert await rig.reconciler.reconcile_next()  # destroyed, released
        async with rig.db.pool.acquire() as conn:
            view = await conn.fetchrow(
                "SELECT status, end_reason FROM hubd_v1.allocations WHERE id = $1", ready.id
            )
            last = await conn.fetchrow(
                "SELECT event, end_reason FROM hubd_v1.events WHERE allocation_id = $1 "
                "ORDER BY position DESC LIMIT 1",
                ready.id,
            )
        assert (view["status"], view["end_reason"]) == ("released", "sidecar_exited")
        assert (last["event"], last["end_reason"]) == ("released", "sidecar_exited")

    async def test_its_socket_closing_afterwards_keeps_the_row_due_now(
        self, rig: ReconcilerRig
    ) -> None:
        """The disconnect of a sidecar reported dead gives it no new connect deadline: nothing
        will reconnect."""
        ready = await rig.to_ready()
        target = Target(ready.id, ready.generation)
        await rig.store.report_exits([death(ready)])
        assert await rig.router.disconnect(target, connect_timeout=600.0)
        async with rig.db.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT connect_deadline <= now() AS passed, next_attempt_at <= now() AS due "
                "FROM hubd_allocations WHERE id = $1",
                ready.id,
            )
        assert row["passed"]
        assert row["due"]

    async def test_a_new_sidecar_starts_with_no_death(self, rig: ReconcilerRig) -> None:
        """The replacement's bind clears the dead sidecar's message: the new one connects and
        becomes ready."""
        reconciler = rig.make(settings=attrs.evolve(SETTINGS, automatic_replacement_recovery=True))
        ready = await rig.to_ready(reconciler)
        await rig.store.report_exits([death(ready)])
        assert await reconciler.reconcile_next()  # abandoned
        await age_row(rig.db, ready.id, 60)
        assert await reconciler.reconcile_next()  # destroyed, bound again, ensured
        rebound = await rig.store.get(ready.id)
        assert rebound.status is Status.ALLOCATED
        assert rebound.exit_message is None
        assert rebound.exited_at is None
        await rig.connect(Target(rebound.id, rebound.generation))
        assert await reconciler.reconcile_next()
        assert (await rig.store.get(ready.id)).ready


class TestReplacementLimit:
    async def test_a_sidecar_that_keeps_failing_is_given_up_and_destroyed(
        self, rig: ReconcilerRig
    ) -> None:
        """Past replacement_limit within the window, the allocation is released instead of
        replaced, its last sidecar destroyed, and it ends failed saying why."""
        reconciler = rig.make(
            settings=attrs.evolve(SETTINGS, replacement_limit=ReplacementLimit(2, 600.0))
        )
        rig.provisioner.default_ensure = reject("engine_error", retryable=True)
        allocation = await rig.store.request(provisioner_id="fake")
        statuses = []
        for _ in range(6):
            row = await rig.store.get(allocation.id)
            if row.status.terminal:
                break
            await age_row(rig.db, allocation.id, 60)
            assert await reconciler.reconcile_next()
            statuses.append((await rig.store.get(allocation.id)).status)
        assert statuses == [
            Status.REPLACING,
            Status.REPLACING,
            Status.RELEASING,
            Status.FAILED,
        ]
        failed = await rig.store.get(allocation.id)
        assert failed.give_up
        assert failed.failure_code == "engine_error"
        assert failed.failure_message == (
            "gave up: 3 sidecars failed within 600 s (replacement_limit 2); "
            "the last: engine_error happened"
        )
        assert len(rig.provisioner.ensure_calls) == 3
        # Each abandoned sidecar was destroyed: the two replaced and the last one.
        assert len(rig.provisioner.destroy_calls) == 3
        kinds = await ledger_kinds(rig.ledger, allocation.id)
        assert kinds.count("give_up") == 1
        assert kinds.count("begin_replacement") == 2
        assert Target(allocation.id, failed.generation) in rig.router.retired

    async def test_failures_spread_wider_than_the_window_are_replaced(
        self, rig: ReconcilerRig
    ) -> None:
        """A streak whose first failure is older than the window starts again at one."""
        reconciler = rig.make(
            settings=attrs.evolve(SETTINGS, replacement_limit=ReplacementLimit(2, 600.0))
        )
        rig.provisioner.default_ensure = reject("engine_error", retryable=True)
        allocation = await rig.store.request(provisioner_id="fake")
        async with rig.db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET replacements = 9, "
                "replacements_since = now() - interval '601 seconds' WHERE id = $1",
                allocation.id,
            )
        assert await reconciler.reconcile_next()
        row = await rig.store.get(allocation.id)
        assert row.status is Status.REPLACING
        assert not row.give_up
        assert row.replacements == 1

    async def test_no_limit_replaces_for_ever(self, rig: ReconcilerRig) -> None:
        reconciler = rig.make(
            settings=attrs.evolve(SETTINGS, replacement_limit=NO_REPLACEMENT_LIMIT)
        )
        rig.provisioner.default_ensure = reject("engine_error", retryable=True)
        allocation = await rig.store.request(provisioner_id="fake")
        for _ in range(8):
            await age_row(rig.db, allocation.id, 60)
            assert await reconciler.reconcile_next()
        row = await rig.store.get(allocation.id)
        assert row.status is Status.REPLACING
        assert row.replacements == 8
        assert not row.give_up


class WatchingPlugin:
    """A provisioner's watch, scripted: what each call yields, then how it ends."""

    def __init__(self, calls: list[list[object]], ends: list[BaseException | None]) -> None:
        self.calls = calls
        self.ends = ends
        self.started = 0
        self.closed = 0

    async def watch_sidecars(self) -> AsyncIterator[Any]:
        index = min(self.started, len(self.calls) - 1)
        self.started += 1
        try:
            for item in self.calls[index]:
                yield item
            end = self.ends[min(index, len(self.ends) - 1)]
            if end is None:
                await asyncio.Event().wait()  # follows until cancelled
            else:
                raise end
        finally:
            self.closed += 1


class EngineDown(PluginError):
    code = "engine_unavailable"


class TestExitWatch:
    async def test_reports_are_written_and_failures_counted(self, rig: ReconcilerRig) -> None:
        """Each exit the watch yields is written at once (a malformed one is skipped); when the
        watch fails it is called again after the backoff, and its state, metrics and
        ``/readyz`` line say why."""
        ready = await rig.to_ready()
        assert ready.sidecar_id is not None
        exit_ = SidecarExit(
            sidecar_id=ready.sidecar_id,
            allocation_id=ready.id,
            generation=ready.generation,
            exit_code=3,
            output="boom",
        )
        plugin = WatchingPlugin(
            calls=[[None, {"not": "an exit"}, exit_], [None]],
            ends=[EngineDown("engine socket refused"), None],
        )
        metrics = Metrics()
        watch = ExitWatch(
            "fake",
            plugin,
            rig.store,
            metrics,
            timeout=scaled(5),
            retries=Retries.doubling(0.01, 0.05),
        )
        assert watch.state.describe("fake") is not None  # not followed yet
        task = asyncio.create_task(watch.run())
        try:

            async def written() -> bool:
                return (await rig.store.get(ready.id)).exit_message is not None

            await eventually(written, within=scaled(10))
            row = await rig.store.get(ready.id)
            assert row.exit_message == "the sidecar exited with exit code 3: boom"

            async def following_again() -> bool:
                return plugin.started == 2 and watch.state.following

            await eventually(following_again, within=scaled(10))
            assert plugin.closed == 1
            assert watch.state.describe("fake") is None
            failures = metrics.watch_failures.labels(provisioner="fake", code="engine_unavailable")
            assert failures._value.get() == 1
            assert metrics.watch_up.labels(provisioner="fake")._value.get() == 1
            assert (
                metrics.sidecar_exits.labels(provisioner="fake", reason="exited")._value.get() == 1
            )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert plugin.closed == 2

    async def test_a_plugin_bug_is_a_failure_not_a_crash(self, rig: ReconcilerRig) -> None:
        plugin = WatchingPlugin(calls=[[None]], ends=[RuntimeError("plugin bug")])
        metrics = Metrics()
        watch = ExitWatch(
            "fake", plugin, rig.store, metrics, timeout=1.0, retries=Retries.doubling(0.01, 0.02)
        )
        task = asyncio.create_task(watch.run())
        try:

            async def failed_twice() -> bool:
                return plugin.started >= 2 and not watch.state.following

            await eventually(failed_twice, within=scaled(10))
            line = watch.state.describe("fake")
            assert line is not None
            assert "unreachable (watch_crashed)" in line
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert not task.cancelled() or task.done()


class TestExitValues:
    def test_a_long_output_keeps_its_tail(self) -> None:
        checked = check_sidecar_exit(
            SidecarExit(
                sidecar_id="sc_1", allocation_id="al_1", generation=1, exit_code=1,
                output="x" * 5000 + "END",
            )
        )  # fmt: skip
        assert checked.output.endswith("END")
        assert len(checked.output) == 2000

    @pytest.mark.parametrize(
        "value",
        [
            {"sidecar_id": "sc"},
            SidecarExit(sidecar_id="", allocation_id="al", generation=1, exit_code=1),
            SidecarExit(sidecar_id="sc", allocation_id="al", generation=0, exit_code=1),
            SidecarExit(sidecar_id="sc", allocation_id="al", generation=1, exit_code="1"),  # type: ignore[arg-type]
            SidecarExit(sidecar_id="sc", allocation_id="al", generation=True, exit_code=1),
        ],
    )
    def test_malformed_exits_are_refused(self, value: object) -> None:
        with pytest.raises(PluginError):
            check_sidecar_exit(value)

    def test_describe_says_how_it_died(self) -> None:
        removed = SidecarExit(
            sidecar_id="sc", allocation_id="al", generation=1, exit_code=None, reason="removed"
        )
        assert removed.describe() == "the sidecar was removed (no output)"
        oom = SidecarExit(
            sidecar_id="sc", allocation_id="al", generation=1, exit_code=137, output="alloc",
            reason="oom_killed",
        )  # fmt: skip
        assert oom.describe() == (
            "the sidecar was killed for want of memory with exit code 137: alloc"
        )
