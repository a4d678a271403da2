"""InstanceStore: one row per running daemon, kept alive by a heartbeat on the database clock.

A replica whose heartbeat is older than the configured TTL is dead to its peers: its connection
records count as disconnected. A daemon that stops cleanly removes its row at once.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from hubd.store.database import Database, Pool
from hubd.store.queries import load_queries

__all__ = ["Instance", "InstanceStore"]

SQL = load_queries("instances.sql")


@attrs.frozen(kw_only=True)
class Instance:
    """One row of ``hubd_instances``, with whether its heartbeat is within the TTL asked for."""

    id: str
    hostname: str
    pid: int
    ws_url: str | None
    provisioners: tuple[str, ...] | None
    """The provisioner ids it serves; ``None`` when it does not say."""
    started_at: datetime
    heartbeat_at: datetime
    alive: bool

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Instance:
        values = {field.name: row[field.name] for field in attrs.fields(cls)}
        if values["provisioners"] is not None:
            values["provisioners"] = tuple(values["provisioners"])
        return cls(**values)


class InstanceStore:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def register(
        self,
        instance_id: str,
        hostname: str,
        pid: int,
        ws_url: str | None,
        provisioners: Sequence[str] | None = None,
    ) -> None:
        ids = None if provisioners is None else sorted(provisioners)
        await self._db.execute(
            "register instance",
            SQL.register(
                instance_id=instance_id, hostname=hostname, pid=pid, ws_url=ws_url, provisioners=ids
            ),
        )

    async def heartbeat(self, instance_id: str) -> bool:
        """Refresh the heartbeat; ``False`` when the row is gone (removed, or swept as dead).

        Runs on the lease pool, so a pool saturated by slow work cannot starve it.
        """
        beat = await self._db.fetchval(
            "instance heartbeat", SQL.heartbeat(instance_id=instance_id), pool=Pool.LEASE
        )
        return beat is not None

    async def delete_dead(self, older_than: float) -> builtins.list[str]:
        """Forget instances whose heartbeat is older than ``older_than`` seconds."""
        rows = await self._db.fetch(
            "delete dead instances", SQL.delete_dead(older_than=float(older_than))
        )
        return [row["id"] for row in rows]

    async def remove(self, instance_id: str) -> None:
        await self._db.execute("remove instance", SQL.remove(instance_id=instance_id))

    # ``list`` shadows the builtin inside the class body; annotations say ``builtins.list``.
    async def list(self, ttl: float) -> builtins.list[Instance]:
        """Every instance, oldest first, each marked alive when its heartbeat is within ``ttl``."""
        rows = await self._db.fetch("list instances", SQL.list(ttl=float(ttl)))
        return [Instance.from_row(row) for row in rows]
