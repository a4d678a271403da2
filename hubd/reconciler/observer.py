"""What the reconciler reports as it works, for metrics; the daemon supplies the implementation."""

from __future__ import annotations

from typing import Protocol

__all__ = ["NullObserver", "ReconcilerObserver"]


class ReconcilerObserver(Protocol):
    def claim_statement(self, leased: int) -> None:
        """A claim statement ran and leased ``leased`` rows (none: an idle poll)."""

    def claimed(self) -> None:
        """A claim was taken."""

    def lease_lost(self) -> None:
        """A claim stopped because its lease could no longer be trusted."""

    def transition(self, from_status: str, to_status: str) -> None:
        """An allocation changed status through this reconciler."""

    def plugin_call(self, plugin: str, operation: str, seconds: float, outcome: str) -> None:
        """A plugin call finished (``outcome`` names its kind: Accepted, Rejected, TimedOut...)."""


class NullObserver:
    def claim_statement(self, leased: int) -> None:
        pass

    def claimed(self) -> None:
        pass

    def lease_lost(self) -> None:
        pass

    def transition(self, from_status: str, to_status: str) -> None:
        pass

    def plugin_call(self, plugin: str, operation: str, seconds: float, outcome: str) -> None:
        pass
