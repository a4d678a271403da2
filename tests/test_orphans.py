"""Orphan collection against the real store and the real `local` provisioner: what belongs to
no current generation is destroyed after its grace period (or only reported), what is current
is never touched, one replica sweeps at a time."""

from __future__ import annotations

import pytest

from hubd.errors import PluginError
from hubd.plugins.local import LocalProvisioner
from hubd.plugins.protocol import Accepted, Destroyed, EnsureRequest, check_destroy_result
from hubd.reconciler.clock import ManualClock
from hubd.reconciler.orphans import OrphanCollector, Verdict, judge
from hubd.reconciler.writes import MarkReleased
from hubd.store import AllocationStore, Database, LedgerStore, Status
from tests import test_local_provisioner as local_kit
from tests.storekit import drive_to
from tests.test_local_provisioner import HUB_URL, Make, alive, report

# The local provisioner's fixtures: a provisioner running a stub, its marker and output dir.
make = local_kit.make
mark = local_kit.mark
out = local_kit.out


class TestRule:
    @pytest.mark.parametrize(
        ("facts", "verdict"),
        [
            ({"current": True, "known": True, "orphan_for": 1e9}, Verdict.KEEP),
            ({"current": False, "known": True, "orphan_for": 5.0}, Verdict.WAIT),
            ({"current": False, "known": True, "orphan_for": 10.0}, Verdict.DESTROY),
            ({"current": False, "known": False, "orphan_for": 10.0}, Verdict.REPORT),
            (
                {"current": False, "known": False, "orphan_for": 10.0, "destroy_unknown": True},
                Verdict.DESTROY,
            ),
            (
                {"current": False, "known": True, "orphan_for": 10.0, "dry_run": True},
                Verdict.REPORT,
            ),
        ],
    )
    def test_judge(self, facts: dict[str, object], verdict: Verdict) -> None:
        """A current sidecar is kept; an orphan waits out the grace period, then is destroyed,
        unless in dry-run or its allocation is unknown here (reported instead)."""
        arguments: dict[str, object] = {"grace": 10.0, "dry_run": False, "destroy_unknown": False}
        arguments.update(facts)
        assert judge(**arguments) == verdict  # type: ignore[arg-type]


async def start_for(
    provisioner: LocalProvisioner, out_dir: object, allocation_id: str, sidecar_id: str, gen: int
) -> int:
    request = EnsureRequest(
        allocation_id=allocation_id,
        generation=gen,
        tenant_id=None,
        session_id=None,
        spec={},
        sidecar_id=sidecar_id,
        token="hubd_sc_" + "ab" * 32,
        hub_ws_url=HUB_URL,
    )
    assert isinstance(await provisioner.ensure(request), Accepted)
    pid: int = (await report(out_dir, sidecar_id))["pid"]  # type: ignore[arg-type]
    return pid


def collector(
    store: AllocationStore, ledger: LedgerStore, clock: ManualClock, **options: object
) -> OrphanCollector:
    return OrphanCollector(store=store, ledger=ledger, grace=60.0, clock=clock, **options)  # type: ignore[arg-type]


class TestSweep:
    async def test_orphan_destroyed_after_grace_current_kept(
        self,
        store: AllocationStore,
        ledger: LedgerStore,
        db: Database,
        make: Make,
        out: object,
    ) -> None:
        """A sidecar of a released allocation is destroyed once seen as an orphan for the grace
        period, with ledger evidence; the current sidecar of a ready allocation is untouched."""
        provisioner = make()
        kept_fence = await drive_to(store, db, Status.ALLOCATED)
        kept = await store.get(kept_fence.allocation_id)
        gone_fence = await drive_to(store, db, Status.RELEASING)
        gone = await store.get(gone_fence.allocation_id)
        assert kept.sidecar_id is not None
        assert gone.sidecar_id is not None
        kept_pid = await start_for(provisioner, out, kept.id, kept.sidecar_id, kept.generation)
        gone_pid = await start_for(provisioner, out, gone.id, gone.sidecar_id, gone.generation)
        # Released while its sidecar lingered (a destroy that reported success too early).
        assert await store.write(gone_fence, MarkReleased().transition()) is not None
        clock = ManualClock()
        sweeper = collector(store, ledger, clock)
        first = await sweeper.sweep(provisioner)
        assert (first.listed, first.orphans, first.destroyed) == (2, 1, 0)
        assert alive(gone_pid)
        clock.advance(61)
        second = await sweeper.sweep(provisioner)
        assert (second.orphans, second.destroyed) == (1, 1)
        assert not alive(gone_pid)
        assert alive(kept_pid)
        kinds = [(e.kind, str(e.phase)) for e in await ledger.history(gone.id)]
        assert ("orphan_destroyed", "committed") in kinds
        assert [s.sidecar_id for s in await provisioner.list_sidecars()] == [kept.sidecar_id]

    async def test_dry_run_and_unknown_allocations_are_only_reported(
        self,
        store: AllocationStore,
        ledger: LedgerStore,
        db: Database,
        make: Make,
        out: object,
    ) -> None:
        """In dry-run an orphan is reported once (ledger, metrics) and left running; a sidecar
        naming an allocation this database does not know is never destroyed unless allowed."""
        provisioner = make()
        fence = await drive_to(store, db, Status.RELEASING)
        row = await store.get(fence.allocation_id)
        assert row.sidecar_id is not None
        pid = await start_for(provisioner, out, row.id, row.sidecar_id, row.generation)
        stranger = await start_for(provisioner, out, "al_" + "f" * 32, "sc_stranger", 1)
        assert await store.write(fence, MarkReleased().transition()) is not None
        clock = ManualClock()
        outcomes: list[str] = []
        dry = collector(
            store, ledger, clock, dry_run=True, on_orphan=lambda _p, o: outcomes.append(o)
        )
        await dry.sweep(provisioner)
        clock.advance(61)
        for _ in range(2):
            result = await dry.sweep(provisioner)
            assert (result.reported, result.destroyed) == (2, 0)
        assert alive(pid)
        assert alive(stranger)
        assert outcomes == ["reported", "reported"]  # once per sidecar, not per sweep
        assert "orphan_found" in [e.kind for e in await ledger.history(row.id)]

        real = collector(store, ledger, clock)
        await real.sweep(provisioner)
        clock.advance(61)
        result = await real.sweep(provisioner)
        assert (result.destroyed, result.reported) == (1, 1)
        assert not alive(pid)
        assert alive(stranger)
        allowed = collector(store, ledger, clock, destroy_unknown=True)
        await allowed.sweep(provisioner)
        clock.advance(61)
        assert (await allowed.sweep(provisioner)).destroyed == 1
        assert not alive(stranger)

    async def test_one_sweeper_at_a_time(
        self,
        store: AllocationStore,
        ledger: LedgerStore,
        make: Make,
    ) -> None:
        """While another replica holds a provisioner's sweep lock, a sweep of it does nothing."""
        provisioner = make()
        async with store.sweep_lock(provisioner.id) as held:
            assert held is not None
            report_ = await collector(store, ledger, ManualClock()).sweep(provisioner)
            assert report_.skipped
        assert not (await collector(store, ledger, ManualClock()).sweep(provisioner)).skipped


class TestRemoved:
    @pytest.mark.parametrize("removed", [True, False, None])
    def test_destroyed_says_whether_it_removed_something(self, removed: bool | None) -> None:
        """``Destroyed.removed`` (what the sweep counts by) is a bool or ``None``: anything
        else from a plugin is an error, never a success."""
        assert check_destroy_result(Destroyed(removed=removed)) == Destroyed(removed=removed)

    def test_anything_else_is_refused(self) -> None:
        with pytest.raises(PluginError, match="'removed' is not a bool or None"):
            check_destroy_result(Destroyed(removed="yes"))  # type: ignore[arg-type]
