"""What the store's statements answer and fence on: statuses, allocation rows, effect and ledger
rows, claim fences, and a provisioner's limits and deadlines. Driver-free, as is
:mod:`hubd.store.inputs` (what crosses into the store, checked and bounded)."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from hubd.store.inputs import bounded_code, bounded_message

__all__ = [
    "ACTIVE_STATUSES",
    "TERMINAL_STATUSES",
    "Allocation",
    "Deadlines",
    "EffectRow",
    "Fence",
    "InitialBinds",
    "LedgerEntry",
    "Phase",
    "ProvisionerLimits",
    "SidecarDeath",
    "Status",
    "effects_json",
]


class Status(enum.StrEnum):
    PENDING = "pending"
    PROVISIONING = "provisioning"
    ALLOCATED = "allocated"
    REPLACING = "replacing"
    RELEASING = "releasing"
    RELEASED = "released"
    FAILED = "failed"
    DESTROY_FAILED = "destroy_failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({Status.RELEASED, Status.FAILED, Status.DESTROY_FAILED})
ACTIVE_STATUSES = frozenset(Status) - TERMINAL_STATUSES


class Phase(enum.StrEnum):
    """Effect phase of a ledger row: a transition is ``committed`` when it is written."""

    INTENT = "intent"
    COMMITTED = "committed"
    FAILED = "failed"
    AMBIGUOUS = "ambiguous"


@attrs.frozen(kw_only=True)
class Allocation:
    """One row of ``hubd_allocations``. The token hash is kept out of ``repr``."""

    id: str
    status: Status
    generation: int
    provisioner_id: str
    provisioner_api_version: str | None
    provisioner_binding_fingerprint: str | None
    tenant_id: str | None
    session_id: str | None
    spec: Mapping[str, Any]
    sidecar_id: str | None
    token_hash: bytes | None = attrs.field(repr=False)
    external_ref: str | None
    connect_deadline: datetime | None
    connection_ready: bool
    connection_seq: int
    """Bumped whenever a connection is recorded or cleared; claims fence on it."""
    initialization_lease_id: str | None
    ensure_attempts: int
    destroy_attempts: int
    next_attempt_at: datetime | None
    lease_id: str | None
    lease_expires_at: datetime | None
    failure_code: str | None
    failure_message: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    idempotency_key: str | None = None
    ready_when: str | None = None
    """``connected`` or ``declared``; ``None`` until the claim resolves the provisioner's."""
    endpoint: str | None = None
    """Where the current generation's sidecar serves, as its provisioner or sidecar published."""
    metadata: Mapping[str, Any] | None = None
    exit_message: str | None = None
    """How the current generation's sidecar died, as its provisioner reported; ``None`` while
    none was reported."""
    exited_at: datetime | None = None
    replacements: int = 0
    """Sidecars abandoned since ``replacements_since`` (the streak the replacement limit
    counts)."""
    replacements_since: datetime | None = None
    give_up: bool = False
    """The release under way ends ``failed``: too many sidecars failed within the window."""
    expires_at: datetime | None = None
    """When it must end (its lifetime, or an extension); ``None``: never."""
    expiring: bool = False
    end_reason: str | None = None
    """Who or what ended it (``application``, ``operator``, ``expired``, ``idle``,
    ``unserved``, ``provisioning_timeout``); a failure's code is in ``failure_code``."""
    idle_timeout: float | None = None
    """Seconds without activity after which a ready allocation ends ``idle``; ``None``: never."""
    idle_at: datetime | None = None
    """When it goes idle unless its sidecar or application shows activity (set from its first
    readiness on)."""
    starting_since: datetime | None = None
    """When its provisioning clock started (claimed or replacing, not ready since)."""
    pool_id: str | None = None
    """The warm pool that made it (docs/pools.md); ``None``: made for its request."""
    taken_at: datetime | None = None
    """When a request took it from its pool; ``None`` with a pool: a member no one took."""
    handover_pending: bool = False
    """Taken, and its sidecar has not yet acknowledged its session (architecture §4)."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Allocation:
        # Statements that return chosen columns may leave the published ones out.
        values: dict[str, Any] = {
            field.name: row[field.name] if field.default is attrs.NOTHING else row.get(field.name)
            for field in attrs.fields(cls)
        }
        values["status"] = Status(values["status"])
        for name in ("spec", "metadata"):
            if isinstance(values[name], str):
                # A caller's own connection has no JSON codec installed.
                values[name] = json.loads(values[name])
        token_hash = values["token_hash"]
        values["token_hash"] = bytes(token_hash) if token_hash is not None else None
        return cls(**values)

    @property
    def active(self) -> bool:
        return not self.status.terminal

    @property
    def ready(self) -> bool:
        """Allocated, recorded ready by the reconciler, and not marked lost since."""
        return self.status is Status.ALLOCATED and self.connection_ready


@attrs.frozen(kw_only=True)
class Fence:
    """What every claim-owned write is guarded by: the row, its lease and its generation."""

    allocation_id: str
    lease_id: str
    generation: int

    def advanced(self, generation: int) -> Fence:
        return attrs.evolve(self, generation=generation)

    def parameters(self, instance_id: str) -> dict[str, object]:
        """The named parameters of every fenced statement; ``instance_id`` is the hub that writes
        the ledger row."""
        return {
            "allocation_id": self.allocation_id,
            "lease_id": self.lease_id,
            "generation": self.generation,
            "instance_id": instance_id,
        }


@attrs.frozen(kw_only=True)
class EffectRow:
    """One phase of a plugin call, written by the fenced transition that brackets it: an
    ``intent`` after the transition that makes the call due (the bind before ``ensure``), an
    outcome before the transition that follows from it. ``status`` is the status the call ran in.
    """

    effect_id: str
    kind: str
    phase: Phase
    status: Status
    error_code: str | None = None
    message: str | None = None
    duration_ms: float | None = None

    def as_json(self, place: int) -> dict[str, object]:
        """The row as the statements' ``:effects`` take it; ``place`` orders it against the
        transition's own row (0): negative before it, positive after."""
        return {
            "place": place,
            "kind": self.kind,
            "from_status": str(self.status),
            "to_status": str(self.status),
            "phase": str(self.phase),
            "error_code": None if self.error_code is None else bounded_code(self.error_code),
            "message": None if self.message is None else bounded_message(self.message),
            "effect_id": self.effect_id,
            "duration_ms": self.duration_ms,
        }


def effects_json(effects: Sequence[EffectRow], *, accepted: bool = False) -> str:
    """``effects`` as a transition's ``:effects``: intents after the transition's own row,
    outcomes before it, each group in the order given. With ``accepted`` (a park that accepts
    an ensure), the acceptance's own row follows the outcomes."""
    rows = [
        effect.as_json(index + 1 if effect.phase is Phase.INTENT else index - len(effects) - 1)
        for index, effect in enumerate(effects)
    ]
    if accepted:
        rows.append(
            {
                "place": -1,
                "kind": "mark_allocated",
                "from_status": str(Status.PROVISIONING),
                "to_status": str(Status.ALLOCATED),
                "phase": str(Phase.COMMITTED),
            }
        )
    return json.dumps(rows)


@attrs.frozen(kw_only=True)
class LedgerEntry:
    """One row of the append-only allocation ledger."""

    seq: int
    allocation_id: str
    at: datetime
    generation: int
    lease_id: str | None
    instance_id: str | None
    effect_id: str | None
    kind: str
    from_status: str | None
    to_status: str | None
    phase: Phase
    error_code: str | None
    message: str | None
    duration_ms: float | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> LedgerEntry:
        values = {field.name: row[field.name] for field in attrs.fields(cls)}
        values["phase"] = Phase(values["phase"])
        return cls(**values)


@attrs.frozen(kw_only=True)
class Claimed:
    """A row a claim statement leased."""

    allocation: Allocation
    lease_id: str
    open_effects: bool
    """An earlier lease left a plugin call of this generation's history with no outcome."""
    destroy_intent: str | None = None
    """The effect id of the destroy intent the claim statement wrote (its step destroys the
    bound sidecar), or ``None``."""
    ensure_intent: str | None = None
    """The effect id of the ensure intent the claim statement wrote when it bound this pending
    row (see :class:`InitialBinds`), or ``None``."""


@attrs.frozen(kw_only=True)
class InitialBinds:
    """What a claim statement needs to bind the pending rows it leases, as
    ``bind_initial_sidecar`` would: the claim is then the write that makes their ensure due."""

    sidecar_ids: Sequence[str]
    """A new identity per claim slot, in slot order."""
    token_hashes: Sequence[bytes] = attrs.field(repr=False)
    """The hash of each identity's token, in slot order (the raw tokens stay with the caller)."""
    provisioners: Mapping[str, tuple[str, str]]
    """The claimer's provisioners: id → (api_version, binding_fingerprint). A row of another
    provisioner, or bound to another version or fingerprint, is leased but not bound."""
    connect_timeout: float
    ready_when: Mapping[str, str] = attrs.field(factory=dict)
    """Provisioner id → the default a bound row gets unless it asked how it becomes ready
    (``"connected"`` for one not named)."""


@attrs.frozen
class SidecarDeath:
    """A provisioner's report that sidecar ``sidecar_id`` of generation ``generation`` of
    ``allocation_id`` died; ``message`` says how (exit code, the tail of its output)."""

    allocation_id: str
    generation: int
    sidecar_id: str
    message: str


@attrs.frozen(kw_only=True)
class ProvisionerLimits:
    """What a provisioner's allocations may ask for and how long each stage may take, in
    seconds (``None``: no limit): the longest lifetime, the longest (and default) idle
    timeout, the wait to be claimed, and the time from the claim to ready."""

    max_lifetime: float | None = None
    pending_timeout: float | None = None
    idle_timeout: float | None = None
    provisioning_timeout: float | None = None


@attrs.frozen
class Deadlines:
    """What one deadline sweep moved, and the seconds until the next deadline it knows of
    (``None``: none)."""

    expired: int
    idle: int
    provisioning_timeout: int
    unserved: int
    warned: int
    next_in: float | None
    active: bool = True
    """Whether any allocation was active: with none, nothing can come due before a request."""
