"""What follows what: the reconciler's decisions as plain functions over values.

No loop, no database: each function maps what a claim saw to the complete durable write it
makes next (:mod:`hubd.reconciler.writes`), and the asyncio code (:mod:`hubd.reconciler.claim`,
:mod:`hubd.reconciler.executor`) carries it out unchanged.

The transitions, by the step a claimed status takes (:func:`step_for`), are the table of
architecture §1, their one statement: every write of :mod:`hubd.reconciler.writes` is named
there and nothing else is (``tests/test_decisions.py`` holds the two together).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Final

import attrs

from hubd.backoff import Backoff
from hubd.errors import InitializationUncertain, OperationTimeout
from hubd.plugins.protocol import Accepted, Destroyed, DestroyRejected, Rejected
from hubd.reconciler.writes import (
    Abandon,
    FailNow,
    MarkAllocated,
    MarkDestroyFailed,
    Park,
    Retry,
)
from hubd.store.inputs import AttemptKind, Failure, ParkMode
from hubd.store.rows import Allocation, EffectRow, Phase, Status

if TYPE_CHECKING:
    # A type only: hubd.store.connection_values loads the driver (through hubd.store.secrets),
    # and no decision may need it.
    from hubd.store.connection_values import Readiness

__all__ = [
    "AUTOMATIC_RECOVERY_DISABLED",
    "CAPPED_DELAY",
    "RETRY_SCHEDULE",
    "DestroyOutcome",
    "EnsureOutcome",
    "PluginOutcome",
    "Proceed",
    "Raised",
    "Step",
    "TimedOut",
    "abandon",
    "abandon_unsettled",
    "after_connect_window",
    "after_destroy",
    "after_ensure",
    "after_error",
    "after_on_ready",
    "await_connection",
    "backoff",
    "connect_remaining",
    "connect_window",
    "deadline_passed",
    "effect_phase",
    "not_called",
    "outcome_text",
    "replacement_becomes_release",
    "retry_delay",
    "step_for",
    "unless_connected",
    "wake_on_start",
]

AUTOMATIC_RECOVERY_DISABLED: Final = "Automatic recovery is disabled: "

RETRY_SCHEDULE: Final = Backoff(base=1.0, cap=30.0)
"""The reconciler's durable retries: :mod:`hubd.backoff`'s formula with its own base and cap.
Its attempt is a counter on the row, not a loop's in-memory :class:`~hubd.backoff.Retries`, so
the schedule survives a restart and goes on across replicas; and its delay is the ceiling,
unjittered, since ``next_attempt_at`` is one row's and no herd waits by it."""


def retry_delay(attempt: int) -> float:
    """Seconds before the next try: ``min(1 s · 2^attempt, 30 s)`` (1, 2, 4, 8, 16, then 30)."""
    return RETRY_SCHEDULE.ceiling(attempt)


CAPPED_DELAY: Final = RETRY_SCHEDULE.cap
"""The backoff's ceiling: where no durable attempt counter exists, it keeps a step that always
fails from becoming a hot loop."""


def backoff(allocation: Allocation) -> float:
    """The delay before ``allocation``'s next try, from its durable attempt counters."""
    # Both counters: replacements of one allocation back off across generations, and a
    # sidecar that becomes ready resets them.
    return retry_delay(allocation.ensure_attempts + allocation.destroy_attempts)


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
PluginOutcome = EnsureOutcome | DestroyOutcome


def effect_phase(outcome: PluginOutcome) -> Phase:
    """The ledger phase that records ``outcome``."""
    if isinstance(outcome, Accepted | Destroyed):
        return Phase.COMMITTED
    if isinstance(outcome, TimedOut):
        return Phase.AMBIGUOUS
    return Phase.FAILED


def not_called(intent: EffectRow, problem: str) -> EffectRow:
    """The outcome row of an ``intent`` whose call is not made because of ``problem``."""
    return attrs.evolve(
        intent, phase=Phase.FAILED, error_code="not_called", message=f"not called: {problem}"
    )


def outcome_text(kind: str, outcome: PluginOutcome) -> tuple[str | None, str | None]:
    """The ledger's error code and message for the outcome of a ``kind`` call."""
    if isinstance(outcome, Rejected | DestroyRejected):
        return outcome.code, outcome.message
    if isinstance(outcome, TimedOut):
        return f"{kind}_timeout", f"{kind} did not finish within operation_timeout"
    if isinstance(outcome, Raised):
        return f"{kind}_failed", outcome.message
    return None, None


# -- abandoning a sidecar ----------------------------------------------------------------------


def replacement_becomes_release(status: Status, *, automatic_recovery: bool) -> bool:
    """Replacing an allocated sidecar while automatic recovery is off releases it instead."""
    return status is Status.ALLOCATED and not automatic_recovery


def abandon(
    allocation: Allocation,
    failure: Failure,
    *,
    automatic_recovery: bool,
    initialization_incomplete: bool = False,
    connection_seq: int | None = None,
) -> Abandon:
    """Give up ``allocation``'s sidecar for ``failure``: a replacement after the backoff, or a
    release. Guarded on the initialization marker the claim found
    (``initialization_incomplete``) or on the connection number it saw; when the guard no
    longer holds, the ordinary path is retried at once instead."""
    guarded = initialization_incomplete or connection_seq is not None
    release = replacement_becomes_release(allocation.status, automatic_recovery=automatic_recovery)
    if release:
        # A release is due at once: it only destroys, and no backoff protects anything.
        expected, delay = Status.ALLOCATED, 0.0
        failure = Failure(failure.code, AUTOMATIC_RECOVERY_DISABLED + failure.message)
    else:
        expected = (
            Status.ALLOCATED if allocation.status is Status.ALLOCATED else Status.PROVISIONING
        )
        delay = backoff(allocation)
    return Abandon(
        release=release,
        expected=expected,
        delay=delay,
        failure=failure,
        only_if_initialization_incomplete=initialization_incomplete,
        expected_initialization_lease_id=(
            allocation.initialization_lease_id if initialization_incomplete else None
        ),
        expected_connection_seq=connection_seq,
        otherwise=Retry(expected=allocation.status, delay=0) if guarded else None,
    )


# -- after ensure and destroy ------------------------------------------------------------------


def after_ensure(
    outcome: EnsureOutcome, allocation: Allocation, *, automatic_recovery: bool
) -> MarkAllocated | Abandon | FailNow:
    """What ensure's outcome makes of a provisioning ``allocation``."""
    if isinstance(outcome, Accepted):
        return MarkAllocated(
            outcome.external_ref, endpoint=outcome.endpoint, metadata=outcome.metadata
        )
    if isinstance(outcome, Rejected):
        failure = Failure(outcome.code, outcome.message)
        if not outcome.retryable:
            return FailNow(expected=Status.PROVISIONING, failure=failure)
    elif isinstance(outcome, TimedOut):
        failure = Failure("ensure_failed", "ensure did not finish within operation_timeout")
    else:
        failure = Failure("ensure_failed", outcome.message)
    return abandon(allocation, failure, automatic_recovery=automatic_recovery)


@attrs.frozen
class Proceed:
    """The old sidecar is gone: go on to rebind or to release."""


def after_destroy(
    outcome: DestroyOutcome, allocation: Allocation
) -> Proceed | Retry | MarkDestroyFailed:
    """What destroy's outcome makes of a replacing or releasing ``allocation``."""
    if isinstance(outcome, Destroyed):
        return Proceed()
    if isinstance(outcome, DestroyRejected):
        failure = Failure(outcome.code, outcome.message)
        if not outcome.retryable:
            return MarkDestroyFailed(failure)
    elif isinstance(outcome, TimedOut):
        failure = Failure("destroy_failed", "destroy did not finish within operation_timeout")
    else:
        failure = Failure("destroy_failed", outcome.message)
    return Retry(
        expected=allocation.status,
        delay=retry_delay(allocation.destroy_attempts),
        attempt_kind=AttemptKind.DESTROY,
        failure=failure,
    )


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


def abandon_unsettled(
    step: Step, allocation: Allocation, *, automatic_recovery: bool
) -> Abandon | None:
    """The write for a claim whose ``step`` finds an earlier claim's work unsettled: ensure
    bound but its acceptance never recorded, or an initialization recorded but never
    completed. ``None`` for any other step."""
    if step is Step.REPLACE_UNKNOWN_ENSURE:
        failure = Failure(
            "ensure_outcome_unknown", "a hub stopped before ensure's acceptance was recorded"
        )
        return abandon(allocation, failure, automatic_recovery=automatic_recovery)
    if step is Step.REPLACE_UNCERTAIN_INITIALIZATION:
        failure = Failure(
            "sidecar_initialization_uncertain",
            "a previous initialization did not record completion",
        )
        return abandon(
            allocation,
            failure,
            automatic_recovery=automatic_recovery,
            initialization_incomplete=True,
        )
    return None


def after_error(error: BaseException) -> Park:
    """A claim that failed with ``error`` parks; the row keeps its status."""
    failure = Failure("reconcile_error", f"{type(error).__name__}: {error}")
    return Park(mode=ParkMode.RETRY_AFTER_ERROR, delay=CAPPED_DELAY, failure=failure)


def wake_on_start(allocation: Allocation) -> bool:
    """Whether start-up repair makes an active row due now: only an unscheduled row that is
    not allocated (allocated rows are the connection repair's). Moving an existing schedule
    earlier would erase a provisioner's backoff on every restart."""
    return allocation.status is not Status.ALLOCATED and allocation.next_attempt_at is None


# -- waiting for the sidecar's connect ---------------------------------------------------------


def connect_remaining(readiness: Readiness, *, connect_timeout: float) -> float:
    """Seconds left for the sidecar to connect, as of the look that produced ``readiness``:
    the row's deadline at that look, never the claimed copy's. A disconnect committed since the
    claim read its row gave it a fresh deadline, and a row claimed while its sidecar was
    connected had none at all. A row without one, whose sidecar holds no live record, has not
    started its clock (the disconnect or the repair sweep that starts it is on its way): it
    gets a whole ``connect_timeout``, so it is parked and never abandoned on a guess."""
    if readiness.deadline_in is None:
        return connect_timeout
    return readiness.deadline_in


def connect_window(remaining: float, operation_timeout: float) -> float:
    """How long one claim waits for the sidecar's connect, ``remaining`` seconds before its
    deadline: up to the deadline, at most one ``operation_timeout`` (a claim holds a slot
    while it waits); 0 once the deadline has passed."""
    return max(0.0, min(remaining, operation_timeout))


def deadline_passed(remaining: float) -> str:
    """Why no window is left: the deadline passed ``-remaining`` seconds ago."""
    return f"the sidecar did not connect before its deadline ({-remaining:.0f}s ago)"


def await_connection(connection_seq: int, *, ready_within: float | None = None) -> Park:
    """Park until the connect deadline; fenced on the connection number the claim saw, so a
    connect recorded since (on any replica) makes the row due now instead. With
    ``ready_within``, a sidecar already connected makes the row ready instead."""
    return Park(
        mode=ParkMode.AWAIT_CONNECTION,
        delay=CAPPED_DELAY,
        connection_seq=connection_seq,
        ready_within=ready_within,
    )


def after_acceptance(
    allocation: Allocation, *, has_on_ready: bool, instance_ttl: float
) -> Park | None:
    """What follows an accepted ensure. With no on-ready hook, one statement looks at the
    connection record and parks or makes the row ready. With a hook, ``None``: look at the
    record first, since a connected sidecar must go through the hook."""
    if has_on_ready:
        return None
    return await_connection(allocation.connection_seq, ready_within=instance_ttl)


def unless_connected(readiness: Readiness) -> Park | None:
    """``None`` when the sidecar holds a live record (go on to ready), else park for it."""
    return None if readiness.connected else await_connection(readiness.connection_seq)


def after_connect_window(
    allocation: Allocation,
    *,
    remaining: float,
    window: float,
    seen: Readiness,
    missed: str,
    automatic_recovery: bool,
) -> Park | Abandon:
    """No connect came in a window of ``window`` seconds, ``remaining`` before the deadline
    (``missed`` says how the wait ended). Before the deadline, give the slot back and park;
    at it, abandon the sidecar, fenced on the connection number seen, so one that connected
    anywhere since is not abandoned for not connecting."""
    if seen.exit_message is not None:
        # Its provisioner said it died: no wait can bring it back.
        return abandon(
            allocation,
            Failure("sidecar_exited", seen.exit_message),
            automatic_recovery=automatic_recovery,
            connection_seq=seen.connection_seq,
        )
    if remaining > window:
        return await_connection(seen.connection_seq)
    return abandon(
        allocation,
        Failure("sidecar_connect_failed", missed),
        automatic_recovery=automatic_recovery,
        connection_seq=seen.connection_seq,
    )


def after_on_ready(
    error: Exception, allocation: Allocation, *, automatic_recovery: bool
) -> Abandon | Retry:
    """The on_ready hook raised ``error``. A hook that timed out may still be running, or may
    have done half its work: like one that says so, its outcome is uncertain, and the sidecar
    is abandoned while the marker still stands. Any other error is a clean failure: clear the
    marker and retry, capped, since no durable counter exists for hook attempts."""
    if isinstance(error, InitializationUncertain | OperationTimeout):
        return abandon(
            allocation,
            Failure("sidecar_initialization_uncertain", str(error)),
            automatic_recovery=automatic_recovery,
            initialization_incomplete=True,
        )
    return Retry(
        expected=Status.ALLOCATED,
        delay=CAPPED_DELAY,
        failure=Failure("sidecar_initialization_failed", f"{type(error).__name__}: {error}"),
        clear_initialization=True,
    )
