"""What the statements on connection records take and answer.

A connection record says "generation G of allocation A has a sidecar connected to instance I"
(:class:`~hubd.store.connections.ConnectionStore` writes and reads them). These values carry a
handshake's identity and admission, the outcome of a record, publish or declaration, what a
claim reads of readiness, and the sockets and records a repair looks at.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Final

import attrs

from hubd.routing import Target
from hubd.store.rows import Status
from hubd.store.secrets import Rotation, SecretState

__all__ = [
    "READY_WHEN_CONNECTED",
    "Admission",
    "Admitted",
    "Announced",
    "Declaration",
    "Disconnect",
    "Handover",
    "PublishOutcome",
    "Readiness",
    "Record",
    "RecordOutcome",
    "RecordRequest",
    "Served",
    "SidecarIdentity",
    "SocketCheck",
    "StaleConnection",
]

READY_WHEN_CONNECTED: Final = "connected"
"""How an allocation becomes ready (``ready_when``): once its sidecar connected, or once the
connected sidecar declared it (a ``ready`` message)."""


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
    exit_message: str | None = None
    """How the generation's sidecar died, when its provisioner reported it dead (then it is
    not connected and its deadline has passed)."""


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
    handover_pending: bool = False
    """A pool member taken since its sidecar last acknowledged: the welcome's tenant and
    session are new to it, and it owes a ``session_ack`` (architecture §4, *Hand-over*)."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Served:
        return cls(
            spec=row["spec"] or {},
            tenant=row["tenant_id"],
            session=row["session_id"],
            ready_when=row["ready_when"] or READY_WHEN_CONNECTED,
            handover_pending=bool(row.get("handover_pending")),
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
    """What became of a sidecar's ``ready`` or ``not_ready``."""

    accepted: bool
    """The connection held its allocation's current record (``False``: nothing written)."""
    seq: int | None = None
    """The record's new number, when the declaration was written (``None``: nothing was to
    write: the allocation is ready once connected, or the record had said so already)."""
    ready: bool = False
    """The allocation became ready in the same statement."""
    withdrawn: bool = False
    """The allocation stopped being ready in the same statement (a ``not_ready``)."""


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


@attrs.frozen(kw_only=True)
class Handover:
    """What a taken pool member's sidecar is owed (architecture §4, *Hand-over*): the session
    its allocation now serves, at its generation."""

    target: Target
    tenant: str | None
    session: str | None


@attrs.frozen
class Announced:
    """A take of a pool member whose events an announcement wrote (architecture §8), and
    whether its sidecar is still owed its session: the hand-over to send."""

    handover: Handover
    owed: bool
