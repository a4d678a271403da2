"""ConnectionStore: identities checked at a handshake, and durable connection records.

A connection record says "generation G of allocation A has a sidecar connected to instance I".
It is written on connect, cleared on disconnect only while still current, and read by any
replica: readiness never depends on which process holds the socket. Records of an instance whose
heartbeat expired (or whose row is gone) count as disconnected. What the statements take and
answer is in :mod:`hubd.store.connection_values`.
"""

from __future__ import annotations

import secrets as random_source
from collections.abc import Collection, Mapping
from typing import Any

from hubd.routing import Target
from hubd.store import secrets
from hubd.store.connection_values import (
    Admission,
    Admitted,
    Announced,
    Declaration,
    Disconnect,
    Handover,
    PublishOutcome,
    Readiness,
    Record,
    RecordOutcome,
    RecordRequest,
    Served,
    SidecarIdentity,
    SocketCheck,
    StaleConnection,
)
from hubd.store.database import Database, Pool
from hubd.store.queries import Bound, Statement, load_queries
from hubd.store.rows import Status
from hubd.store.secrets import Acknowledgement, Rotation

__all__ = ["ConnectionStore"]

SQL = load_queries("connections.sql")


class ConnectionStore:
    """The statements on ``hubd_sidecar_connections``, for one hub instance."""

    def __init__(self, db: Database, *, instance_id: str, ready_on_connect: bool = False) -> None:
        """``ready_on_connect``: a connect that finds its allocation parked waiting for it makes
        it ready in the same statement. Only right when no on-ready hook must run first."""
        self._db = db
        self.instance_id = instance_id
        self._ready_on_connect = ready_on_connect

    async def identity(self, allocation_id: str) -> SidecarIdentity | None:
        """The allocation's current identity, or ``None`` when no such allocation exists.

        Raises :class:`~hubd.errors.DatabaseUnavailable` (or another ``StoreError``) when that
        cannot be known; callers must not read a failure as absence.
        """
        return (await self.identities([allocation_id])).get(allocation_id)

    async def identities(self, allocation_ids: Collection[str]) -> dict[str, SidecarIdentity]:
        """The current identity of each allocation of ``allocation_ids`` that exists, in one
        statement; raises as :meth:`identity` does, for all of them."""
        # On the identity pool: handshakes are caused by whoever reaches the listener, and must
        # never queue ahead of claims and renewals.
        rows = await self._db.fetch(
            "look up sidecar identities",
            SQL.identities(allocation_ids=list(allocation_ids)),
            pool=Pool.IDENTITY,
        )
        found = (SidecarIdentity.from_row(row) for row in rows)
        return {identity.allocation_id: identity for identity in found}

    async def acknowledge_secrets(
        self, acknowledgements: Collection[Acknowledgement]
    ) -> dict[Acknowledgement, bool]:
        """The sidecars hold the secrets of their welcomes: the credentials that opened their
        connections are no longer accepted. ``True`` for each that took effect (absent: a newer
        rotation made it moot)."""
        done = await secrets.acknowledge(self._db, acknowledgements)
        return dict.fromkeys(done, True)

    async def record(
        self,
        connection_id: str,
        target: Target,
        sidecar_id: str,
        *,
        rotation: Rotation | None = None,
    ) -> Record:
        """Make ``connection_id`` the allocation's current connection, if it still may be; the
        allocation is woken and every replica told, in the same statement. With ``rotation``,
        the generation's reconnect secret is rotated first in that statement, guarded on the
        secret state the handshake saw: of two handshakes that presented the same credential
        exactly one records itself (the other is ``SUPERSEDED``)."""
        request = RecordRequest(connection_id, target, sidecar_id, rotation)
        return (await self.record_many([request]))[request]

    async def record_many(self, requests: Collection[RecordRequest]) -> dict[RecordRequest, Record]:
        """:meth:`record` for each of ``requests`` (at most one per allocation), in one
        statement; each outcome is what it would have been alone."""
        rotations = [request.rotation for request in requests]
        rows = await self._write(
            "record connections",
            [(r.connection_id, r.target, r.sidecar_id) for r in requests],
            rotates=[rotation is not None for rotation in rotations],
            seen_hashes=[None if r is None else r.seen_hash for r in rotations],
            secret_hashes=[None if r is None else r.secret_hash for r in rotations],
            presented_hashes=[None if r is None else r.presented_hash for r in rotations],
            authenticates=[False] * len(requests),
            versions=[2] * len(requests),
            token_hashes=[None] * len(requests),
            pool=Pool.SOCKETS,
        )
        return {request: _record_outcome(rows[request.connection_id]) for request in requests}

    async def admit_many(self, admissions: Collection[Admission]) -> dict[Admission, Admitted]:
        """Authenticate each handshake of ``admissions`` against its allocation's current
        identity and record the connection of each one admitted, rotating its generation's
        reconnect secret, in one statement. Several of one allocation may be given: of those
        admitted the last is recorded, and the others are ``SUPERSEDED``.

        The statement's check is the protocol's (:func:`hubd.server.handshake.authorize`); the
        listener still decides its answer from the identity returned, and a record written for
        a handshake it refuses is the listener's to clear."""
        # On the identity pool: an admission is caused by whoever reaches the listener, before
        # anything is known of its credentials, and must never queue ahead of claims, renewals
        # or the statements of open sockets (the socket pool's).
        rows = await self._write(
            "admit connections",
            [(a.connection_id, a.target, a.sidecar_id) for a in admissions],
            rotates=[True] * len(admissions),
            seen_hashes=[None] * len(admissions),
            secret_hashes=[a.secret_hash for a in admissions],
            presented_hashes=[a.presented_hash for a in admissions],
            authenticates=[True] * len(admissions),
            versions=[a.version for a in admissions],
            token_hashes=[a.token_hash for a in admissions],
            pool=Pool.IDENTITY,
        )
        answers: dict[Admission, Admitted] = {}
        for admission in admissions:
            row = rows[admission.connection_id]
            identity = None
            if row["status"] is not None:
                identity = SidecarIdentity.from_row(row)
            record = None
            if row["admitted"]:
                outvoted = row["outvoted"]
                record = Record(RecordOutcome.SUPERSEDED) if outvoted else _record_outcome(row)
            answers[admission] = Admitted(identity, record)
        return answers

    async def _write(
        self,
        what: str,
        sockets: list[tuple[str, Target, str]],
        *,
        pool: Pool,
        **columns: list[Any],
    ) -> dict[str, Mapping[str, Any]]:
        """Run the ``record`` statement over ``sockets`` (connection, target, sidecar) and the
        other per-socket ``columns``; its rows by connection id."""
        rows = await self._db.fetch(
            what,
            SQL.record(
                connection_ids=[connection_id for connection_id, _, _ in sockets],
                allocation_ids=[target.allocation_id for _, target, _ in sockets],
                generations=[target.generation for _, target, _ in sockets],
                sidecar_ids=[sidecar_id for _, _, sidecar_id in sockets],
                key=random_source.token_bytes(16),
                instance_id=self.instance_id,
                ready_on_connect=self._ready_on_connect,
                **columns,
            ),
            pool=pool,
        )
        return {row["connection_id"]: row for row in rows}

    async def publish(
        self,
        connection_id: str,
        target: Target,
        *,
        endpoint: str | None,
        metadata: str | None,
    ) -> PublishOutcome:
        """Store what connection ``connection_id``'s sidecar publishes, fenced on that
        connection holding ``target``'s current record: ``endpoint`` (``None``: unchanged) and
        ``metadata`` (a checked JSON object's text, merged over the stored one key by key, a key
        given null removed; ``None``: unchanged)."""
        row = await self._db.fetchrow(
            "publish",
            SQL.publish(
                allocation_id=target.allocation_id,
                generation=target.generation,
                connection_id=connection_id,
                endpoint=endpoint,
                metadata=metadata,
            ),
            pool=Pool.SOCKETS,
        )
        if row is None or not row["fenced_in"]:
            return PublishOutcome.REFUSED
        return PublishOutcome.TOO_LARGE if row["too_large"] else PublishOutcome.PUBLISHED

    async def declare_ready(self, connection_id: str, target: Target) -> Declaration:
        """Connection ``connection_id``'s sidecar says it is ready, fenced as :meth:`publish`
        is. Where ``target`` is ready once its sidecar says so, the record is marked declared
        and the allocation made ready in the same statement (when no on-ready hook must run
        and it is parked waiting for its sidecar) or woken for a claim to decide."""
        row = await self._db.fetchrow(
            "declare ready",
            SQL.declare_ready(
                allocation_id=target.allocation_id,
                generation=target.generation,
                connection_id=connection_id,
                instance_id=self.instance_id,
                ready_on_connect=self._ready_on_connect,
            ),
            pool=Pool.SOCKETS,
        )
        if row is None or not row["fenced_in"]:
            return Declaration(accepted=False)
        return Declaration(accepted=True, seq=row["seq"], ready=row["ready"])

    async def takes_in_flight(self) -> bool:
        """Whether a take is uncommitted: one that rang no bell may commit yet (architecture
        §8)."""
        in_flight: bool = await self._db.fetchval(
            "look for takes in flight", SQL.takes_in_flight(), pool=Pool.SOCKETS
        )
        return in_flight

    async def announce_takes(self, *, stale_after: float | None = None) -> list[Announced]:
        """Announce the takes whose sidecars are connected here, and with ``stale_after``
        every take older than that many seconds wherever its sidecar is: their events are
        written at this statement's commit. Each announced, with the hand-over it is owed."""
        rows = await self._db.fetch(
            "announce takes",
            SQL.announce_takes(instance_id=self.instance_id, stale_after=stale_after),
            pool=Pool.SOCKETS,
        )
        return [Announced(_handover(row), owed=row["owed"]) for row in rows]

    async def owed_handovers(self) -> list[Handover]:
        """Every hand-over still owed (a taken member's sidecar has not acknowledged)."""
        rows = await self._db.fetch("read hand-overs", SQL.owed_handovers(), pool=Pool.SOCKETS)
        return [_handover(row) for row in rows]

    async def acknowledge_handovers(
        self, acknowledged: list[tuple[str, Target]]
    ) -> Mapping[tuple[str, Target], bool]:
        """Connections ``(connection_id, target)`` say their sidecars hold their sessions,
        each fenced as :meth:`publish` is. Maps each whose fence held to whether a hand-over
        was owed (and is now done); one the fence refused is absent."""
        rows = await self._db.fetch(
            "acknowledge hand-overs",
            SQL.acknowledge_handovers(
                connection_ids=[c for c, _ in acknowledged],
                allocation_ids=[t.allocation_id for _, t in acknowledged],
                generations=[t.generation for _, t in acknowledged],
                instance_id=self.instance_id,
            ),
            pool=Pool.SOCKETS,
        )
        by_connection = {key[0]: key for key in acknowledged}
        return {by_connection[row["connection_id"]]: row["handed_over"] for row in rows}

    async def declare_not_ready(
        self, connection_id: str, target: Target, *, connect_timeout: float
    ) -> Declaration:
        """Connection ``connection_id``'s sidecar says it can no longer serve, fenced as
        :meth:`declare_ready` is. Where ``target`` is ready once its sidecar says so and the
        record had said so, the record is marked not declared and the allocation reads not
        ready; one that was ready must declare again within ``connect_timeout`` seconds."""
        row = await self._db.fetchrow(
            "declare not ready",
            SQL.declare_not_ready(
                allocation_id=target.allocation_id,
                generation=target.generation,
                connection_id=connection_id,
                instance_id=self.instance_id,
                connect_timeout=float(connect_timeout),
            ),
            pool=Pool.SOCKETS,
        )
        if row is None or not row["fenced_in"]:
            return Declaration(accepted=False)
        return Declaration(accepted=True, seq=row["seq"], withdrawn=row["withdrawn"])

    async def record_activity(self, targets: list[Target]) -> Mapping[Target, bool]:
        """These generations' sidecars showed activity: each one allocated with an idle clock
        running goes idle its ``idle_timeout`` from now (written at most about once a second
        per allocation). Maps each target whose clock runs to ``True``; the others (another
        generation, not allocated, no idle timeout) are absent."""
        rows = await self._db.fetch(
            "record activity",
            SQL.record_activity(
                allocation_ids=[t.allocation_id for t in targets],
                generations=[t.generation for t in targets],
            ),
            pool=Pool.SOCKETS,
        )
        return {Target(row["id"], row["generation"]): True for row in rows}

    async def reassert(self, connection_id: str, target: Target, sidecar_id: str) -> int | None:
        """Write a swept record of a socket that is still open again; its number, or ``None``
        when the allocation moved on or another connection took over meanwhile."""
        row = await self._db.fetchrow(
            "reassert connection",
            self._claim(SQL.reassert, connection_id, target, sidecar_id),
            pool=Pool.SOCKETS,
        )
        return None if row is None else int(row["seq"])

    async def disconnect(
        self, allocation_id: str, connection_id: str, *, connect_timeout: float
    ) -> bool:
        """Connection ``connection_id`` closed: clear its record and mark the sidecar lost, both
        only if it is still the current record. ``True`` when it was."""
        closed = Disconnect(allocation_id, connection_id)
        return (await self.disconnect_many([closed], connect_timeout=connect_timeout))[closed]

    async def disconnect_many(
        self, closed: Collection[Disconnect], *, connect_timeout: float
    ) -> dict[Disconnect, bool]:
        """:meth:`disconnect` for each of ``closed`` (at most one per allocation), in one
        statement; each answer is what it would have been alone."""
        rows = await self._db.fetch(
            "record disconnects",
            SQL.disconnect_many(
                allocation_ids=[each.allocation_id for each in closed],
                connection_ids=[each.connection_id for each in closed],
                instance_id=self.instance_id,
                connect_timeout=float(connect_timeout),
            ),
            pool=Pool.SOCKETS,
        )
        cleared = {row["connection_id"] for row in rows}
        return {each: each.connection_id in cleared for each in closed}

    async def sweep_stale(self, ttl: float, *, connect_timeout: float) -> list[StaleConnection]:
        """Clear the records of instances dead for ``ttl`` seconds (never this instance's) and
        mark their sidecars lost; returns what was swept."""
        rows = await self._db.fetch(
            "sweep stale connections",
            SQL.sweep_stale(
                ttl=float(ttl),
                instance_id=self.instance_id,
                connect_timeout=float(connect_timeout),
            ),
        )
        return [StaleConnection.from_row(row) for row in rows]

    async def release_instance(self, *, connect_timeout: float) -> list[Target]:
        """A clean stop: clear this instance's records and mark their sidecars lost at once."""
        rows = await self._db.fetch(
            "release instance connections",
            SQL.release_instance(
                instance_id=self.instance_id, connect_timeout=float(connect_timeout)
            ),
        )
        return [Target(row["allocation_id"], row["generation"]) for row in rows]

    async def readiness(self, target: Target, ttl: float) -> Readiness:
        """Whether ``target`` has a record on an instance whose heartbeat is within ``ttl`` (or
        on this instance, which holds its own sockets), and the allocation's connection number
        read with that answer."""
        row = await self._db.fetchrow(
            "check connection",
            SQL.readiness(
                allocation_id=target.allocation_id,
                generation=target.generation,
                ttl=float(ttl),
                instance_id=self.instance_id,
            ),
        )
        if row is None:
            return Readiness(connected=False, connection_seq=-1)
        return Readiness(
            connected=bool(row["connected"]),
            connection_seq=row["connection_seq"],
            deadline_in=row["deadline_in"],
            exit_message=row["exit_message"],
        )

    async def is_connected(self, target: Target, ttl: float) -> bool:
        return (await self.readiness(target, ttl)).connected

    async def check_sockets(self, sockets: list[tuple[str, str]]) -> list[SocketCheck]:
        """What the database says of each (allocation, connection) this instance holds."""
        rows = await self._db.fetch(
            "check sockets",
            SQL.check_sockets(
                allocation_ids=[a for a, _ in sockets], connection_ids=[c for _, c in sockets]
            ),
            pool=Pool.SOCKETS,
        )
        return [
            SocketCheck(
                allocation_id=row["allocation_id"],
                connection_id=row["connection_id"],
                status=Status(row["status"]) if row["status"] is not None else None,
                generation=row["generation"],
                recorded_connection_id=row["recorded_connection_id"],
                recorded_seq=row["recorded_seq"],
            )
            for row in rows
        ]

    async def stale(self, ttl: float) -> list[StaleConnection]:
        """Records whose instance is gone or has not sent a heartbeat within ``ttl`` seconds."""
        rows = await self._db.fetch("list stale connections", SQL.stale(ttl=float(ttl)))
        return [StaleConnection.from_row(row) for row in rows]

    def _claim(
        self, statement: Statement, connection_id: str, target: Target, sidecar_id: str
    ) -> Bound:
        """``record`` and ``reassert`` take the same arguments: this instance claims the
        socket ``connection_id`` for ``target``'s sidecar."""
        return statement(
            connection_id=connection_id,
            allocation_id=target.allocation_id,
            generation=target.generation,
            sidecar_id=sidecar_id,
            instance_id=self.instance_id,
        )


def _record_outcome(row: Mapping[str, Any]) -> Record:
    if row["status"] is None:
        return Record(RecordOutcome.RETIRED)
    if row["rotation_lost"]:
        return Record(RecordOutcome.SUPERSEDED)
    if row["seq"] is not None:
        return Record(
            RecordOutcome.RECORDED, row["seq"], ready=row["ready"], served=Served.from_row(row)
        )
    if Status(row["status"]).terminal:
        return Record(RecordOutcome.RETIRED)
    return Record(RecordOutcome.FENCED)


def _handover(row: Mapping[str, Any]) -> Handover:
    target = Target(row["id"], row["generation"])
    return Handover(target=target, tenant=row["tenant_id"], session=row["session_id"])
