"""Every durable write a claim can make, as a value that names its statement.

A decision (:mod:`hubd.reconciler.decisions`) returns one of these, complete with expected
status, delay, attempt counter, failure and connection fence. Each says, in its
``transition``, which block of ``hubd/store/sql/transitions.sql`` carries it out
and with what arguments (the claim's fence is added by the store); the executor
(:mod:`hubd.reconciler.executor`) runs that and changes none of it. ``effects`` are the ledger
rows of the plugin call the write brackets, written in the same statement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hubd.published import encode_metadata
from hubd.store.inputs import (
    NO_REPLACEMENT_LIMIT,
    AttemptKind,
    Failure,
    ParkMode,
    ReplacementLimit,
)
from hubd.store.rows import Status, effects_json
from hubd.store.transitions import SQL, Effects, Transition

__all__ = [
    "Abandon",
    "AcceptAndPark",
    "BeginInitialization",
    "BindInitial",
    "BindReplacement",
    "FailNow",
    "MarkAllocated",
    "MarkDestroyFailed",
    "MarkReady",
    "MarkReleased",
    "Park",
    "Retry",
    "Write",
]


@attrs.frozen(kw_only=True)
class BindInitial:
    """pending → provisioning: bind the provisioner as configured and a new sidecar identity."""

    sidecar_id: str
    token_hash: bytes = attrs.field(repr=False)
    connect_timeout: float
    api_version: str
    binding_fingerprint: str
    ready_when: str = "connected"
    """The provisioner's default, for a row that did not ask how it becomes ready."""

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(
            SQL.bind_initial_sidecar,
            "bind sidecar",
            effects,
            sidecar_id=self.sidecar_id,
            token_hash=self.token_hash,
            connect_timeout=float(self.connect_timeout),
            api_version=self.api_version,
            binding_fingerprint=self.binding_fingerprint,
            ready_when=self.ready_when,
        )


@attrs.frozen(kw_only=True)
class BindReplacement:
    """replacing → provisioning once the old sidecar is gone: a new identity for this
    generation (the provisioner binding was recorded by the first bind)."""

    sidecar_id: str
    token_hash: bytes = attrs.field(repr=False)
    connect_timeout: float

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(
            SQL.bind_replacement_sidecar,
            "bind replacement sidecar",
            effects,
            sidecar_id=self.sidecar_id,
            token_hash=self.token_hash,
            connect_timeout=float(self.connect_timeout),
        )


@attrs.frozen
class MarkAllocated:
    """provisioning → allocated: the provisioner accepted ensure, with what it said of the
    sidecar (checked: :func:`hubd.plugins.protocol.check_ensure_result`). ``endpoint`` fills
    only what the sidecar has not published; ``metadata`` goes under the sidecar's keys,
    whichever was written first."""

    external_ref: str | None
    endpoint: str | None = attrs.field(default=None, kw_only=True)
    metadata: Mapping[str, Any] | None = attrs.field(default=None, kw_only=True)

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(
            SQL.mark_allocated,
            "mark allocated",
            effects,
            external_ref=self.external_ref,
            endpoint=self.endpoint,
            metadata=encode_metadata(self.metadata),
        )


@attrs.frozen
class BeginInitialization:
    """Record, before the on-ready hook runs, that this lease is initializing the sidecar."""

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(SQL.begin_initialization, "begin initialization", effects)


@attrs.frozen
class MarkReady:
    """Finish initialization; an immediate follow-up instead if the connection number is no
    longer ``connection_seq`` (the row's ``connection_ready`` says which)."""

    connection_seq: int

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(
            SQL.mark_connection_ready,
            "mark ready",
            effects,
            connection_seq=int(self.connection_seq),
        )


@attrs.frozen(kw_only=True)
class Retry:
    """Stay in ``expected`` and try again after ``delay`` seconds, dropping the lease."""

    expected: Status
    delay: float
    attempt_kind: AttemptKind | None = None
    """The durable attempt counter to bump, if any."""
    failure: Failure | None = None
    clear_initialization: bool = False
    """The claim settled its initialization marker (the hook finished or failed cleanly)."""

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(
            SQL.schedule_retry,
            "schedule retry",
            effects,
            expected_status=str(self.expected),
            delay=float(self.delay),
            attempt=str(self.attempt_kind) if self.attempt_kind else None,
            failure_code=self.failure.code if self.failure else None,
            failure_message=self.failure.message if self.failure else None,
            clear_initialization=self.clear_initialization,
        )


@attrs.frozen(kw_only=True)
class Park:
    """Nothing to do until something happens: drop the lease and come back later."""

    mode: ParkMode
    delay: float
    failure: Failure | None = None
    connection_seq: int | None = None
    """Awaiting a connection: the number the claim saw; a different one makes the row due now."""
    ready_within: float | None = None
    """Awaiting a connection with no on-ready hook to run: if the sidecar already holds a
    record on an instance heartbeating within this many seconds, the row becomes ready instead
    (the look and the write in one statement)."""

    def transition(self, effects: Effects = ()) -> Transition:
        return _park(self, None, effects)


@attrs.frozen(kw_only=True)
class AcceptAndPark:
    """provisioning → allocated (``accepted``: ensure's acceptance) and ``park`` in the same
    statement: no claim is held between the acceptance and the park (or ready)."""

    accepted: MarkAllocated
    park: Park

    def transition(self, effects: Effects = ()) -> Transition:
        return _park(self.park, self.accepted, effects)


def _park(park: Park, accepted: MarkAllocated | None, effects: Effects) -> Transition:
    """The one statement of both parks; with ``accepted``, the acceptance's own ledger row
    follows the ensure's outcome in ``:effects``."""
    return Transition.of(
        SQL.park,
        "park",
        effects=effects_json(effects, accepted=accepted is not None),
        accept=accepted is not None,
        external_ref=None if accepted is None else accepted.external_ref,
        endpoint=None if accepted is None else accepted.endpoint,
        metadata=None if accepted is None else encode_metadata(accepted.metadata),
        mode=str(park.mode),
        delay=float(park.delay),
        failure_code=park.failure.code if park.failure else None,
        failure_message=park.failure.message if park.failure else None,
        connection_seq=park.connection_seq,
        ready_within=None if park.ready_within is None else float(park.ready_within),
    )


@attrs.frozen(kw_only=True)
class Abandon:
    """Give the current sidecar up under a new generation: replace it, or release it for good
    (``release``) when automatic recovery is off for an allocated sidecar."""

    release: bool
    expected: Status
    delay: float
    failure: Failure
    only_if_initialization_incomplete: bool = False
    expected_initialization_lease_id: str | None = None
    expected_connection_seq: int | None = None
    otherwise: Retry | None = None
    """What to write instead when a guard (initialization marker, connection number) keeps the
    abandon from matching: the guarded fact changed since the claim looked."""
    limit: ReplacementLimit = NO_REPLACEMENT_LIMIT
    """How often the allocation's sidecars may fail before a replacement becomes a give-up (the
    statement decides, on the row's count): the executor sets the configured one."""

    def transition(self, effects: Effects = ()) -> Transition:
        guard = {
            "failure_code": self.failure.code,
            "failure_message": self.failure.message,
            "only_if_initialization_incomplete": self.only_if_initialization_incomplete,
            "expected_initialization_lease_id": self.expected_initialization_lease_id,
            "expected_connection_seq": self.expected_connection_seq,
        }
        if self.release:
            # No plugin call's outcome leads to a release (it is never decided from an
            # ensure, which runs in provisioning): its statement takes no effects.
            return Transition.of(
                SQL.begin_unrecoverable_release, "begin unrecoverable release", effects, **guard
            )
        return Transition.of(
            SQL.begin_replacement,
            "begin replacement",
            effects,
            expected_status=str(self.expected),
            delay=float(self.delay),
            replacement_limit=int(self.limit.limit),
            replacement_window=float(self.limit.window),
            **guard,
        )


@attrs.frozen(kw_only=True)
class FailNow:
    """``expected`` → failed: nothing was provisioned, so nothing needs destroying."""

    expected: Status
    failure: Failure

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(
            SQL.fail_without_infrastructure,
            "fail",
            effects,
            expected_status=str(self.expected),
            failure_code=self.failure.code,
            failure_message=self.failure.message,
        )


@attrs.frozen
class MarkDestroyFailed:
    """replacing/releasing → destroy_failed: an operator must look."""

    failure: Failure

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(
            SQL.mark_destroy_failed,
            "mark destroy failed",
            effects,
            failure_code=self.failure.code,
            failure_message=self.failure.message,
        )


@attrs.frozen
class MarkReleased:
    """releasing → released once the sidecar is destroyed (→ failed after a give-up)."""

    def transition(self, effects: Effects = ()) -> Transition:
        return Transition.of(SQL.mark_released, "mark released", effects)


Write = (
    BindInitial
    | BindReplacement
    | MarkAllocated
    | BeginInitialization
    | MarkReady
    | Retry
    | Park
    | AcceptAndPark
    | Abandon
    | FailNow
    | MarkDestroyFailed
    | MarkReleased
)
