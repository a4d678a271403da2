"""Every durable write a claim can make, as a value.

A decision (:mod:`hubd.reconciler.decisions`) returns one of these, complete with expected
status, delay, attempt counter, failure and connection fence; the executor
(:mod:`hubd.reconciler.executor`) maps each to its one fenced statement and changes none of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hubd.store.models import Status
from hubd.store.values import (
    NO_REPLACEMENT_LIMIT,
    AttemptKind,
    Failure,
    ParkMode,
    ReplacementLimit,
)

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


@attrs.frozen(kw_only=True)
class BindReplacement:
    """replacing → provisioning once the old sidecar is gone: a new identity for this
    generation (the provisioner binding was recorded by the first bind)."""

    sidecar_id: str
    token_hash: bytes = attrs.field(repr=False)
    connect_timeout: float


@attrs.frozen
class MarkAllocated:
    """provisioning → allocated: the provisioner accepted ensure, with what it said of the
    sidecar (checked: :func:`hubd.plugins.protocol.check_ensure_result`)."""

    external_ref: str | None
    endpoint: str | None = attrs.field(default=None, kw_only=True)
    metadata: Mapping[str, Any] | None = attrs.field(default=None, kw_only=True)


@attrs.frozen
class BeginInitialization:
    """Record, before the on-ready hook runs, that this lease is initializing the sidecar."""


@attrs.frozen
class MarkReady:
    """Finish initialization; an immediate follow-up instead if the connection number is no
    longer ``connection_seq``."""

    connection_seq: int


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


@attrs.frozen(kw_only=True)
class AcceptAndPark:
    """provisioning → allocated (``accepted``: ensure's acceptance) and ``park`` in the same
    statement: no claim is held between the acceptance and the park (or ready)."""

    accepted: MarkAllocated
    park: Park


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


@attrs.frozen(kw_only=True)
class FailNow:
    """``expected`` → failed: nothing was provisioned, so nothing needs destroying."""

    expected: Status
    failure: Failure


@attrs.frozen
class MarkDestroyFailed:
    """replacing/releasing → destroy_failed: an operator must look."""

    failure: Failure


@attrs.frozen
class MarkReleased:
    """releasing → released once the sidecar is destroyed."""


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
