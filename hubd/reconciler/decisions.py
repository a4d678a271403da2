"""What follows what: the reconciler's decisions as plain functions over values.

No loop, no database: each function maps an outcome to the next step, and the asyncio code in
:mod:`hubd.reconciler.engine` carries the step out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, Protocol

import attrs

from hubd.plugins.protocol import Accepted, Destroyed, DestroyRejected, Rejected
from hubd.store.models import Phase, Status
from hubd.store.values import Failure

__all__ = [
    "AUTOMATIC_RECOVERY_DISABLED",
    "MAX_BACKOFF_ATTEMPT",
    "DestroyFailed",
    "DestroyOutcome",
    "EnsureOutcome",
    "Fail",
    "MarkAllocated",
    "Proceed",
    "Raised",
    "Replace",
    "RetryDestroy",
    "Step",
    "TimedOut",
    "after_destroy",
    "after_ensure",
    "effect_phase",
    "provisioner_mismatch",
    "replacement_becomes_release",
    "retry_delay",
    "step_for",
    "unavailable_provisioner",
]

MAX_BACKOFF_ATTEMPT: Final = 5
BASE_DELAY: Final = 1.0
MAX_DELAY: Final = 30.0
AUTOMATIC_RECOVERY_DISABLED: Final = "Automatic recovery is disabled: "


def retry_delay(attempt: int) -> float:
    """Seconds before the next try: ``min(1 s · 2^min(attempt, 5), 30 s)``."""
    return float(min(BASE_DELAY * 2 ** min(max(attempt, 0), MAX_BACKOFF_ATTEMPT), MAX_DELAY))


# -- outcomes of a plugin call ---------------------------------------------------------------


@attrs.frozen
class Raised:
    """The call raised, or returned something that is not a result."""

    message: str


@attrs.frozen
class TimedOut:
    """The call outlived operation_timeout: whether it took effect cannot be known."""


EnsureOutcome = Accepted | Rejected | Raised | TimedOut
DestroyOutcome = Destroyed | DestroyRejected | Raised | TimedOut


def effect_phase(outcome: EnsureOutcome | DestroyOutcome) -> Phase:
    """The ledger phase that records ``outcome``."""
    if isinstance(outcome, Accepted | Destroyed):
        return Phase.COMMITTED
    if isinstance(outcome, TimedOut):
        return Phase.AMBIGUOUS
    return Phase.FAILED


# -- after ensure --------------------------------------------------------------------------------


@attrs.frozen
class MarkAllocated:
    external_ref: str | None


@attrs.frozen
class Replace:
    failure: Failure


@attrs.frozen
class Fail:
    failure: Failure


def after_ensure(outcome: EnsureOutcome) -> MarkAllocated | Replace | Fail:
    if isinstance(outcome, Accepted):
        return MarkAllocated(outcome.external_ref)
    if isinstance(outcome, Rejected):
        failure = Failure(outcome.code, outcome.message)
        return Replace(failure) if outcome.retryable else Fail(failure)
    if isinstance(outcome, TimedOut):
        return Replace(Failure("ensure_failed", "ensure did not finish within operation_timeout"))
    return Replace(Failure("ensure_failed", outcome.message))


# -- after destroy -------------------------------------------------------------------------------


@attrs.frozen
class Proceed:
    """The old sidecar is gone: go on to rebind or to release."""


@attrs.frozen
class RetryDestroy:
    failure: Failure


@attrs.frozen
class DestroyFailed:
    failure: Failure


def after_destroy(outcome: DestroyOutcome) -> Proceed | RetryDestroy | DestroyFailed:
    if isinstance(outcome, Destroyed):
        return Proceed()
    if isinstance(outcome, DestroyRejected):
        failure = Failure(outcome.code, outcome.message)
        return RetryDestroy(failure) if outcome.retryable else DestroyFailed(failure)
    if isinstance(outcome, TimedOut):
        return RetryDestroy(
            Failure("destroy_failed", "destroy did not finish within operation_timeout")
        )
    return RetryDestroy(Failure("destroy_failed", outcome.message))


# -- what a claim does -----------------------------------------------------------------------


class Step(enum.Enum):
    NOTHING = "nothing"
    BIND_AND_ENSURE = "bind_and_ensure"
    REPLACE_UNKNOWN_ENSURE = "replace_unknown_ensure"
    REPLACE_UNCERTAIN_INITIALIZATION = "replace_uncertain_initialization"
    WAIT_UNTIL_READY = "wait_until_ready"
    DESTROY_THEN_REBIND = "destroy_then_rebind"
    DESTROY_THEN_RELEASE = "destroy_then_release"


def step_for(status: Status, *, initialization_recorded: bool) -> Step:
    """The step a claim takes for an allocation in ``status`` whose provisioner is available."""
    if status is Status.PENDING:
        return Step.BIND_AND_ENSURE
    if status is Status.PROVISIONING:
        # The raw token is never durable: finding this status means a process died (or lost
        # its lease) between binding and recording ensure's acceptance.
        return Step.REPLACE_UNKNOWN_ENSURE
    if status is Status.ALLOCATED:
        if initialization_recorded:
            return Step.REPLACE_UNCERTAIN_INITIALIZATION
        return Step.WAIT_UNTIL_READY
    if status is Status.REPLACING:
        return Step.DESTROY_THEN_REBIND
    if status is Status.RELEASING:
        return Step.DESTROY_THEN_RELEASE
    return Step.NOTHING


class _Bindable(Protocol):
    """What a binding check needs of a provisioner (the plugin protocol's identity)."""

    @property
    def api_version(self) -> str: ...

    @property
    def binding_fingerprint(self) -> str: ...


def provisioner_mismatch(
    *,
    provisioner_id: str,
    bound_api_version: str | None,
    bound_fingerprint: str | None,
    configured: Mapping[str, _Bindable],
) -> str | None:
    """Why the configured provisioners cannot serve an allocation bound as given, in words an
    operator can act on; ``None`` when the one it names can.

    Fingerprints are digests of where sidecars run, not secrets; the first 12 hex characters
    tell two bindings apart in a log line.
    """
    provisioner = configured.get(provisioner_id)
    if provisioner is None:
        known = ", ".join(sorted(configured)) or "none"
        return (
            f"provisioner {provisioner_id} is not configured on this daemon (configured: "
            f"{known}); add it to [[provisioners]], or let a daemon that has it finish this "
            "allocation"
        )
    if bound_api_version not in (None, provisioner.api_version):
        return (
            f"provisioner {provisioner_id} speaks api_version {provisioner.api_version}, but this "
            f"allocation was bound with api_version {bound_api_version}; run the plugin version "
            "it was bound with to finish it"
        )
    if bound_fingerprint not in (None, provisioner.binding_fingerprint):
        assert bound_fingerprint is not None
        return (
            f"provisioner {provisioner_id} binding changed: this allocation was bound to "
            f"fingerprint {bound_fingerprint[:12]}, the configured one is "
            f"{provisioner.binding_fingerprint[:12]} (its options that decide where sidecars "
            "run differ, e.g. hubd dev and hubd run on one database); serve it from a daemon "
            "configured as when it was bound, or restore those options"
        )
    return None


def unavailable_provisioner(status: Status, problem: str) -> Fail | None:
    """A missing or re-bound provisioner fails a pending allocation (nothing was provisioned);
    any other status retries later (``None``), since infrastructure may exist."""
    if status is Status.PENDING:
        return Fail(Failure("provisioner_unavailable", problem))
    return None


def replacement_becomes_release(status: Status, *, automatic_recovery: bool) -> bool:
    """Replacing an allocated sidecar while automatic recovery is off releases it instead."""
    return status is Status.ALLOCATED and not automatic_recovery
