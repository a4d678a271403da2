"""The reconciler's decisions as plain functions: no loop, no database."""

from __future__ import annotations

import attrs
import pytest

from hubd.plugins.protocol import Accepted, Destroyed, DestroyRejected, Rejected
from hubd.reconciler.decisions import (
    DestroyFailed,
    Fail,
    MarkAllocated,
    Proceed,
    Raised,
    Replace,
    RetryDestroy,
    Step,
    TimedOut,
    after_destroy,
    after_ensure,
    effect_phase,
    provisioner_mismatch,
    replacement_becomes_release,
    retry_delay,
    step_for,
    unavailable_provisioner,
)
from hubd.store import Phase, Status


class TestBackoff:
    @pytest.mark.parametrize(
        ("attempt", "seconds"),
        [(0, 1), (1, 2), (2, 4), (3, 8), (4, 16), (5, 30), (6, 30), (100, 30), (-3, 1)],
    )
    def test_formula(self, attempt: int, seconds: float) -> None:
        """The delay is min(1 s * 2^min(attempt, 5), 30 s)."""
        assert retry_delay(attempt) == seconds


class TestEnsure:
    def test_accepted(self) -> None:
        """An accepted ensure marks the allocation allocated with its external reference."""
        assert after_ensure(Accepted("pod-1")) == MarkAllocated("pod-1")

    def test_rejections(self) -> None:
        """A retryable rejection replaces, a permanent one fails; both keep the plugin's code."""
        retry = after_ensure(Rejected(code="quota", message="full", retryable=True))
        assert isinstance(retry, Replace)
        assert retry.failure.code == "quota"
        permanent = after_ensure(Rejected(code="Bad Spec!", message="no", retryable=False))
        assert isinstance(permanent, Fail)
        assert permanent.failure.code == "bad_spec"

    def test_raised_and_timed_out_replace(self) -> None:
        """A raising or timed-out ensure replaces with ensure_failed."""
        for outcome in (Raised("boom"), TimedOut()):
            decision = after_ensure(outcome)
            assert isinstance(decision, Replace)
            assert decision.failure.code == "ensure_failed"

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
    def test_ledger_phase(self, outcome: object, phase: Phase) -> None:
        """Only a timeout leaves the outcome unknown (ambiguous)."""
        assert effect_phase(outcome) == phase  # type: ignore[arg-type]


class TestDestroy:
    def test_outcomes(self) -> None:
        """Destroyed proceeds; retryable rejection, raising and timeout retry; a permanent
        rejection is destroy_failed."""
        assert after_destroy(Destroyed()) == Proceed()
        assert isinstance(
            after_destroy(DestroyRejected(code="busy", message="m", retryable=True)), RetryDestroy
        )
        assert isinstance(after_destroy(Raised("x")), RetryDestroy)
        assert isinstance(after_destroy(TimedOut()), RetryDestroy)
        assert isinstance(
            after_destroy(DestroyRejected(code="gone", message="m", retryable=False)),
            DestroyFailed,
        )


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

    def test_unavailable_provisioner(self) -> None:
        """A missing provisioner fails only a pending allocation."""
        failed = unavailable_provisioner(Status.PENDING, "why")
        assert failed is not None
        assert failed.failure.code == "provisioner_unavailable"
        assert failed.failure.message == "why"
        for status in (Status.PROVISIONING, Status.ALLOCATED, Status.REPLACING, Status.RELEASING):
            assert unavailable_provisioner(status, "why") is None


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

    def test_recovery_switch(self) -> None:
        """Only an allocated sidecar becomes a release when automatic recovery is off."""
        assert replacement_becomes_release(Status.ALLOCATED, automatic_recovery=False)
        assert not replacement_becomes_release(Status.ALLOCATED, automatic_recovery=True)
        assert not replacement_becomes_release(Status.PROVISIONING, automatic_recovery=False)
