"""AllocationStore: the statements on ``hubd_allocations``, for one hub instance.

Requests and releases from applications, an operator's forget, reads, the wake-up of a connect,
a provisioner's report of dead sidecars, the deadline and repair sweeps, a claim's statements
(claims and leases: ``claims.sql``; sweeps: ``sweeps.sql``), its fenced transitions, run by
:meth:`AllocationStore.write` (the values: :mod:`hubd.store.transitions`), and orphan
collection's: one class, so that a claim and everything it writes share one set of pipelines.

A lease is held while its expiry, on the database clock, is ahead: no other claimer can take
the row, and every fenced write of the claim checks it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Final

import asyncpg

from hubd.errors import AllocationNotFound
from hubd.routing import Target
from hubd.store.database import Database, Pool
from hubd.store.inputs import (
    bounded_message,
    new_effect_id,
    validate_allocation_id,
    validate_label,
    validate_provisioner_id,
    validate_spec,
)
from hubd.store.pipeline import Pipeline
from hubd.store.queries import Bound, load_queries
from hubd.store.rows import (
    Allocation,
    Claimed,
    Deadlines,
    Fence,
    InitialBinds,
    ProvisionerLimits,
    SidecarDeath,
    Status,
)
from hubd.store.transitions import Transition

__all__ = ["FORGOTTEN", "AllocationStore", "Deadlines", "ProvisionerLimits"]

SQL = load_queries("allocations.sql")
CLAIMS = load_queries("claims.sql")
SWEEPS = load_queries("sweeps.sql")
LIMITS = load_queries("provisioner_limits.sql")

FORGOTTEN: Final = "forgotten"
"""The failure code of an allocation an operator forgot (forget_allocation writes it)."""


class AllocationStore:
    """The statements on ``hubd_allocations``, for one hub instance."""

    def __init__(self, db: Database, *, instance_id: str) -> None:
        self._db = db
        self.instance_id = instance_id
        # One per fenced transition, made on first use: concurrent claims writing the same
        # transition share a round trip and a commit (hubd.store.pipeline).
        self._pipelines: dict[str, Pipeline] = {}

    @property
    def pipelines(self) -> Mapping[str, Pipeline]:
        """The fenced transitions' pipelines made so far, by statement name."""
        return self._pipelines

    async def write(self, fence: Fence, transition: Transition) -> Allocation | None:
        """Run ``transition`` under ``fence``: the row it wrote, or ``None`` when the fence
        matched nothing (then the claim is lost). Concurrent claims writing the same
        transition share a round trip and a commit (:mod:`hubd.store.pipeline`)."""
        pipeline = self._pipelines.get(transition.name)
        if pipeline is None:
            pipeline = self._pipelines[transition.name] = Pipeline(
                self._db, transition.statement, set_form=transition.set_form
            )
        query = transition.bind(fence, self.instance_id)
        row = await pipeline.fetchrow(transition.what, fence.allocation_id, query)
        return Allocation.from_row(row) if row is not None else None

    # -- requests from applications -------------------------------------------------------

    async def request(
        self,
        *,
        provisioner_id: str,
        tenant_id: str | None = None,
        session_id: str | None = None,
        spec: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
        ready_when: str | None = None,
        lifetime: float | None = None,
        idle_timeout: float | None = None,
        conn: asyncpg.Connection | None = None,
    ) -> Allocation:
        """Create a pending allocation, through the function applications call
        (``hubd_v1.request``, docs/api.md).

        With ``conn``, the row is written on the caller's connection: inside the caller's
        transaction it is invisible, and no daemon is woken, until that transaction commits.
        A key already used returns its allocation; one used for another request raises
        :class:`~hubd.errors.IdempotencyConflict`. ``lifetime`` (seconds; default: the
        provisioner's ``max_lifetime``, if any) bounds its life from now; ``idle_timeout``
        (seconds; default: the provisioner's, if any; never longer) its idleness once ready.
        """
        row = await self._db.fetchrow(
            "request allocation",
            SQL.insert_allocation(
                provisioner_id=validate_provisioner_id(provisioner_id),
                tenant_id=validate_label("tenant_id", tenant_id),
                session_id=validate_label("session_id", session_id),
                spec=json.dumps(validate_spec(spec)),
                idempotency_key=validate_label("idempotency_key", idempotency_key),
                ready_when=ready_when,
                instance_id=self.instance_id,
                lifetime=None if lifetime is None else float(lifetime),
                idle_timeout=None if idle_timeout is None else float(idle_timeout),
            ),
            conn=conn,
        )
        assert row is not None
        return Allocation.from_row(row)

    async def extend(self, allocation_id: str, lifetime: float) -> Allocation:
        """The allocation now ends ``lifetime`` seconds from now, within its provisioner's
        ``max_lifetime`` (:class:`~hubd.errors.InvalidRequest` beyond it); an allocation being
        released or ended is returned as it is."""
        row = await self._db.fetchrow(
            "extend allocation",
            SQL.extend_allocation(
                allocation_id=validate_allocation_id(allocation_id),
                lifetime=float(lifetime),
                instance_id=self.instance_id,
            ),
        )
        assert row is not None
        return Allocation.from_row(row)

    async def touch(self, allocation_id: str) -> Allocation:
        """The application is still using the allocation: its idle clock starts again."""
        row = await self._db.fetchrow(
            "touch allocation",
            SQL.touch_allocation(allocation_id=validate_allocation_id(allocation_id)),
        )
        assert row is not None
        return Allocation.from_row(row)

    async def set_limits(self, limits: Mapping[str, ProvisionerLimits]) -> None:
        """Record what this daemon's provisioners allow, by provisioner id."""
        ids = sorted(limits)
        await self._db.execute(
            "set provisioner limits",
            LIMITS.set_limits(
                provisioner_ids=ids,
                max_lifetimes=[limits[i].max_lifetime for i in ids],
                pending_timeouts=[limits[i].pending_timeout for i in ids],
                idle_timeouts=[limits[i].idle_timeout for i in ids],
                provisioning_timeouts=[limits[i].provisioning_timeout for i in ids],
            ),
        )

    async def sweep_deadlines(
        self, *, warning: float, pending_timeout: float | None, batch: int = 500
    ) -> Deadlines:
        """End what has expired, fail what waited past its pending timeout, warn of what
        expires within ``warning`` seconds: in one statement, each row moved once whichever
        replica runs it (:class:`Deadlines` says how many, and when the next one is)."""
        row = await self._db.fetchrow(
            "sweep deadlines",
            SWEEPS.sweep_deadlines(
                warning=float(warning),
                pending_timeout=float(pending_timeout or 0.0),
                batch=int(batch),
                instance_id=self.instance_id,
            ),
        )
        assert row is not None
        return Deadlines(
            expired=row["expired"],
            idle=row["idle"],
            provisioning_timeout=row["provisioning_timeout"],
            unserved=row["unserved"],
            warned=row["warned"],
            next_in=row["next_in"],
            active=row["active"],
        )

    async def release(
        self,
        allocation_id: str,
        *,
        reason: str = "release requested",
        conn: asyncpg.Connection | None = None,
    ) -> Allocation:
        """Give an allocation up; idempotent. Returns the row as it now stands."""
        validate_allocation_id(allocation_id)
        row = await self._db.fetchrow(
            "release allocation",
            SQL.release_allocation(
                allocation_id=allocation_id,
                instance_id=self.instance_id,
                reason=bounded_message(reason),
            ),
            conn=conn,
        )
        assert row is not None
        return Allocation.from_row(row)

    async def forget(self, allocation_id: str, *, reason: str) -> Allocation | None:
        """End an active allocation without destroying its sidecar (an operator's word that it
        is gone for good), fencing off any claim on it. Returns the row as forgotten, or
        ``None`` when nothing was: the id is unknown or the allocation had ended."""
        validate_allocation_id(allocation_id)
        row = await self._db.fetchrow(
            "forget allocation",
            SQL.forget_allocation(
                allocation_id=allocation_id,
                instance_id=self.instance_id,
                reason=bounded_message(reason),
            ),
        )
        return None if row is None else Allocation.from_row(row)

    # -- reads -------------------------------------------------------------------------------

    async def get(
        self, allocation_id: str, *, conn: asyncpg.Connection | None = None
    ) -> Allocation:
        validate_allocation_id(allocation_id)
        row = await self._db.fetchrow(
            "get allocation", SQL.get_allocation(allocation_id=allocation_id), conn=conn
        )
        if row is None:
            raise AllocationNotFound(f"no allocation {allocation_id}")
        return Allocation.from_row(row)

    async def list_active(self) -> list[Allocation]:
        return await self._fetch_all("list active allocations", SQL.list_active())

    async def list_allocations(
        self, *, status: Status | None = None, limit: int = 1000
    ) -> list[Allocation]:
        return await self._fetch_all(
            "list allocations",
            SQL.list_allocations(status=str(status) if status else None, limit=limit),
        )

    # -- connection events and repair (not claim-owned) ------------------------------------------

    async def wake(self, allocation_id: str, generation: int) -> bool:
        """Make the allocation due now and notify the daemons; ``False`` if nothing changed."""
        woken: bool = await self._db.fetchval(
            "wake", SQL.wake(allocation_id=allocation_id, generation=generation)
        )
        return woken

    async def report_exits(self, exits: Sequence[SidecarDeath]) -> list[Target]:
        """Record that these sidecars died (their provisioner said so): each current one reads
        not connected from now on, with its deadline passed, due at once, and its death in
        the ledger. Returns the generations written; a report of a sidecar no longer current
        (hubd destroyed it, or already heard) writes nothing."""
        if not exits:
            return []
        rows = await self._db.fetch(
            "report sidecar exits",
            SWEEPS.report_exits(
                allocation_ids=[e.allocation_id for e in exits],
                generations=[e.generation for e in exits],
                sidecar_ids=[e.sidecar_id for e in exits],
                messages=[e.message for e in exits],
                instance_id=self.instance_id,
            ),
        )
        return [Target(row["id"], row["generation"]) for row in rows]

    async def mark_unconnected(self, *, instance_ttl: float, connect_timeout: float) -> int:
        """Repair allocated rows that read ready, or are scheduled for nothing, although no
        live connection record exists; returns how many were repaired."""
        return len(
            await self._fetch_all(
                "mark unconnected",
                SWEEPS.mark_unconnected(
                    instance_ttl=float(instance_ttl),
                    connect_timeout=float(connect_timeout),
                    instance_id=self.instance_id,
                ),
            )
        )

    async def open_reconnect_windows(self, *, instance_ttl: float, window: float) -> int:
        """At a start with no live peer: every allocated row whose sidecar is not connected gets
        ``window`` seconds from now to reconnect; returns how many deadlines moved."""
        rows = await self._db.fetch(
            "open reconnect windows",
            SWEEPS.open_reconnect_windows(
                instance_ttl=float(instance_ttl), window=float(window), instance_id=self.instance_id
            ),
        )
        return len(rows)

    async def _fetch_all(self, what: str, query: Bound) -> list[Allocation]:
        return [Allocation.from_row(row) for row in await self._db.fetch(what, query)]

    # -- claims and leases ----------------------------------------------------------------

    async def claim_due(
        self,
        *,
        lease_ids: Sequence[str],
        lease_duration: float,
        exclude: Iterable[str] = (),
        binds: InitialBinds | None = None,
        room: int | None = None,
        rooms: Mapping[str, int] | None = None,
    ) -> list[Claimed]:
        """Lease up to ``len(lease_ids)`` due active allocations whose ids are not in
        ``exclude``, oldest first, in one statement; each with the lease id it was given. With
        ``binds``, the pending rows among them whose provisioner it names are bound in the same
        statement (``Claimed.ensure_intent`` says which). No tenant ('' for none) gets more
        rows than its room: ``rooms[tenant]``, else ``room`` (``None``: no bound)."""
        if not lease_ids:
            return []
        if binds is not None and not (
            len(binds.sidecar_ids) == len(binds.token_hashes) == len(lease_ids)
        ):
            raise ValueError("claim: one identity and token hash per lease id")
        rows = await self._db.fetch(
            "claim",
            CLAIMS.claim_due(
                lease_ids=list(lease_ids),
                effect_ids=[new_effect_id() for _ in lease_ids],
                sidecar_ids=[] if binds is None else list(binds.sidecar_ids),
                token_hashes=[] if binds is None else list(binds.token_hashes),
                bindings=json.dumps(
                    {}
                    if binds is None
                    else {
                        k: [*v, binds.ready_when.get(k, "connected")]
                        for k, v in binds.provisioners.items()
                    }
                ),
                connect_timeout=0.0 if binds is None else float(binds.connect_timeout),
                instance_id=self.instance_id,
                lease_duration=float(lease_duration),
                exclude=sorted(set(exclude)),
                room=room,
                listed=list(rooms or {}),
                rooms=list((rooms or {}).values()),
            ),
        )
        return [
            Claimed(
                allocation=Allocation.from_row(row),
                lease_id=row["lease_id"],
                open_effects=row["open_effects"],
                destroy_intent=row["destroy_effect_id"],
                ensure_intent=row["ensure_effect_id"],
            )
            for row in rows
        ]

    async def renew_leases(
        self, leases: Iterable[tuple[str, str]], lease_duration: float
    ) -> frozenset[str]:
        """Extend every (allocation, lease) pair still held and live, in one statement; the
        allocations renewed. Runs on the lease pool, so renewals never queue behind slow work.
        """
        pairs = sorted(set(leases))
        if not pairs:
            return frozenset()
        rows = await self._db.fetch(
            "renew leases",
            CLAIMS.renew_leases(
                allocation_ids=[aid for aid, _ in pairs],
                lease_ids=[lease for _, lease in pairs],
                lease_duration=float(lease_duration),
            ),
            pool=Pool.LEASE,
        )
        return frozenset(row["id"] for row in rows)

    async def renew_lease(self, allocation_id: str, lease_id: str, lease_duration: float) -> bool:
        """Extend one live lease; ``False`` when it is no longer ours or already expired."""
        renewed = await self.renew_leases([(allocation_id, lease_id)], lease_duration)
        return allocation_id in renewed

    async def drop_lease(self, allocation_id: str, lease_id: str) -> bool:
        """Give a lease back unchanged otherwise; ``False`` when it was no longer ours."""
        row = await self._db.fetchrow(
            "drop lease",
            CLAIMS.drop_lease(
                allocation_id=allocation_id, lease_id=lease_id, instance_id=self.instance_id
            ),
        )
        return row is not None

    async def give_back_lease(self, allocation_id: str, lease_id: str) -> bool:
        """End ``lease_id`` early, leaving the row (its open intents too) as an expired lease
        would; ``False`` when it was no longer ours."""
        row = await self._db.fetchrow(
            "give back lease",
            CLAIMS.give_back_lease(allocation_id=allocation_id, lease_id=lease_id),
        )
        return row is not None

    # -- orphan collection -----------------------------------------------------------------

    async def sidecar_owners(
        self, sidecars: Sequence[tuple[str, str | None]]
    ) -> dict[str, tuple[bool, bool]]:
        """For each (sidecar id, allocation id it names): (current sidecar of an active
        allocation, allocation known here)."""
        rows = await self._db.fetch(
            "look up sidecar owners",
            SWEEPS.sidecar_owners(
                sidecar_ids=[sidecar for sidecar, _ in sidecars],
                allocation_ids=[allocation or "" for _, allocation in sidecars],
            ),
        )
        return {row["sidecar_id"]: (row["current"], row["known"]) for row in rows}

    @contextlib.asynccontextmanager
    async def sweep_lock(self, name: str) -> AsyncIterator[asyncpg.Connection | None]:
        """Hold the cluster-wide sweep lock ``name`` for the block: yields the connection that
        holds it (closed means lost), or ``None`` when another replica holds it. The lock is
        ``name``'s row in ``hubd_sweep_locks``, locked by a transaction that lasts the block."""
        what = "orphan sweep lock"
        async with self._db.connection(what) as conn:
            await self._db.execute(what, SWEEPS.add_sweep_lock(lock_name=name), conn=conn)
            transaction = conn.transaction()
            await transaction.start()
            try:
                held = await self._db.fetchval(
                    what, SWEEPS.try_sweep_lock(lock_name=name), conn=conn
                )
                if held is None:
                    await transaction.rollback()
                    yield None
                    return
                yield conn
            finally:
                if not conn.is_closed() and conn.is_in_transaction():
                    try:
                        await transaction.rollback()
                    except BaseException:
                        # Pooled connections are not reset on release: one that may still hold
                        # the lock must not go back to the pool. Closing it releases the lock.
                        conn.terminate()
                        raise
