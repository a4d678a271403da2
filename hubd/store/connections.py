"""ConnectionStore: identities checked at a handshake, and durable connection records.

A connection record says "generation G of allocation A has a sidecar connected to instance I".
It is written on connect, cleared on disconnect only while still current, and read by any
replica: readiness never depends on which process holds the socket. Records of an instance whose
heartbeat expired (or whose row is gone) count as disconnected.
"""

from __future__ import annotations

import enum
import secrets as random_source
from collections.abc import Collection, Mapping
from typing import Any, Final

import attrs

from hubd.routing import Target
from hubd.store import secrets
from hubd.store.database import Database, Pool
from hubd.store.models import Status
from hubd.store.queries import Bound, Statement, load_queries
from hubd.store.secrets import Acknowledgement, Rotation, SecretState

__all__ = [
    "CONNECTED_CHANNEL",
    "READY_WHEN",
    "READY_WHEN_CONNECTED",
    "READY_WHEN_DECLARED",
    "SOCKETS_CHANNEL",
    "Admission",
    "Admitted",
    "ConnectedNotice",
    "ConnectionStore",
    "Declaration",
    "Disconnect",
    "PublishOutcome",
    "Readiness",
    "Record",
    "RecordOutcome",
    "RecordRequest",
    "Served",
    "SidecarIdentity",
    "SocketCheck",
    "SocketControl",
    "StaleConnection",
    "connected_payload",
    "parse_connected_payload",
    "parse_sockets_payload",
]

SQL = load_queries("connections.sql")

CONNECTED_CHANNEL: Final = "hubd_connected"
"""The NOTIFY channel a connection record announces itself on; payload
``<allocation>:<generation>:<seq>:<connection>``."""

READY_WHEN_CONNECTED: Final = "connected"
READY_WHEN_DECLARED: Final = "declared"
READY_WHEN: Final = (READY_WHEN_CONNECTED, READY_WHEN_DECLARED)
"""How an allocation becomes ready (``ready_when``): once its sidecar connected, or once the
connected sidecar declared it (a ``ready`` message)."""

SOCKETS_CHANNEL: Final = "hubd_sockets"
"""The NOTIFY channel on which every move to a newer generation or to a terminal status is
announced (a trigger on ``hubd_allocations``); payload ``<allocation>:<gen>:fence|retire``."""


@attrs.frozen(kw_only=True)
class SidecarIdentity:
    """What a handshake is checked against. The token hash is kept out of ``repr``."""

    allocation_id: str
    status: Status
    generation: int
    sidecar_id: str | None
    token_hash: bytes | None = attrs.field(repr=False)
    secret: SecretState = attrs.field(factory=SecretState, repr=False)
    """The current identity's reconnect secret (none until its first v2 connection)."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SidecarIdentity:
        token_hash = row["token_hash"]
        return cls(
            allocation_id=row["id"],
            status=Status(row["status"]),
            generation=row["generation"],
            sidecar_id=row["sidecar_id"],
            token_hash=bytes(token_hash) if token_hash is not None else None,
            secret=SecretState.from_row(row),
        )


@attrs.frozen
class Readiness:
    """Whether a generation's sidecar holds a live record, and the connection number that
    answer belongs to: a claim fences what it does with the answer on that number."""

    connected: bool
    connection_seq: int
    deadline_in: float | None = None
    """Seconds from the look to the row's connect deadline as it then stood (``None``: the
    row had none, as a connected one has not)."""


@attrs.frozen
class ConnectedNotice:
    """A ``hubd_connected`` notification: connection ``connection_id``'s record of ``target``
    was written with number ``seq``."""

    target: Target
    seq: int
    connection_id: str


@attrs.frozen
class SocketControl:
    """A ``hubd_sockets`` notification: sockets of older generations must go (``fence``), or
    every socket of the allocation (``retire``)."""

    allocation_id: str
    generation: int
    retire: bool


@attrs.frozen(kw_only=True)
class SocketCheck:
    """What the database says about one socket an instance holds."""

    allocation_id: str
    connection_id: str
    status: Status | None
    generation: int | None
    recorded_connection_id: str | None
    recorded_seq: int | None


class RecordOutcome(enum.StrEnum):
    """What became of a request to record a connection."""

    RECORDED = "recorded"
    FENCED = "fenced"
    """A newer generation (or identity) owns the allocation: the socket is stale."""
    RETIRED = "retired"
    """The allocation is gone or terminal: no sidecar of it may stay connected."""
    SUPERSEDED = "superseded"
    """A handshake that presented the same credential recorded itself first: it holds the
    generation's new secret, and this one must go."""


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

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> StaleConnection:
        return cls(
            allocation_id=row["allocation_id"],
            generation=row["generation"],
            connection_id=row["connection_id"],
            instance_id=row["instance_id"],
        )


@attrs.frozen(kw_only=True)
class Served:
    """What a recorded connection's sidecar serves, as its welcome tells it (architecture §4):
    the allocation's spec, tenant and session, and how it becomes ready."""

    spec: Mapping[str, Any] = attrs.field(factory=dict, repr=False)
    tenant: str | None = None
    session: str | None = None
    ready_when: str = READY_WHEN_CONNECTED
    """``connected`` (ready once connected) or ``declared`` (once the sidecar says so)."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Served:
        return cls(
            spec=row["spec"] or {},
            tenant=row["tenant_id"],
            session=row["session_id"],
            ready_when=row["ready_when"] or READY_WHEN_CONNECTED,
        )


@attrs.frozen
class Record:
    """The outcome of writing a connection record, and its number when written."""

    outcome: RecordOutcome
    seq: int | None = None
    ready: bool = False
    """The allocation became ready in the same statement."""
    served: Served | None = None
    """What the sidecar serves, for a record written."""


class PublishOutcome(enum.StrEnum):
    """What became of a sidecar's publish."""

    PUBLISHED = "published"
    """Stored (or already so): the row shows it."""
    TOO_LARGE = "too_large"
    """Merged over what was stored, the metadata would pass 16 KiB: nothing was written."""
    REFUSED = "refused"
    """The connection no longer holds its allocation's current record (superseded, cleared,
    fenced or retired): nothing was written."""


@attrs.frozen(kw_only=True)
class Declaration:
    """What became of a sidecar's ``ready``."""

    accepted: bool
    """The connection held its allocation's current record (``False``: nothing written)."""
    seq: int | None = None
    """The record's new number, when the declaration was written (``None``: nothing was to
    write: the allocation is ready once connected, or the record had declared already)."""
    ready: bool = False
    """The allocation became ready in the same statement."""


# Batcher keys, hashed at each step of their way through a batch: each hash is kept.
@attrs.frozen(cache_hash=True)
class RecordRequest:
    """A connection to record: socket ``connection_id`` of ``target``'s sidecar ``sidecar_id``,
    with the secret rotation of its handshake (``None``: none)."""

    connection_id: str
    target: Target
    sidecar_id: str
    rotation: Rotation | None = None


@attrs.frozen(cache_hash=True)
class Admission:
    """A handshake to authenticate and record in one statement (the listener's admission):
    socket ``connection_id`` of ``target``'s sidecar ``sidecar_id``, speaking protocol
    ``version``, with the digests of the token and of the secret it presented (``None``: the
    token alone) and of the secret its welcome will carry (``None``: a v1 sidecar, told none).
    Digests only: the raw credentials never leave the listener."""

    connection_id: str
    target: Target
    sidecar_id: str
    version: int
    token_hash: bytes = attrs.field(repr=False)
    presented_hash: bytes | None = attrs.field(repr=False)
    secret_hash: bytes | None = attrs.field(repr=False)


@attrs.frozen
class Admitted:
    """What became of an :class:`Admission`: the allocation's identity as the statement read
    it (``None``: no such allocation), from which the listener decides its answer, and the
    record (``None``: the credentials did not open that identity, and nothing was written)."""

    identity: SidecarIdentity | None
    record: Record | None


@attrs.frozen(cache_hash=True)
class Disconnect:
    """A closed socket whose record is to be cleared: connection ``connection_id`` of
    allocation ``allocation_id``."""

    allocation_id: str
    connection_id: str


def connected_payload(target: Target, seq: int, connection_id: str) -> str:
    return f"{target.allocation_id}:{target.generation}:{seq}:{connection_id}"


def parse_connected_payload(payload: str) -> ConnectedNotice | None:
    """What a ``hubd_connected`` notification says, or ``None`` if it is malformed."""
    parts = payload.split(":")
    if (
        len(parts) != 4
        or not parts[0]
        or not parts[1].isdigit()
        or not parts[2].isdigit()
        or not parts[3]
    ):
        return None
    generation, seq = int(parts[1]), int(parts[2])
    if generation < 1:
        return None
    return ConnectedNotice(Target(parts[0], generation), seq, parts[3])


def parse_sockets_payload(payload: str) -> SocketControl | None:
    """What a ``hubd_sockets`` notification says, or ``None`` if it is malformed."""
    parts = payload.split(":")
    if (
        len(parts) != 3
        or not parts[0]
        or not parts[1].isdigit()
        or parts[2]
        not in (
            "fence",
            "retire",
        )
    ):
        return None
    generation = int(parts[1])
    if generation < 1:
        return None
    return SocketControl(parts[0], generation, retire=parts[2] == "retire")


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
