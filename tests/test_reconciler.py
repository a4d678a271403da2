"""The reconciler against a real PostgreSQL with a scripted provisioner and an in-memory router."""

from __future__ import annotations

import asyncio
import traceback
from datetime import datetime, timedelta
from typing import Any

import attrs
import pytest
import structlog.testing

from hubd.errors import InitializationUncertain
from hubd.plugins.protocol import Accepted, EnsureRequest, Rejected
from hubd.reconciler.clock import ManualClock
from hubd.reconciler.engine import HookContext, Reconciler, ReconcilerSettings
from hubd.reconciler.faults import Boundary, Site
from hubd.reconciler.observer import NullObserver
from hubd.routing import Target
from hubd.store import (
    Allocation,
    AllocationStore,
    Database,
    LedgerStore,
    Phase,
    Status,
    connect_database,
)
from hubd.store.connections import ConnectionStore
from hubd.store.inputs import NO_REPLACEMENT_LIMIT
from hubd.tokens import hash_token
from tests.pgtime import age_row, expire_lease
from tests.polling import scaled
from tests.reconcilerkit import (
    SETTINGS,
    Gate,
    ReconcilerRig,
    RecordingRouter,
    ScriptedProvisioner,
    fail,
    garbage,
    make_reconciler,
    poll_until,
    reject,
    reject_destroy,
)


@pytest.fixture
def rig(
    db: Database, database_url: str, store: AllocationStore, ledger: LedgerStore
) -> ReconcilerRig:
    return ReconcilerRig(db=db, database_url=database_url, store=store, ledger=ledger)


def _renewing() -> ReconcilerSettings:
    """A lease renewed every 0.5 s, well before an ensure held by the test times out (1 s)."""
    return ReconcilerSettings(
        lease_duration=scaled(1.5), connect_timeout=30, operation_timeout=scaled(1)
    )


class StatementCounter(NullObserver):
    """Remembers how many rows each claim statement leased."""

    def __init__(self) -> None:
        self.statements: list[int] = []

    def claim_statement(self, leased: int) -> None:
        self.statements.append(leased)


class TestHappyPath:
    async def test_ensure_park_connect_ready(self, rig: ReconcilerRig) -> None:
        """A request is bound by the statement that claims it, ensured with the token of the
        identity bound and parked until its connect deadline; the sidecar's connect wakes it,
        and the next claim marks it ready and drops the lease."""
        allocation = await rig.store.request(provisioner_id="fake", tenant_id="t", spec={"k": 1})
        assert await rig.reconciler.reconcile_next()
        assert "bind_initial_sidecar" not in rig.store.pipelines  # no bind of its own
        parked = await rig.store.get(allocation.id)
        assert parked.status is Status.ALLOCATED
        assert parked.lease_id is None
        assert parked.next_attempt_at == parked.connect_deadline
        assert parked.provisioner_api_version == "1"
        assert parked.external_ref == "ref-1"
        (request,) = rig.provisioner.ensure_calls
        assert request.tenant_id == "t"
        assert request.spec == {"k": 1}
        assert request.sidecar_id == parked.sidecar_id
        assert hash_token(request.token) == parked.token_hash
        assert not await rig.reconciler.reconcile_next()  # parked: nothing due

        await rig.connect(Target(parked.id, parked.generation))
        assert await rig.reconciler.reconcile_next()
        ready = await rig.store.get(allocation.id)
        assert ready.ready
        assert ready.next_attempt_at is None
        assert ready.lease_id is None
        assert await rig.effects(allocation.id, "ensure") == ["intent", "committed"]

    async def test_connect_during_ensure_becomes_ready_in_one_claim(
        self, rig: ReconcilerRig
    ) -> None:
        """A sidecar that connects while ensure is still running is ready when ensure returns,
        without parking."""

        async def ensure_and_connect(request: object) -> object:
            assert hasattr(request, "allocation_id")
            target = Target(request.allocation_id, request.generation)
            await rig.connect(target)
            return Accepted("ref-fast")

        rig.provisioner.ensure_script.append(ensure_and_connect)
        allocation = await rig.store.request(provisioner_id="fake")
        assert await rig.reconciler.reconcile_next()
        ready = await rig.store.get(allocation.id)
        assert ready.ready
        assert ready.external_ref == "ref-fast"

    @pytest.mark.parametrize("hook", [False, True], ids=["park", "mark_allocated"])
    async def test_acceptance_records_endpoint_and_metadata(
        self, rig: ReconcilerRig, hook: bool
    ) -> None:
        """What the provisioner's acceptance says of the sidecar (endpoint, metadata) is on the
        row from the acceptance on, whichever statement records it, and a replacement clears
        it with the generation (a release here)."""

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            return None

        reconciler = rig.make(on_ready=on_ready if hook else None)
        rig.provisioner.ensure_script.append(
            garbage(Accepted("ref-1", endpoint="10.0.0.7:8080", metadata={"pod": "p", "n": [1]}))
        )
        ready = await rig.to_ready(reconciler)
        assert ready.endpoint == "10.0.0.7:8080"
        assert ready.metadata == {"pod": "p", "n": [1]}
        abandoned = await rig.store.release(ready.id)
        assert abandoned.generation == ready.generation + 1
        assert abandoned.endpoint is None
        assert abandoned.metadata is None

    async def test_sidecar_publish_before_acceptance_is_kept(self, rig: ReconcilerRig) -> None:
        """What the generation's sidecar published while ensure ran stays, over the
        provisioner's keys, which the acceptance puts under it (tests/test_published_merge.py
        holds both orders through real publishes)."""

        async def publish_then_accept(request: EnsureRequest) -> object:
            async with rig.db.connection("test") as conn:
                await conn.execute(
                    "UPDATE hubd_allocations SET metadata = '{\"pid\": 7}' WHERE id = $1",
                    request.allocation_id,
                )
            return Accepted("ref-1", endpoint="10.0.0.7:8080", metadata={"pod": "p", "pid": 1})

        rig.provisioner.ensure_script.append(publish_then_accept)
        allocation = await rig.store.request(provisioner_id="fake")
        assert await rig.reconciler.reconcile_next()
        accepted = await rig.store.get(allocation.id)
        assert accepted.status is Status.ALLOCATED
        assert accepted.endpoint == "10.0.0.7:8080"
        assert accepted.metadata == {"pod": "p", "pid": 7}

    async def test_release_destroys_then_releases(self, rig: ReconcilerRig) -> None:
        """Releasing a ready allocation destroys its sidecar, marks it released and retires its
        sockets."""
        ready = await rig.to_ready()
        released = await rig.store.release(ready.id)
        assert released.generation == ready.generation + 1
        assert await rig.reconciler.reconcile_next()
        final = await rig.store.get(ready.id)
        assert final.status is Status.RELEASED
        (destroy,) = rig.provisioner.destroy_calls
        assert destroy.sidecar_id == ready.sidecar_id
        assert destroy.external_ref == "ref-1"
        assert Target(ready.id, final.generation) in rig.router.retired
        assert await rig.effects(ready.id, "destroy") == ["intent", "committed"]

    async def test_disconnect_then_reconnect_restores_ready(self, rig: ReconcilerRig) -> None:
        """A disconnect un-readies the allocation with a connect deadline; a reconnect before it
        makes the allocation ready again under the same generation."""
        ready = await rig.to_ready()
        target = Target(ready.id, ready.generation)
        assert await rig.router.disconnect(target)
        lost = await rig.store.get(ready.id)
        assert not lost.ready
        assert lost.connect_deadline is not None
        assert lost.next_attempt_at == lost.connect_deadline
        await rig.connect(target)
        assert await rig.reconciler.reconcile_next()
        again = await rig.store.get(ready.id)
        assert again.ready
        assert again.generation == ready.generation


class TestEnsureOutcomes:
    @pytest.mark.parametrize(
        ("behaviour", "code", "phase"),
        [
            (fail(RuntimeError("plugin exploded")), "ensure_failed", "failed"),
            (garbage({"kind": "accepted"}), "ensure_failed", "failed"),
            (garbage(None), "ensure_failed", "failed"),
            (garbage(Accepted(123)), "ensure_failed", "failed"),  # type: ignore[arg-type]
            (garbage(Accepted("r", endpoint="")), "ensure_failed", "failed"),
            (garbage(Accepted("r", endpoint="x" * 1025)), "ensure_failed", "failed"),
            (garbage(Accepted("r", endpoint="a\nb")), "ensure_failed", "failed"),
            (garbage(Accepted("r", metadata=[1])), "ensure_failed", "failed"),  # type: ignore[arg-type]
            (garbage(Accepted("r", metadata={"x": float("nan")})), "ensure_failed", "failed"),
            (garbage(Accepted("r", metadata={"x": "y" * 17000})), "ensure_failed", "failed"),
            (reject("quota", retryable=True), "quota", "failed"),
        ],
    )
    async def test_failures_replace(
        self, rig: ReconcilerRig, behaviour: object, code: str, phase: str
    ) -> None:
        """An ensure that raises, returns garbage, or rejects retryably moves the allocation to
        replacing under a new generation with a backoff, fencing the abandoned sidecar."""
        rig.provisioner.ensure_script.append(behaviour)  # type: ignore[arg-type]
        allocation = await rig.store.request(provisioner_id="fake")
        assert await rig.reconciler.reconcile_next()
        replaced = await rig.store.get(allocation.id)
        assert replaced.status is Status.REPLACING
        assert replaced.generation == 2
        assert replaced.failure_code == code
        assert replaced.ensure_attempts == 1
        assert replaced.lease_id is None
        assert Target(allocation.id, 2) in rig.router.fenced
        assert await rig.effects(allocation.id, "ensure") == ["intent", phase]

    async def test_timeout_is_ambiguous_and_replaces(self, rig: ReconcilerRig) -> None:
        """An ensure that outlives operation_timeout is cancelled, recorded ambiguous, and the
        allocation is replaced."""
        gate = Gate()
        rig.provisioner.ensure_script.append(gate)
        allocation = await rig.store.request(provisioner_id="fake")
        assert await rig.reconciler.reconcile_next()
        assert gate.cancelled.is_set()
        replaced = await rig.store.get(allocation.id)
        assert replaced.status is Status.REPLACING
        assert replaced.failure_code == "ensure_failed"
        assert await rig.effects(allocation.id, "ensure") == ["intent", "ambiguous"]

    async def test_non_retryable_rejection_fails(self, rig: ReconcilerRig) -> None:
        """A non-retryable rejection fails the allocation with the plugin's code and retires it."""
        rig.provisioner.ensure_script.append(reject("bad_spec", retryable=False))
        allocation = await rig.store.request(provisioner_id="fake")
        assert await rig.reconciler.reconcile_next()
        failed = await rig.store.get(allocation.id)
        assert failed.status is Status.FAILED
        assert failed.failure_code == "bad_spec"
        assert Target(allocation.id, 1) in rig.router.retired

    async def test_replacement_destroys_then_rebinds(self, rig: ReconcilerRig) -> None:
        """After a failed ensure, the next claim destroys the old sidecar, binds a new identity in
        the new generation and ensures it."""
        rig.provisioner.ensure_script.append(fail(RuntimeError("first try")))
        allocation = await rig.store.request(provisioner_id="fake")
        assert await rig.reconciler.reconcile_next()
        first = await rig.store.get(allocation.id)
        await age_row(rig.db, allocation.id, 5)
        assert await rig.reconciler.reconcile_next()
        second = await rig.store.get(allocation.id)
        assert second.status is Status.ALLOCATED
        assert second.generation == 2
        assert second.sidecar_id != first.sidecar_id
        (destroy,) = rig.provisioner.destroy_calls
        assert destroy.sidecar_id == first.sidecar_id
        assert [c.generation for c in rig.provisioner.ensure_calls] == [1, 2]


class TestDestroyOutcomes:
    @pytest.mark.parametrize(
        "behaviour",
        [fail(OSError("api down")), reject_destroy("busy", retryable=True), garbage("gone")],
    )
    async def test_retry_with_backoff(self, rig: ReconcilerRig, behaviour: object) -> None:
        """A destroy that raises, rejects retryably or returns garbage is retried later with the
        destroy attempt counter bumped; the allocation stays releasing."""
        ready = await rig.to_ready()
        await rig.store.release(ready.id)
        rig.provisioner.destroy_script.append(behaviour)  # type: ignore[arg-type]
        assert await rig.reconciler.reconcile_next()
        retrying = await rig.store.get(ready.id)
        assert retrying.status is Status.RELEASING
        assert retrying.destroy_attempts == 1
        assert retrying.lease_id is None
        assert not await rig.reconciler.reconcile_next()  # backing off
        await age_row(rig.db, ready.id, 2)
        assert await rig.reconciler.reconcile_next()
        assert (await rig.store.get(ready.id)).status is Status.RELEASED

    async def test_non_retryable_is_destroy_failed(self, rig: ReconcilerRig) -> None:
        """A non-retryable destroy rejection ends in destroy_failed for an operator to check."""
        ready = await rig.to_ready()
        await rig.store.release(ready.id)
        rig.provisioner.destroy_script.append(reject_destroy("forbidden", retryable=False))
        assert await rig.reconciler.reconcile_next()
        final = await rig.store.get(ready.id)
        assert final.status is Status.DESTROY_FAILED
        assert final.failure_code == "forbidden"
        assert Target(ready.id, final.generation) in rig.router.retired


class TestProvisionerAvailability:
    async def test_missing_provisioner_fails_pending(self, rig: ReconcilerRig) -> None:
        """A pending allocation whose provisioner is not configured fails as
        provisioner_unavailable: nothing was provisioned."""
        reconciler = make_reconciler(rig.db, rig.router, None)
        allocation = await rig.store.request(provisioner_id="fake")
        assert await reconciler.reconcile_next()
        failed = await rig.store.get(allocation.id)
        assert failed.status is Status.FAILED
        assert failed.failure_code == "provisioner_unavailable"

    async def test_rebound_provisioner_retries_later(self, rig: ReconcilerRig) -> None:
        """An allocation bound to api_version 1 is not handed to a provisioner that now says 2:
        it is retried later, not failed, because its sidecar may exist."""
        ready = await rig.to_ready()
        await rig.store.release(ready.id)
        changed = make_reconciler(rig.db, rig.router, ScriptedProvisioner(api_version="2"))
        assert await changed.reconcile_next()
        waiting = await rig.store.get(ready.id)
        assert waiting.status is Status.RELEASING
        assert waiting.failure_code == "provisioner_unavailable"
        assert waiting.next_attempt_at is not None
        assert waiting.lease_id is None


class TestConnectDeadline:
    @pytest.mark.parametrize("recovery", [False, True])
    async def test_missed_deadline(self, rig: ReconcilerRig, recovery: bool) -> None:
        """A sidecar that never connects is given up at its deadline: replaced when automatic
        recovery is on, released (with the message saying so) when it is off."""
        settings = ReconcilerSettings(
            lease_duration=6,
            connect_timeout=30,
            operation_timeout=1,
            automatic_replacement_recovery=recovery,
        )
        reconciler = rig.make(settings=settings)
        allocation = await rig.store.request(provisioner_id="fake")
        assert await reconciler.reconcile_next()
        await age_row(rig.db, allocation.id, 31)
        assert await reconciler.reconcile_next()
        after = await rig.store.get(allocation.id)
        assert after.generation == 2
        assert after.failure_code == "sidecar_connect_failed"
        if recovery:
            assert after.status is Status.REPLACING
        else:
            assert after.status is Status.RELEASING
            assert after.failure_message is not None
            assert after.failure_message.startswith("Automatic recovery is disabled:")

    async def test_sidecar_lost_between_claim_and_look_gets_the_fresh_deadline(
        self, rig: ReconcilerRig
    ) -> None:
        """A takeover makes a ready allocation due, and the claim reads it with no connect
        deadline (a connected row has none). The sidecar drops just before the claim looks at
        its record: the deadline the disconnect wrote counts, not the claimed copy's missing
        one, so the allocation is parked at its generation until then, not given up."""

        class DropBeforeTheLook:
            armed: Target | None = None

            async def at(self, site: Site) -> None:
                if site.boundary is Boundary.BEFORE_READINESS and self.armed is not None:
                    target, self.armed = self.armed, None
                    assert await rig.router.disconnect(target)

        drop = DropBeforeTheLook()
        reconciler = rig.make(faults=drop)
        ready = await rig.to_ready(reconciler)
        target = Target(ready.id, ready.generation)
        await rig.connect(target)  # the sidecar's new socket takes over
        assert (await rig.store.get(ready.id)).connect_deadline is None
        drop.armed = target
        assert await reconciler.reconcile_next()
        assert drop.armed is None
        after = await rig.store.get(ready.id)
        assert after.status is Status.ALLOCATED
        assert after.generation == ready.generation
        assert not after.ready
        assert after.lease_id is None
        assert after.connect_deadline is not None
        assert after.next_attempt_at == after.connect_deadline
        kinds = [entry.kind for entry in await rig.ledger.history(ready.id)]
        assert kinds[-1] == "park_await_connection"
        assert not [kind for kind in kinds if kind.startswith("begin_")]

    async def test_a_record_written_back_between_the_look_and_the_give_up_wins(
        self, rig: ReconcilerRig
    ) -> None:
        """A replica froze and a peer swept its record (no window left here, to reach the
        race); a claim looks at the record, finds none past the deadline, and is about to give
        the sidecar up when the resumed replica writes its record back. The give-up is fenced
        on the connection number the claim saw: the allocation keeps its generation and reads
        ready again, and nothing is released for a socket that stayed open."""
        settings = ReconcilerSettings(
            lease_duration=6, connect_timeout=30, operation_timeout=1
        )  # automatic recovery off: a give-up would release
        held = ConnectionStore(rig.db, instance_id=rig.router.instance_id)

        class WriteBackAfterTheLook:
            armed: tuple[str, Target, str] | None = None
            written_back: int | None = None

            async def at(self, site: Site) -> None:
                if site.boundary is Boundary.AFTER_READINESS and self.armed is not None:
                    connection_id, target, sidecar_id = self.armed
                    self.armed = None
                    self.written_back = await held.reassert(connection_id, target, sidecar_id)

        hook = WriteBackAfterTheLook()
        reconciler = rig.make(settings=settings, faults=hook)
        await rig.router.heartbeat()
        ready = await rig.to_ready(reconciler)
        assert ready.sidecar_id is not None
        target, connection_id = rig.router.current[ready.id]
        async with rig.db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour' WHERE id = $1",
                rig.router.instance_id,
            )
        peer = ConnectionStore(rig.db, instance_id="peer")
        swept = await peer.sweep_stale(20, connect_timeout=0)
        assert [s.allocation_id for s in swept] == [ready.id]
        hook.armed = (connection_id, target, ready.sidecar_id)
        assert await reconciler.reconcile_next()
        assert hook.armed is None
        assert hook.written_back is not None
        await reconciler.reconcile_until_idle()
        after = await rig.store.get(ready.id)
        assert after.status is Status.ALLOCATED
        assert after.generation == ready.generation
        assert after.ready
        kinds = [entry.kind for entry in await rig.ledger.history(ready.id)]
        assert "connection_swept" in kinds
        assert not [kind for kind in kinds if kind.startswith("begin_")], kinds


class TestHooks:
    async def test_hook_runs_under_marker(self, rig: ReconcilerRig) -> None:
        """on_ready runs after the initialization marker is durable and before ready."""
        seen: list[Allocation] = []

        async def on_ready(allocation: Allocation, context: HookContext) -> None:
            seen.append(await rig.store.get(allocation.id))
            assert context.lease_id == allocation.initialization_lease_id

        reconciler = rig.make(on_ready=on_ready)
        ready = await rig.to_ready(reconciler)
        (during,) = seen
        assert during.initialization_lease_id is not None
        assert not during.ready
        assert ready.initialization_lease_id is None

    async def test_hook_failure_retries_later(self, rig: ReconcilerRig) -> None:
        """A hook that raises schedules a retry at the capped backoff and clears the marker."""

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            raise RuntimeError("hub busy")

        after = await rig.after_on_ready(on_ready)
        assert after.status is Status.ALLOCATED
        assert not after.ready
        assert after.failure_code == "sidecar_initialization_failed"
        assert after.initialization_lease_id is None
        assert after.lease_id is None

    async def test_uncertain_hook_replaces(self, rig: ReconcilerRig) -> None:
        """A hook that reports uncertainty abandons the sidecar (a release while automatic
        recovery is off)."""

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            raise InitializationUncertain("sender may be half deployed")

        after = await rig.after_on_ready(on_ready)
        assert after.status is Status.RELEASING
        assert after.failure_code == "sidecar_initialization_uncertain"

    async def test_disconnect_during_initialization(self, rig: ReconcilerRig) -> None:
        """A disconnect recorded while on_ready runs leaves the claim's lease alone, and turns
        its mark-ready into an immediate follow-up; the follow-up finds no sidecar and parks
        until the new connect deadline, at the same generation."""
        hook_started = asyncio.Event()
        hook_may_finish = asyncio.Event()

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            hook_started.set()
            await hook_may_finish.wait()

        reconciler = rig.make(on_ready=on_ready)
        allocation = await rig.store.request(provisioner_id="fake")
        assert await reconciler.reconcile_next()
        target = Target(allocation.id, 1)
        await rig.connect(target)
        claim = asyncio.create_task(reconciler.reconcile_next())
        await hook_started.wait()
        claimed = await rig.store.get(allocation.id)
        assert await rig.router.disconnect(target)
        lost = await rig.store.get(allocation.id)
        assert lost.lease_id == claimed.lease_id, "a disconnect must not touch a claim's lease"
        hook_may_finish.set()
        assert await claim
        follow_up = await rig.store.get(allocation.id)
        assert not follow_up.ready
        assert follow_up.initialization_lease_id is None
        assert follow_up.lease_id is None
        assert follow_up.next_attempt_at is not None
        assert follow_up.next_attempt_at < follow_up.connect_deadline  # due now, not parked
        assert await reconciler.reconcile_next()
        parked = await rig.store.get(allocation.id)
        assert parked.status is Status.ALLOCATED
        assert parked.generation == 1
        assert parked.next_attempt_at == parked.connect_deadline

    async def test_timed_out_hook_is_uncertain(self, rig: ReconcilerRig) -> None:
        """An on_ready hook that outlives operation_timeout may still be at work: its outcome
        is uncertain, never a clean failure, so the sidecar is abandoned rather than
        initialized a second time."""

        async def on_ready(_allocation: Allocation, _context: HookContext) -> None:
            await asyncio.Event().wait()

        after = await rig.after_on_ready(on_ready)
        assert after.status is Status.RELEASING
        assert after.failure_code == "sidecar_initialization_uncertain"
        kinds = [e.kind for e in await rig.ledger.history(after.id)]
        assert "schedule_retry" not in kinds

    async def test_connect_during_initialization_schedules_follow_up(
        self, rig: ReconcilerRig
    ) -> None:
        """A connect that lands while on_ready runs schedules an immediate follow-up instead of
        marking ready; the follow-up then marks it ready."""
        reconciler: Reconciler | None = None
        calls = 0

        async def on_ready(allocation: Allocation, _context: HookContext) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                # The sidecar restarted and its new socket took over (on this replica or any
                # other: the record is the whole event).
                assert await rig.router.connect(Target(allocation.id, allocation.generation))

        reconciler = rig.make(on_ready=on_ready)
        allocation = await rig.allocated_and_connected(reconciler)
        assert await reconciler.reconcile_next()
        follow_up = await rig.store.get(allocation.id)
        assert not follow_up.ready
        assert follow_up.initialization_lease_id is None
        assert await reconciler.reconcile_next()
        assert (await rig.store.get(allocation.id)).ready
        assert calls == 2


class TestOwnershipAtThePointOfEffect:
    async def test_plugin_resumed_after_the_deadline_does_not_act(self, rig: ReconcilerRig) -> None:
        """A claim paused past its local lease deadline in the middle of ensure (the clock
        jumps, and the plugin's own wake-up arrives in the same instant): the plugin finds it
        no longer owns the allocation and starts nothing, and the claim writes no outcome."""
        clock = ManualClock()
        reconciler = rig.make(clock=clock)
        started, resume = asyncio.Event(), asyncio.Event()
        acted: list[str] = []

        async def ensure(request: EnsureRequest) -> object:
            started.set()
            await resume.wait()
            if not request.ownership.still_owned():
                return Rejected(code="claim_lost", message="not owned", retryable=True)
            acted.append(request.sidecar_id)
            return Accepted("ref")

        rig.provisioner.ensure_script.append(ensure)
        allocation = await rig.store.request(provisioner_id="fake")
        claim = asyncio.create_task(reconciler.reconcile_next())
        await started.wait()
        clock.advance(SETTINGS.lease_duration + 1)
        resume.set()
        assert await claim
        await reconciler.drain()
        assert acted == []
        assert await rig.effects(allocation.id, "ensure") == ["intent"]
        assert (await rig.store.get(allocation.id)).status is Status.PROVISIONING

    async def test_requests_carry_the_claims_deadline(self, rig: ReconcilerRig) -> None:
        """Ensure is told the claim's deadline: owned while the lease is, and on the wall clock
        no later than the lease the database granted (a conservative estimate)."""
        seen: list[tuple[bool, object, object]] = []

        async def ensure(request: EnsureRequest) -> object:
            row = await rig.store.get(request.allocation_id)
            seen.append((request.ownership.still_owned(), request.ownership.deadline_utc(), row))
            return Accepted("ref")

        rig.provisioner.ensure_script.append(ensure)
        await rig.store.request(provisioner_id="fake")
        assert await rig.reconciler.reconcile_next()
        ((owned, deadline_utc, row),) = seen
        assert owned
        assert isinstance(row, Allocation)
        assert row.lease_expires_at is not None
        assert isinstance(deadline_utc, datetime)
        assert deadline_utc <= row.lease_expires_at
        assert deadline_utc > row.lease_expires_at - timedelta(seconds=SETTINGS.lease_duration / 2)


class TestLeases:
    async def test_stolen_lease_mid_ensure_writes_nothing(self, rig: ReconcilerRig) -> None:
        """When a second reconciler takes the lease while the first is inside ensure, the first
        writes nothing afterwards: the row and the ledger show only the second's work."""
        settings = ReconcilerSettings(lease_duration=30, connect_timeout=30, operation_timeout=10)
        first = rig.make(settings=settings, instance_id="first")
        second = rig.make(settings=settings, instance_id="second")
        blocked = await rig.blocked_in_ensure(first, Gate(Accepted("late")))
        allocation = blocked.allocation
        first_lease = (await rig.store.get(allocation.id)).lease_id

        await expire_lease(rig.db, allocation.id)
        assert await second.reconcile_next()  # provisioning: ensure outcome unknown → replace
        stolen = await rig.store.get(allocation.id)
        assert stolen.status is Status.REPLACING
        assert stolen.failure_code == "ensure_outcome_unknown"
        history_before = await rig.ledger.history(allocation.id)

        blocked.gate.release.set()
        assert await blocked.task
        assert await rig.store.get(allocation.id) == stolen
        history_after = await rig.ledger.history(allocation.id)
        assert history_after == history_before
        by_first = [(e.kind, str(e.phase)) for e in history_after if e.instance_id == "first"]
        assert by_first == [("bind_sidecar", "committed"), ("ensure", "intent")]
        ambiguous = [e for e in history_after if e.phase is Phase.AMBIGUOUS]
        assert [(e.kind, e.lease_id) for e in ambiguous] == [("ensure", first_lease)]

    async def test_a_claim_fenced_by_a_release_gives_its_lease_back(
        self, rig: ReconcilerRig
    ) -> None:
        """A release lands while a claim is inside ensure (the release keeps the claim's lease,
        so no other claim starts meanwhile). The claim's next write is fenced and it stops; it
        then gives the lease back at once rather than let the row wait out the lease (or the
        poll after it): the release is claimable, and done, right away."""
        settings = ReconcilerSettings(lease_duration=60, connect_timeout=30, operation_timeout=10)
        reconciler = rig.make(settings=settings)
        blocked = await rig.blocked_in_ensure(reconciler, Gate(Accepted("made")))
        allocation = blocked.allocation
        await rig.store.release(allocation.id)
        leased = await rig.store.get(allocation.id)
        assert leased.lease_id is not None  # the release left the claim its lease
        blocked.gate.release.set()
        assert await blocked.task
        given_back = await rig.store.get(allocation.id)
        assert given_back.status is Status.RELEASING
        assert given_back.lease_id is None
        assert await reconciler.reconcile_next()  # the destroy, with no lease to wait out
        assert (await rig.store.get(allocation.id)).status is Status.RELEASED
        # The claim's ensure intent stays open for the destroy to settle: giving the lease
        # back is not a statement that ensure was never called.
        ensure = [e for e in await rig.ledger.history(allocation.id) if e.kind == "ensure"]
        assert "not_called" not in {e.error_code for e in ensure}

    async def test_refused_renewal_aborts_the_claim(self, rig: ReconcilerRig) -> None:
        """When renewal is refused (the row's lease changed), the claim is aborted: the plugin
        call is cancelled and no further write is made."""
        blocked = await rig.blocked_in_ensure(rig.make(settings=_renewing()))
        async with rig.db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = 'ls_other' WHERE id = $1",
                blocked.allocation.id,
            )
        before = await rig.store.get(blocked.allocation.id)
        assert await blocked.task
        assert blocked.gate.cancelled.is_set()
        assert await rig.store.get(blocked.allocation.id) == before

    async def test_a_cancellation_from_outside_is_not_taken_for_the_lease_loss(
        self, rig: ReconcilerRig
    ) -> None:
        """A claim whose lease deadline passes and whose task is cancelled from outside (a
        shutdown) in the same instant ends cancelled: the claim withdraws only its own
        cancellation. Its plugin call is cancelled and it writes nothing."""
        clock = ManualClock()
        reconciler = rig.make(clock=clock)
        blocked = await rig.blocked_in_ensure(reconciler)
        before = await rig.store.get(blocked.allocation.id)
        clock.advance(SETTINGS.lease_duration + 1)
        # The deadline's timer goes off on the loop, after this; the shutdown's cancel is first.
        blocked.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked.task
        assert blocked.gate.cancelled.is_set()
        await reconciler.drain()
        assert await rig.store.get(blocked.allocation.id) == before
        assert reconciler.active_claims == 0

    async def test_renewal_error_aborts_the_claim(self, rig: ReconcilerRig) -> None:
        """When renewal fails with a database error, the claim is aborted and makes no write."""
        db = await connect_database(rig.database_url)
        try:
            reconciler = make_reconciler(db, rig.router, rig.provisioner, settings=_renewing())
            blocked = await rig.blocked_in_ensure(reconciler)
            before = await rig.store.get(blocked.allocation.id)
            db.lease_pool.terminate()
            assert await blocked.task
            assert blocked.gate.cancelled.is_set()
            assert await rig.store.get(blocked.allocation.id) == before
        finally:
            await db.close()

    async def test_abandoned_reconciler_then_fresh_one(self, rig: ReconcilerRig) -> None:
        """A reconciler abandoned mid-ensure (its process gone: connections dead, plugin stuck)
        is followed after lease expiry by a fresh one that finds provisioning, replaces it, and
        records the first ensure as ambiguous."""
        dead_db = await connect_database(rig.database_url)
        settings = ReconcilerSettings(lease_duration=30, connect_timeout=30, operation_timeout=20)
        abandoned = make_reconciler(
            dead_db, rig.router, rig.provisioner, settings=settings, instance_id="dead"
        )
        orphan = await rig.blocked_in_ensure(abandoned, Gate(ignore_cancel=True))
        allocation = orphan.allocation
        dead_db.terminate()  # the process is gone: nothing it could still send arrives

        await age_row(rig.db, allocation.id, 31)
        fresh = make_reconciler(rig.db, rig.router, ScriptedProvisioner(), instance_id="fresh")
        assert await fresh.reconcile_next()
        replaced = await rig.store.get(allocation.id)
        assert replaced.status is Status.REPLACING
        assert replaced.failure_code == "ensure_outcome_unknown"
        ensure_phases = await rig.effects(allocation.id, "ensure")
        assert ensure_phases == ["intent", "ambiguous"]
        settled = [e for e in await rig.ledger.history(allocation.id) if e.phase is Phase.AMBIGUOUS]
        assert settled[0].instance_id == "fresh"

        orphan.task.cancel()
        orphan.gate.release.set()
        with pytest.raises(asyncio.CancelledError):
            await orphan.task
        await abandoned.drain()

    async def test_admission_is_bounded(self, rig: ReconcilerRig) -> None:
        """With max_concurrent_claims=1, a second claim is not admitted while one runs."""
        settings = ReconcilerSettings(
            lease_duration=30, connect_timeout=30, operation_timeout=10, max_concurrent_claims=1
        )
        reconciler = rig.make(settings=settings)
        running = await rig.blocked_in_ensure(reconciler)
        await rig.store.request(provisioner_id="fake")
        assert not await reconciler.reconcile_next()
        running.gate.release.set()
        assert await running.task
        assert await reconciler.reconcile_next()

    async def test_plugin_ignoring_cancellation_keeps_allocation_excluded(
        self, rig: ReconcilerRig
    ) -> None:
        """An ensure that ignores cancellation after its timeout keeps its allocation out of new
        claims (and counts against capacity) until it finally settles."""
        settings = ReconcilerSettings(
            lease_duration=scaled(6),
            connect_timeout=30,
            operation_timeout=scaled(0.5),
            max_concurrent_claims=1,
        )
        reconciler = rig.make(settings=settings)
        gate = Gate(ignore_cancel=True)
        rig.provisioner.ensure_script.append(gate)
        allocation = await rig.store.request(provisioner_id="fake")
        assert await reconciler.reconcile_next()  # times out, replaces, claim ends
        assert gate.cancelled.is_set()
        assert allocation.id in reconciler.busy_allocations()
        await age_row(rig.db, allocation.id, 5)
        assert not await reconciler.reconcile_next()  # no capacity while it runs
        gate.release.set()
        await gate.finished.wait()
        await poll_until(lambda: _not_busy(reconciler, allocation.id))
        assert await reconciler.reconcile_next()


async def _not_busy(reconciler: Reconciler, allocation_id: str) -> bool:
    return allocation_id not in reconciler.busy_allocations()


class TestConnectionRaces:
    async def test_disconnect_and_reconnect_racing_end_ready(self, rig: ReconcilerRig) -> None:
        """A disconnect and the sidecar's reconnect racing on one allocation, in either order,
        leave a live record and a row that is due, and the next claim marks it ready at the
        same generation."""
        ready = await rig.to_ready()
        target = Target(ready.id, ready.generation)
        old = rig.router.current[ready.id][1]
        await asyncio.gather(
            rig.router.connections.disconnect(ready.id, old, connect_timeout=30),
            rig.router.connect(target),
        )
        assert await rig.router.connections.is_connected(target, 20)
        assert await rig.reconciler.reconcile_next()
        again = await rig.store.get(ready.id)
        assert again.ready
        assert again.generation == ready.generation

    async def test_late_disconnect_cannot_undo_a_newer_record(self, rig: ReconcilerRig) -> None:
        """The close of a socket whose record another socket already replaced clears nothing
        and marks nothing lost."""
        ready = await rig.to_ready()
        target = Target(ready.id, ready.generation)
        old = rig.router.current[ready.id][1]
        await rig.router.connect(target)  # the takeover
        assert await rig.reconciler.reconcile_next()
        before = await rig.store.get(ready.id)
        assert before.ready
        assert not await rig.router.connections.disconnect(ready.id, old, connect_timeout=30)
        after = await rig.store.get(ready.id)
        assert after.ready
        assert after.connection_seq == before.connection_seq


class TestRepair:
    async def test_initialize_marks_unconnected_lost_and_wakes_unscheduled(
        self, rig: ReconcilerRig
    ) -> None:
        """Start-up repair treats a ready-looking allocation whose record is gone (its hub
        crashed) as lost, keeping a deadline, and wakes an active row that nothing scheduled."""
        ready = await rig.to_ready()
        unscheduled = await rig.store.request(provisioner_id="fake")
        async with rig.db.pool.acquire() as conn:
            await conn.execute(
                "DELETE FROM hubd_sidecar_connections WHERE allocation_id = $1", ready.id
            )
            await conn.execute(
                "UPDATE hubd_allocations SET next_attempt_at = NULL WHERE id = $1", unscheduled.id
            )
        await rig.reconciler.initialize()
        lost = await rig.store.get(ready.id)
        assert not lost.ready
        assert lost.next_attempt_at is not None
        assert lost.next_attempt_at == lost.connect_deadline
        assert (await rig.store.get(unscheduled.id)).next_attempt_at is not None
        assert Target(ready.id, ready.generation) in rig.router.fenced

    async def test_repair_schedules_only_unconnected(self, rig: ReconcilerRig) -> None:
        """The repair sweep leaves a connected sidecar alone and, on a peer, schedules a
        ready-looking row whose only record sits on an instance that stopped heartbeating."""
        ready = await rig.to_ready()
        assert await rig.reconciler.repair_unscheduled_connections() == 0
        assert (await rig.store.get(ready.id)).ready
        async with rig.db.pool.acquire() as conn:
            await conn.execute("UPDATE hubd_instances SET heartbeat_at = now() - interval '1 hour'")
        # The instance holding the socket never repairs its own record away; a peer does.
        assert await rig.reconciler.repair_unscheduled_connections() == 0
        peer = make_reconciler(
            rig.db, RecordingRouter(rig.db, instance_id="in_peer"), None, instance_id="in_peer"
        )
        assert await peer.repair_unscheduled_connections() == 1
        repaired = await rig.store.get(ready.id)
        assert not repaired.ready
        assert repaired.next_attempt_at == repaired.connect_deadline

    async def test_repair_leaves_a_claimed_row_to_its_claim(self, rig: ReconcilerRig) -> None:
        """A row a claim holds is never repaired, whatever its records say: the claim's lease
        decides, and a repair write must not touch it."""
        ready = await rig.to_ready()
        async with rig.db.pool.acquire() as conn:
            await conn.execute(
                "DELETE FROM hubd_sidecar_connections WHERE allocation_id = $1", ready.id
            )
            await conn.execute(
                "UPDATE hubd_allocations SET lease_id = 'ls_other', "
                "lease_expires_at = now() + interval '1 minute' WHERE id = $1",
                ready.id,
            )
        assert await rig.reconciler.repair_unscheduled_connections() == 0
        after = await rig.store.get(ready.id)
        assert after.ready
        assert after.lease_id == "ls_other"


class TestStalledSteps:
    async def test_stalled_claim_step_aborts_the_claim(self, rig: ReconcilerRig) -> None:
        """When the claim's queued write cannot finish within operation_timeout (its row locked
        elsewhere), the claim is aborted and writes nothing more; the step stays queued, keeping
        the allocation out of claims, and settles as the one write it already was."""
        import asyncpg

        settings = ReconcilerSettings(
            lease_duration=scaled(6), connect_timeout=30, operation_timeout=scaled(0.5)
        )
        reconciler = rig.make(settings=settings)
        blocked = await rig.blocked_in_ensure(reconciler)
        allocation = blocked.allocation
        blocker = await asyncpg.connect(rig.database_url)
        try:
            tx = blocker.transaction()
            await tx.start()
            await blocker.execute(
                "SELECT 1 FROM hubd_allocations WHERE id = $1 FOR UPDATE", allocation.id
            )
            blocked.gate.release.set()
            assert await blocked.task
            assert allocation.id in reconciler.busy_allocations()
            assert not await reconciler.reconcile_next()  # excluded while its step is stuck
            await tx.rollback()
        finally:
            await blocker.close()
        await poll_until(lambda: _not_busy(reconciler, allocation.id))
        kinds = [(e.kind, str(e.phase)) for e in await rig.ledger.history(allocation.id)]
        # The acceptance (with the ensure's outcome and the park) was stuck behind the lock when
        # the claim gave up; it settles as that one statement, and nothing is written after it.
        assert kinds == [
            ("request", "committed"),
            ("bind_sidecar", "committed"),
            ("ensure", "intent"),
            ("ensure", "committed"),
            ("mark_allocated", "committed"),
            ("park_await_connection", "committed"),
        ]


class TestReplacementBackoff:
    async def test_backoff_grows_across_generations_to_the_cap(self, rig: ReconcilerRig) -> None:
        """An ensure that raises every time is replaced with a delay that doubles from one
        generation to the next up to the 30 s cap, never restarting at the first delay (with
        no replacement limit: the default gives up after five)."""
        reconciler = rig.make(
            settings=attrs.evolve(SETTINGS, replacement_limit=NO_REPLACEMENT_LIMIT)
        )
        rig.provisioner.default_ensure = fail(RuntimeError("plugin bug"))
        allocation = await rig.store.request(provisioner_id="fake")
        delays = []
        for _ in range(7):
            await age_row(rig.db, allocation.id, 60)
            assert await reconciler.reconcile_next()
            async with rig.db.pool.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT status, extract(epoch FROM next_attempt_at - updated_at) AS delay "
                    "FROM hubd_allocations WHERE id = $1",
                    allocation.id,
                )
            if row["status"] == "replacing":
                delays.append(round(float(row["delay"])))
        assert delays == [1, 2, 4, 8, 16, 30, 30]

    async def test_plugin_exception_is_logged_with_its_traceback(self, rig: ReconcilerRig) -> None:
        """An ensure that raises is logged with its traceback: at warning the first time for an
        allocation, at debug when it raises again."""
        rig.provisioner.default_ensure = fail(RuntimeError("plugin bug"))
        allocation = await rig.store.request(provisioner_id="fake")
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                await age_row(rig.db, allocation.id, 60)
                assert await rig.reconciler.reconcile_next()
        raised = [entry for entry in logs if entry["event"] == "ensure_raised"]
        assert [entry["log_level"] for entry in raised] == ["warning", "debug"]
        assert all(entry["exc_info"] is True for entry in raised)
        assert raised[0]["provisioner"] == "fake"

    async def test_a_plugin_reraising_one_exception_does_not_grow_its_traceback(
        self, rig: ReconcilerRig
    ) -> None:
        """A plugin that raises the same exception object on every call finds it with no
        traceback each time: the hub drops what it logged, so earlier raises' frames are never
        chained on and kept alive."""
        cached = RuntimeError("cached plugin error")
        held: list[int] = []

        async def raise_cached(_request: Any) -> object:
            held.append(len(traceback.extract_tb(cached.__traceback__)))
            raise cached

        rig.provisioner.default_ensure = raise_cached
        allocation = await rig.store.request(provisioner_id="fake")
        for _ in range(4):
            await age_row(rig.db, allocation.id, 60)
            assert await rig.reconciler.reconcile_next()
        assert held == [0, 0, 0, 0]


class TestLogLevels:
    async def test_a_database_outage_mid_claim_is_a_warning(self, rig: ReconcilerRig) -> None:
        """A claim that meets a database that cannot answer logs a warning, not an error: an
        outage is an expected condition, and the row is retried once it is back."""
        import structlog.testing

        own = await connect_database(rig.database_url, pool_size=4)
        reconciler = make_reconciler(own, rig.router, rig.provisioner)

        async def ensure_then_lose_the_database(_request: object) -> object:
            await own.pool.close()
            return Accepted("ref")

        rig.provisioner.ensure_script.append(ensure_then_lose_the_database)
        await rig.store.request(provisioner_id="fake")
        try:
            with structlog.testing.capture_logs() as logs:
                await reconciler.reconcile_next()
                await reconciler.drain()
        finally:
            own.terminate()
        failed = [e for e in logs if e["event"] == "reconciliation_failed"]
        assert failed
        assert {e["log_level"] for e in failed} == {"warning"}

    async def test_a_lifecycle_says_ready_and_released_at_info(self, rig: ReconcilerRig) -> None:
        """Plugin calls that did their job are at debug (the ledger keeps them); the claims of a
        lifecycle say ``allocation_ready`` and ``allocation_released`` at info, each with the
        allocation and its generation. An ensure the plugin rejected stays at info: it explains the
        retry."""
        with structlog.testing.capture_logs() as logs:
            ready = await rig.to_ready()
            await rig.store.release(ready.id)
            assert await rig.reconciler.reconcile_next()
        said = [(e["event"], e["generation"]) for e in logs if e["log_level"] != "debug"]
        assert said == [
            ("allocation_ready", ready.generation),
            ("allocation_released", ready.generation + 1),
        ]
        assert all(e["allocation_id"] == ready.id for e in logs if "allocation_id" in e)
        finished = [e for e in logs if e["event"].endswith("_finished")]
        assert [(e["event"], e["outcome"], e["log_level"]) for e in finished] == [
            ("ensure_finished", "Accepted", "debug"),
            ("destroy_finished", "Destroyed", "debug"),
        ]

        rig.provisioner.default_ensure = reject("quota", retryable=True)
        other = await rig.store.request(provisioner_id="fake")
        with structlog.testing.capture_logs() as logs:
            assert await rig.reconciler.reconcile_next()
        (rejected,) = [e for e in logs if e["event"] == "ensure_finished"]
        assert (rejected["outcome"], rejected["log_level"]) == ("Rejected", "info")
        assert rejected["allocation_id"] == other.id


class TestDispatch:
    async def test_one_batch_fills_every_free_slot_and_a_finished_claim_frees_one(
        self, rig: ReconcilerRig
    ) -> None:
        """With four claim slots and six due allocations, one batch claims four, each running
        on its own; no slot is left, so the next batch claims nothing. Once the claims end
        (their sidecars' ensures answer), a wake-up says so when the slots are really free, and
        the next batch takes the remaining two."""
        woken: list[int] = []
        """The free slots each wake-up found: one must find the slot it announces free."""
        observer = StatementCounter()
        reconciler = Reconciler(
            store=rig.store,
            ledger=LedgerStore(rig.db, instance_id="in_test"),
            connections=ConnectionStore(rig.db, instance_id="in_test"),
            provisioners={rig.provisioner.id: rig.provisioner},
            router=rig.router,
            hub_ws_url="ws://127.0.0.1:1",
            settings=SETTINGS,
            on_settled=lambda: woken.append(reconciler.free_capacity),
            observer=observer,
        )
        release = asyncio.Event()
        gates = [Gate(release=release) for _ in range(6)]
        rig.provisioner.ensure_script.extend(gates)
        ids = [(await rig.store.request(provisioner_id=rig.provisioner.id)).id for _ in range(6)]
        assert await reconciler.claim_batch() == SETTINGS.max_concurrent_claims
        await asyncio.wait_for(asyncio.gather(*(g.started.wait() for g in gates[:4])), scaled(10))
        assert reconciler.active_claims == 4
        assert reconciler.free_capacity == 0
        assert await reconciler.claim_batch() == 0
        release.set()
        await asyncio.wait_for(reconciler.wait_claims(), scaled(10))
        assert max(woken) == SETTINGS.max_concurrent_claims
        assert reconciler.free_capacity == SETTINGS.max_concurrent_claims
        assert await reconciler.claim_batch() == 2
        await asyncio.wait_for(reconciler.wait_claims(), scaled(10))
        statuses = {(await rig.store.get(aid)).status for aid in ids}
        assert statuses == {Status.ALLOCATED}
        assert len(rig.provisioner.ensure_calls) == 6
        # With no slot free no statement ran; with nothing due one ran and leased nothing.
        assert await reconciler.claim_batch() == 0
        assert observer.statements == [4, 2, 0]
