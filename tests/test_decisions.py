"""The reconciler's decisions as plain functions: no loop, no database.

Each decision answers with the complete write a claim makes next; these tests read the write's
every field.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import attrs
import pytest

import hubd.reconciler.writes as writes_module
from hubd.errors import InitializationUncertain, OperationTimeout
from hubd.plugins.protocol import Accepted, Destroyed, DestroyRejected, Rejected
from hubd.reconciler.decisions import (
    AUTOMATIC_RECOVERY_DISABLED,
    CAPPED_DELAY,
    DestroyOutcome,
    EnsureOutcome,
    PluginOutcome,
    Proceed,
    Raised,
    Step,
    TimedOut,
    abandon,
    abandon_unsettled,
    after_acceptance,
    after_connect_window,
    after_destroy,
    after_ensure,
    after_error,
    after_on_ready,
    await_connection,
    backoff,
    connect_remaining,
    connect_window,
    deadline_passed,
    effect_phase,
    outcome_text,
    replacement_becomes_release,
    retry_delay,
    step_for,
    unless_connected,
    wake_on_start,
)
from hubd.reconciler.eligibility import (
    provisioner_mismatch,
    provisioner_problem,
    provisioner_unavailable,
)
from hubd.reconciler.writes import (
    Abandon,
    FailNow,
    MarkAllocated,
    MarkDestroyFailed,
    Park,
    Retry,
)
from hubd.store import Allocation, AttemptKind, Failure, ParkMode, Phase, Status
from hubd.store.connection_values import Readiness

T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def row(
    status: Status,
    *,
    ensure_attempts: int = 0,
    destroy_attempts: int = 0,
    initialization_lease_id: str | None = None,
    next_attempt_at: datetime | None = T0,
    bound: tuple[str, str] | None = None,
) -> Allocation:
    """An allocation row as a claim reads it; only what decisions look at varies."""
    return Allocation(
        id="al_" + "d" * 32,
        status=status,
        generation=3,
        provisioner_id="local",
        provisioner_api_version=bound[0] if bound else None,
        provisioner_binding_fingerprint=bound[1] if bound else None,
        tenant_id=None,
        session_id=None,
        spec={},
        sidecar_id="sc_1",
        token_hash=None,
        external_ref=None,
        connect_deadline=None,
        connection_ready=False,
        connection_seq=7,
        initialization_lease_id=initialization_lease_id,
        ensure_attempts=ensure_attempts,
        destroy_attempts=destroy_attempts,
        next_attempt_at=next_attempt_at,
        lease_id="ls_1",
        lease_expires_at=None,
        failure_code=None,
        failure_message=None,
        created_at=T0,
        updated_at=T0,
        finished_at=None,
    )


class TestBackoff:
    @pytest.mark.parametrize(
        ("attempt", "seconds"),
        [(0, 1), (1, 2), (2, 4), (3, 8), (4, 16), (5, 30), (6, 30), (100, 30), (-3, 1)],
    )
    def test_formula(self, attempt: int, seconds: float) -> None:
        """The delay is min(1 s * 2^min(attempt, 5), 30 s)."""
        assert retry_delay(attempt) == seconds

    def test_counts_both_counters(self) -> None:
        """An allocation's backoff counts ensure and destroy attempts together, so replacements
        back off across generations."""
        assert backoff(row(Status.PROVISIONING, ensure_attempts=1, destroy_attempts=2)) == 8

    def test_capped(self) -> None:
        """Where no durable counter exists, the delay is the backoff's ceiling."""
        assert CAPPED_DELAY == 30


class TestPluginOutcomes:
    @pytest.mark.parametrize(
        ("outcome", "phase"),
        [
            (Accepted(None), Phase.COMMITTED),
            (Destroyed(), Phase.COMMITTED),
            (TimedOut(), Phase.AMBIGUOUS),
            (Raised("x"), Phase.FAILED),
            (Rejected(code="c", message="m", retryable=True), Phase.FAILED),
        ],
    )
    def test_ledger_phase(self, outcome: PluginOutcome, phase: Phase) -> None:
        """Only a timeout leaves the outcome unknown (ambiguous)."""
        assert effect_phase(outcome) == phase

    @pytest.mark.parametrize(
        ("outcome", "text"),
        [
            (Accepted("ref"), (None, None)),
            (Destroyed(), (None, None)),
            (Rejected(code="quota", message="full", retryable=True), ("quota", "full")),
            (DestroyRejected(code="busy", message="wait", retryable=False), ("busy", "wait")),
            (TimedOut(), ("ensure_timeout", "ensure did not finish within operation_timeout")),
            (Raised("OSError: down"), ("ensure_failed", "OSError: down")),
        ],
    )
    def test_ledger_text(self, outcome: PluginOutcome, text: tuple[str | None, str | None]) -> None:
        """The ledger keeps a rejection's own code and message, names a timeout or a raise by
        the call's kind, and records nothing for a success."""
        assert outcome_text("ensure", outcome) == text


class TestEnsure:
    def test_accepted(self) -> None:
        """An accepted ensure marks the allocation allocated with its external reference."""
        assert after_ensure(
            Accepted("pod-1"), row(Status.PROVISIONING), automatic_recovery=False
        ) == MarkAllocated("pod-1")

    def test_permanent_rejection_fails(self) -> None:
        """A permanent rejection fails the provisioning row with the plugin's code."""
        rejected = Rejected(code="Bad Spec!", message="no", retryable=False)
        assert after_ensure(rejected, row(Status.PROVISIONING), automatic_recovery=False) == (
            FailNow(expected=Status.PROVISIONING, failure=Failure("bad_spec", "no"))
        )

    @pytest.mark.parametrize(
        ("outcome", "failure"),
        [
            (Rejected(code="quota", message="full", retryable=True), Failure("quota", "full")),
            (Raised("boom"), Failure("ensure_failed", "boom")),
            (
                TimedOut(),
                Failure("ensure_failed", "ensure did not finish within operation_timeout"),
            ),
        ],
    )
    def test_otherwise_replaces_after_backoff(
        self, outcome: EnsureOutcome, failure: Failure
    ) -> None:
        """A retryable rejection, a raise or a timeout replaces the sidecar after the backoff
        of the row's attempts, unguarded; automatic recovery does not apply while
        provisioning."""
        a = row(Status.PROVISIONING, ensure_attempts=2)
        decided = after_ensure(outcome, a, automatic_recovery=False)
        assert decided == Abandon(
            release=False, expected=Status.PROVISIONING, delay=4, failure=failure
        )


class TestDestroy:
    def test_destroyed_proceeds(self) -> None:
        """Destroyed lets the claim go on to rebind or release."""
        assert after_destroy(Destroyed(), row(Status.REPLACING)) == Proceed()

    @pytest.mark.parametrize(
        ("outcome", "failure"),
        [
            (DestroyRejected(code="busy", message="m", retryable=True), Failure("busy", "m")),
            (Raised("x"), Failure("destroy_failed", "x")),
            (
                TimedOut(),
                Failure("destroy_failed", "destroy did not finish within operation_timeout"),
            ),
        ],
    )
    def test_retries_count_destroy_attempts(
        self, outcome: DestroyOutcome, failure: Failure
    ) -> None:
        """A retryable rejection, a raise or a timeout retries in the same status, bumping the
        destroy counter, after the backoff of destroy attempts alone."""
        a = row(Status.RELEASING, ensure_attempts=4, destroy_attempts=1)
        decided = after_destroy(outcome, a)
        assert decided == Retry(
            expected=Status.RELEASING, delay=2, attempt_kind=AttemptKind.DESTROY, failure=failure
        )

    def test_permanent_rejection(self) -> None:
        """A permanent rejection is destroy_failed, with the plugin's code."""
        rejected = DestroyRejected(code="gone", message="m", retryable=False)
        assert after_destroy(rejected, row(Status.REPLACING)) == MarkDestroyFailed(
            Failure("gone", "m")
        )


class TestAbandon:
    def test_recovery_switch(self) -> None:
        """Only an allocated sidecar becomes a release when automatic recovery is off."""
        assert replacement_becomes_release(Status.ALLOCATED, automatic_recovery=False)
        assert not replacement_becomes_release(Status.ALLOCATED, automatic_recovery=True)
        assert not replacement_becomes_release(Status.PROVISIONING, automatic_recovery=False)

    def test_replacement_of_allocated(self) -> None:
        """With automatic recovery, an allocated sidecar is replaced after the backoff."""
        failure = Failure("sidecar_connect_failed", "gone")
        a = row(Status.ALLOCATED, destroy_attempts=3)
        assert abandon(a, failure, automatic_recovery=True) == Abandon(
            release=False, expected=Status.ALLOCATED, delay=8, failure=failure
        )

    def test_release_says_why(self) -> None:
        """Without automatic recovery an allocated sidecar is released at once, and the
        failure says recovery is disabled."""
        decided = abandon(
            row(Status.ALLOCATED, ensure_attempts=5),
            Failure("sidecar_connect_failed", "gone"),
            automatic_recovery=False,
        )
        assert decided.release
        assert decided.delay == 0
        assert decided.failure == Failure(
            "sidecar_connect_failed", AUTOMATIC_RECOVERY_DISABLED + "gone"
        )

    def test_guarded_on_initialization(self) -> None:
        """Guarded on the initialization marker, the abandon names the lease that set it and
        falls back to an immediate retry of the ordinary path."""
        a = row(Status.ALLOCATED, initialization_lease_id="ls_0")
        decided = abandon(
            a, Failure("c", "m"), automatic_recovery=True, initialization_incomplete=True
        )
        assert decided.only_if_initialization_incomplete
        assert decided.expected_initialization_lease_id == "ls_0"
        assert decided.expected_connection_seq is None
        assert decided.otherwise == Retry(expected=Status.ALLOCATED, delay=0)

    def test_guarded_on_connection(self) -> None:
        """Guarded on a connection number, the abandon falls back to an immediate retry."""
        a = row(Status.ALLOCATED, initialization_lease_id="ls_0")
        decided = abandon(a, Failure("c", "m"), automatic_recovery=False, connection_seq=9)
        assert decided.expected_connection_seq == 9
        assert decided.expected_initialization_lease_id is None
        assert not decided.only_if_initialization_incomplete
        assert decided.otherwise == Retry(expected=Status.ALLOCATED, delay=0)


class TestStatusSteps:
    @pytest.mark.parametrize(
        ("status", "recorded", "step"),
        [
            (Status.PENDING, False, Step.BIND_AND_ENSURE),
            (Status.PROVISIONING, False, Step.REPLACE_UNKNOWN_ENSURE),
            (Status.ALLOCATED, False, Step.WAIT_UNTIL_READY),
            (Status.ALLOCATED, True, Step.REPLACE_UNCERTAIN_INITIALIZATION),
            (Status.REPLACING, False, Step.DESTROY_THEN_REBIND),
            (Status.RELEASING, False, Step.DESTROY_THEN_RELEASE),
            (Status.RELEASED, False, Step.NOTHING),
            (Status.FAILED, False, Step.NOTHING),
            (Status.DESTROY_FAILED, False, Step.NOTHING),
        ],
    )
    def test_step_for(self, status: Status, recorded: bool, step: Step) -> None:
        """Each status maps to the step of architecture §1."""
        assert step_for(status, initialization_recorded=recorded) is step

    def test_unknown_ensure(self) -> None:
        """A provisioning row found by a claim is replaced: ensure's outcome is unknown."""
        decided = abandon_unsettled(
            Step.REPLACE_UNKNOWN_ENSURE, row(Status.PROVISIONING), automatic_recovery=False
        )
        assert decided == Abandon(
            release=False,
            expected=Status.PROVISIONING,
            delay=1,
            failure=Failure(
                "ensure_outcome_unknown", "a hub stopped before ensure's acceptance was recorded"
            ),
        )

    def test_uncertain_initialization(self) -> None:
        """A recorded, unfinished initialization abandons the sidecar while the marker stands."""
        a = row(Status.ALLOCATED, initialization_lease_id="ls_0")
        decided = abandon_unsettled(
            Step.REPLACE_UNCERTAIN_INITIALIZATION, a, automatic_recovery=True
        )
        assert decided is not None
        assert decided.failure.code == "sidecar_initialization_uncertain"
        assert decided.expected_initialization_lease_id == "ls_0"
        assert decided.otherwise == Retry(expected=Status.ALLOCATED, delay=0)

    def test_other_steps_settle_nothing(self) -> None:
        """Every other step has nothing unsettled to abandon."""
        for step in (Step.BIND_AND_ENSURE, Step.WAIT_UNTIL_READY, Step.DESTROY_THEN_RELEASE):
            assert abandon_unsettled(step, row(Status.PENDING), automatic_recovery=True) is None

    def test_error_parks(self) -> None:
        """A claim that failed parks for the capped delay, saying what was raised."""
        assert after_error(ValueError("bad row")) == Park(
            mode=ParkMode.RETRY_AFTER_ERROR,
            delay=30,
            failure=Failure("reconcile_error", "ValueError: bad row"),
        )

    def test_start_up_wakes_only_unscheduled_rows(self) -> None:
        """Start-up makes an unscheduled row due, except an allocated one (the connection
        repair's), and never moves an existing schedule."""
        assert wake_on_start(row(Status.REPLACING, next_attempt_at=None))
        assert not wake_on_start(row(Status.REPLACING))
        assert not wake_on_start(row(Status.ALLOCATED, next_attempt_at=None))


class TestConnectWait:
    def test_time_left_is_the_looks_own(self) -> None:
        """The time left is the row's deadline as the readiness look saw it; a row with no
        deadline (claimed while its sidecar was connected) gets a whole connect timeout, so
        it is parked, never abandoned."""
        looked = Readiness(connected=False, connection_seq=4, deadline_in=70.0)
        assert connect_remaining(looked, connect_timeout=30) == 70
        passed = Readiness(connected=False, connection_seq=4, deadline_in=-30.0)
        assert connect_remaining(passed, connect_timeout=30) == -30
        none = Readiness(connected=False, connection_seq=4, deadline_in=None)
        assert connect_remaining(none, connect_timeout=30) == 30
        window = connect_window(connect_remaining(none, connect_timeout=30), operation_timeout=5)
        assert isinstance(
            after_connect_window(
                row(Status.ALLOCATED),
                remaining=connect_remaining(none, connect_timeout=30),
                window=window,
                seen=none,
                missed="no connect",
                automatic_recovery=True,
            ),
            Park,
        )

    @pytest.mark.parametrize(("remaining", "window"), [(100, 5), (3, 3), (0, 0), (-20, 0)])
    def test_window(self, remaining: float, window: float) -> None:
        """One wait lasts until the deadline, at most one operation_timeout, none after it."""
        assert connect_window(remaining, operation_timeout=5) == window

    def test_connected_goes_on(self) -> None:
        """A sidecar holding a live record goes on to ready; otherwise the claim parks for it,
        fenced on the connection number it saw."""
        assert unless_connected(Readiness(connected=True, connection_seq=4)) is None
        assert unless_connected(Readiness(connected=False, connection_seq=4)) == (
            await_connection(4)
        )
        assert await_connection(4) == Park(
            mode=ParkMode.AWAIT_CONNECTION, delay=30, connection_seq=4
        )

    def test_acceptance_parks_or_readies_in_one_statement_without_a_hook(self) -> None:
        """After an accepted ensure with no on-ready hook, one park looks at the record
        itself (fenced on the row's connection number); with a hook the claim looks first."""
        accepted = row(Status.ALLOCATED)
        assert after_acceptance(accepted, has_on_ready=False, instance_ttl=20) == Park(
            mode=ParkMode.AWAIT_CONNECTION, delay=30, connection_seq=7, ready_within=20
        )
        assert after_acceptance(accepted, has_on_ready=True, instance_ttl=20) is None

    def test_missed_before_the_deadline_parks(self) -> None:
        """A window that ends before the deadline gives the slot back and parks."""
        decided = after_connect_window(
            row(Status.ALLOCATED),
            remaining=100,
            window=5,
            seen=Readiness(connected=False, connection_seq=4),
            missed="no connect within 5s",
            automatic_recovery=False,
        )
        assert decided == await_connection(4)

    def test_missed_at_the_deadline_abandons(self) -> None:
        """At the deadline the sidecar is abandoned, fenced on the connection number seen."""
        decided = after_connect_window(
            row(Status.ALLOCATED),
            remaining=-12,
            window=0,
            seen=Readiness(connected=False, connection_seq=4),
            missed=deadline_passed(-12),
            automatic_recovery=True,
        )
        assert isinstance(decided, Abandon)
        assert decided.failure == Failure(
            "sidecar_connect_failed", "the sidecar did not connect before its deadline (12s ago)"
        )
        assert decided.expected_connection_seq == 4
        assert decided.otherwise == Retry(expected=Status.ALLOCATED, delay=0)


class TestOnReady:
    @pytest.mark.parametrize(
        "error",
        [OperationTimeout("on_ready did not finish within 1s"), InitializationUncertain("half")],
    )
    def test_uncertain(self, error: Exception) -> None:
        """A hook that timed out, or says its outcome is uncertain, abandons the sidecar while
        its marker stands."""
        a = row(Status.ALLOCATED, initialization_lease_id="ls_1")
        decided = after_on_ready(error, a, automatic_recovery=True)
        assert isinstance(decided, Abandon)
        assert decided.failure == Failure("sidecar_initialization_uncertain", str(error))
        assert decided.only_if_initialization_incomplete
        assert decided.expected_initialization_lease_id == "ls_1"

    def test_clean_failure_retries(self) -> None:
        """Any other error is a clean failure: the marker is cleared and the hook retried
        after the capped delay."""
        a = row(Status.ALLOCATED, initialization_lease_id="ls_1")
        assert after_on_ready(RuntimeError("boom"), a, automatic_recovery=True) == Retry(
            expected=Status.ALLOCATED,
            delay=30,
            failure=Failure("sidecar_initialization_failed", "RuntimeError: boom"),
            clear_initialization=True,
        )


class TestEligibility:
    def test_unavailable_fails_only_pending(self) -> None:
        """A missing provisioner fails a pending allocation; any other status retries after
        its backoff, since infrastructure may exist."""
        assert provisioner_unavailable(row(Status.PENDING), "why") == FailNow(
            expected=Status.PENDING, failure=Failure("provisioner_unavailable", "why")
        )
        for status in (Status.PROVISIONING, Status.ALLOCATED, Status.REPLACING, Status.RELEASING):
            assert provisioner_unavailable(row(status, ensure_attempts=1), "why") == Retry(
                expected=status, delay=2, failure=Failure("provisioner_unavailable", "why")
            )

    def test_problem_reads_the_rows_binding(self) -> None:
        """The check compares the binding the row records with the configured provisioner."""
        configured = {"local": _Bound()}
        assert provisioner_problem(row(Status.ALLOCATED, bound=("1", "a" * 64)), configured) is None
        problem = provisioner_problem(row(Status.ALLOCATED, bound=("0", "a" * 64)), configured)
        assert problem is not None
        assert "api_version 0" in problem


@attrs.frozen
class _Bound:
    api_version: str = "1"
    binding_fingerprint: str = "a" * 64


class TestProvisionerMismatch:
    def test_matching_or_unbound_is_no_problem(self) -> None:
        """An unbound allocation, or one bound as the configured provisioner is, has no problem."""
        configured = {"local": _Bound()}
        for api, fingerprint in ((None, None), ("1", "a" * 64)):
            assert (
                provisioner_mismatch(
                    provisioner_id="local",
                    bound_api_version=api,
                    bound_fingerprint=fingerprint,
                    configured=configured,
                )
                is None
            )

    def test_missing_names_the_configured_ones(self) -> None:
        """A provisioner that is not configured is named, with the ones that are."""
        problem = provisioner_mismatch(
            provisioner_id="k8s",
            bound_api_version=None,
            bound_fingerprint=None,
            configured={"local": _Bound(), "echo": _Bound()},
        )
        assert problem is not None
        assert "provisioner k8s is not configured" in problem
        assert "configured: echo, local" in problem

    def test_binding_names_both_fingerprints(self) -> None:
        """A changed binding names the provisioner, the old and new fingerprint and a remedy."""
        problem = provisioner_mismatch(
            provisioner_id="local",
            bound_api_version="1",
            bound_fingerprint="b" * 64,
            configured={"local": _Bound()},
        )
        assert problem is not None
        assert "provisioner local binding changed" in problem
        assert "b" * 12 in problem
        assert "a" * 12 in problem
        assert "restore those options" in problem

    def test_api_version_names_both(self) -> None:
        """A changed api_version names the old and the new one."""
        problem = provisioner_mismatch(
            provisioner_id="local",
            bound_api_version="0",
            bound_fingerprint="a" * 64,
            configured={"local": _Bound()},
        )
        assert problem is not None
        assert "api_version 1" in problem
        assert "api_version 0" in problem


def test_architecture_names_every_write_and_no_other() -> None:
    """Architecture §1's table is the one statement of the transitions: every write value the
    reconciler can make is named there, and it names no write that does not exist."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    section = text.split("## §1", 1)[1].split("\n## §2", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    named = set(re.findall(r"`([A-Z][A-Za-z]+)`", table))
    writes = {name for name in writes_module.__all__ if name != "Write"}
    assert writes <= named, f"writes the table does not name: {sorted(writes - named)}"
    assert named <= writes, f"the table names what is not a write: {sorted(named - writes)}"
