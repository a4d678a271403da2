"""Claims and leases: the statements that lease due allocations and keep, drop or give back
their leases. Part of :class:`~hubd.store.allocations.AllocationStore`.

A lease is held while its expiry, on the database clock, is ahead: no other claimer can take
the row, and every fenced write of the claim (:mod:`hubd.store.transitions`) checks it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from hubd.store.database import Database, Pool
from hubd.store.models import Allocation, Claimed, InitialBinds
from hubd.store.queries import load_queries
from hubd.store.values import new_effect_id

__all__ = ["ClaimQueries"]

SQL = load_queries("allocations_claims.sql")


class ClaimQueries:
    """The claims and leases of :class:`~hubd.store.allocations.AllocationStore`."""

    _db: Database
    instance_id: str

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
            SQL.claim_due(
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
            SQL.renew_leases(
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
            SQL.drop_lease(
                allocation_id=allocation_id, lease_id=lease_id, instance_id=self.instance_id
            ),
        )
        return row is not None

    async def give_back_lease(self, allocation_id: str, lease_id: str) -> bool:
        """End ``lease_id`` early, leaving the row (its open intents too) as an expired lease
        would; ``False`` when it was no longer ours."""
        row = await self._db.fetchrow(
            "give back lease",
            SQL.give_back_lease(allocation_id=allocation_id, lease_id=lease_id),
        )
        return row is not None
