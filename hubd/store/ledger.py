"""LedgerStore: plugin-call effects and the history of an allocation.

A plugin call is bracketed by an ``intent`` row before it and a ``committed``, ``failed`` or
``ambiguous`` row after it, sharing one effect id. Both are fenced like every claim-owned write,
and both normally ride on the transitions around the call (architecture §6; ``:effects`` in
``transitions.sql``); :meth:`LedgerStore.record_effect` writes one phase on its own,
for a call no transition makes due. A claim that lost its lease leaves its intent open, and the
next owner settles it as ambiguous.
"""

from __future__ import annotations

from hubd.store.database import Database
from hubd.store.inputs import (
    bounded_code,
    bounded_message,
    new_effect_id,
    validate_allocation_id,
)
from hubd.store.queries import load_queries
from hubd.store.rows import Fence, LedgerEntry, Phase, Status

__all__ = ["LedgerStore", "new_effect_id"]

SQL = load_queries("ledger.sql")


class LedgerStore:
    def __init__(self, db: Database, *, instance_id: str) -> None:
        self._db = db
        self.instance_id = instance_id

    async def record_effect(
        self,
        fence: Fence,
        *,
        effect_id: str,
        kind: str,
        phase: Phase,
        status: Status,
        error_code: str | None = None,
        message: str | None = None,
        duration_ms: float | None = None,
    ) -> bool:
        """Append one phase of a plugin call; ``False`` when the fence no longer holds."""
        seq = await self._db.fetchval(
            "record effect",
            SQL.record_effect(
                **fence.parameters(self.instance_id),
                effect_id=effect_id,
                kind=kind,
                phase=str(phase),
                error_code=bounded_code(error_code) if error_code is not None else None,
                message=bounded_message(message) if message is not None else None,
                duration_ms=duration_ms,
                status=str(status),
            ),
        )
        return seq is not None

    async def settle_open_effects(self, fence: Fence) -> int:
        """Record earlier leases' calls that never got an outcome as ambiguous; returns how many."""
        rows = await self._db.fetch(
            "settle open effects", SQL.settle_open_effects(**fence.parameters(self.instance_id))
        )
        return len(rows)

    async def record_orphan(
        self,
        allocation_id: str,
        *,
        sidecar_id: str,
        generation: int | None,
        kind: str,
        phase: Phase,
        error_code: str | None = None,
        message: str | None = None,
    ) -> bool:
        """Append orphan collection's evidence; ``False`` when the allocation is unknown."""
        seq = await self._db.fetchval(
            "record orphan",
            SQL.record_orphan(
                allocation_id=allocation_id,
                sidecar_id=sidecar_id,
                generation=generation if generation is not None and generation >= 1 else None,
                instance_id=self.instance_id,
                kind=kind,
                phase=str(phase),
                error_code=bounded_code(error_code) if error_code is not None else None,
                message=bounded_message(message) if message is not None else None,
            ),
        )
        return seq is not None

    async def history(self, allocation_id: str) -> list[LedgerEntry]:
        validate_allocation_id(allocation_id)
        rows = await self._db.fetch("read history", SQL.history(allocation_id=allocation_id))
        return [LedgerEntry.from_row(row) for row in rows]
