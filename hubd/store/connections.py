"""ConnectionStore: identities checked at a handshake, and durable connection records.

A connection record says "generation G of allocation A has a sidecar connected to instance I".
It is written on connect, cleared on disconnect only while still current, and read by any
replica: readiness never depends on which process holds the socket. Records of an instance whose
heartbeat expired (or whose row is gone) count as disconnected.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Final

import attrs

from hubd.routing import Target
from hubd.store.database import Database
from hubd.store.models import Status
from hubd.store.queries import load_queries

__all__ = [
    "CONNECTED_CHANNEL",
    "ConnectionStore",
    "RecordOutcome",
    "SidecarIdentity",
    "StaleConnection",
    "connected_payload",
    "parse_connected_payload",
]

SQL = load_queries("connections.sql")

CONNECTED_CHANNEL: Final = "hubd_connected"
"""The NOTIFY channel a connection record announces itself on; payload ``<allocation>:<gen>``."""


@attrs.frozen(kw_only=True)
class SidecarIdentity:
    """What a handshake is checked against. The token hash is kept out of ``repr``."""

    allocation_id: str
    status: Status
    generation: int
    sidecar_id: str | None
    token_hash: bytes | None = attrs.field(repr=False)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SidecarIdentity:
        token_hash = row["token_hash"]
        return cls(
            allocation_id=row["id"],
            status=Status(row["status"]),
            generation=row["generation"],
            sidecar_id=row["sidecar_id"],
            token_hash=bytes(token_hash) if token_hash is not None else None,
        )


class RecordOutcome(enum.StrEnum):
    """What became of a request to record a connection."""

    RECORDED = "recorded"
    FENCED = "fenced"
    """A newer generation (or identity) owns the allocation: the socket is stale."""
    RETIRED = "retired"
    """The allocation is gone or terminal: no sidecar of it may stay connected."""


@attrs.frozen(kw_only=True)
class StaleConnection:
    """A record held by an instance that stopped or whose heartbeat expired."""

    allocation_id: str
    generation: int
    connection_id: str
    instance_id: str

    @property
    def target(self) -> Target:
        return Target(self.allocation_id, self.generation)


def connected_payload(target: Target) -> str:
    return f"{target.allocation_id}:{target.generation}"


def parse_connected_payload(payload: str) -> Target | None:
    """The target a ``hubd_connected`` notification names, or ``None`` if it is malformed."""
    allocation_id, sep, generation = payload.rpartition(":")
    if not sep or not allocation_id or not generation.isdigit():
        return None
    number = int(generation)
    return Target(allocation_id, number) if number >= 1 else None


class ConnectionStore:
    """The statements on ``hubd_sidecar_connections``, for one hub instance."""

    def __init__(self, db: Database, *, instance_id: str) -> None:
        self._db = db
        self.instance_id = instance_id

    async def identity(self, allocation_id: str) -> SidecarIdentity | None:
        """The allocation's current identity, or ``None`` when no such allocation exists.

        Raises :class:`~hubd.errors.DatabaseUnavailable` (or another ``StoreError``) when that
        cannot be known; callers must not read a failure as absence.
        """
        async with self._db.connection("look up sidecar identity") as conn:
            row = await conn.fetchrow(SQL.identity, allocation_id)
        return SidecarIdentity.from_row(row) if row is not None else None

    async def record(self, connection_id: str, target: Target, sidecar_id: str) -> RecordOutcome:
        """Make ``connection_id`` the allocation's current connection, if it still may be."""
        async with self._db.connection("record connection") as conn:
            row = await conn.fetchrow(
                SQL.record,
                connection_id,
                target.allocation_id,
                target.generation,
                sidecar_id,
                self.instance_id,
            )
        if row is None:
            return RecordOutcome.RETIRED
        if row["recorded"]:
            return RecordOutcome.RECORDED
        status = Status(row["status"])
        if status.terminal:
            return RecordOutcome.RETIRED
        return RecordOutcome.FENCED

    async def clear(self, allocation_id: str, connection_id: str) -> bool:
        """Forget the record if ``connection_id`` is still current; ``False`` if it was not."""
        async with self._db.connection("clear connection") as conn:
            cleared = await conn.fetchval(SQL.clear, allocation_id, connection_id)
        return cleared is not None

    async def clear_instance(self, instance_id: str) -> list[Target]:
        """Forget every record held by ``instance_id``; returns the targets that were recorded."""
        async with self._db.connection("clear instance connections") as conn:
            rows = await conn.fetch(SQL.clear_instance, instance_id)
        return [Target(row["allocation_id"], row["generation"]) for row in rows]

    async def is_connected(self, target: Target, ttl: float) -> bool:
        """Whether ``target`` has a record on an instance whose heartbeat is within ``ttl``."""
        async with self._db.connection("check connection") as conn:
            connected: bool = await conn.fetchval(
                SQL.is_connected, target.allocation_id, target.generation, float(ttl)
            )
        return connected

    async def stale(self, ttl: float) -> list[StaleConnection]:
        """Records whose instance is gone or has not sent a heartbeat within ``ttl`` seconds."""
        async with self._db.connection("list stale connections") as conn:
            rows = await conn.fetch(SQL.stale, float(ttl))
        return [
            StaleConnection(
                allocation_id=row["allocation_id"],
                generation=row["generation"],
                connection_id=row["connection_id"],
                instance_id=row["instance_id"],
            )
            for row in rows
        ]
