"""Whether a configured provisioner may serve an allocation: a pure rule, no loop, no database.

An allocation records the provisioner's ``api_version`` and ``binding_fingerprint`` at its first
bind; a daemon whose provisioner of that id is missing, or speaks another version, or keeps its
sidecars elsewhere, must not touch it. A fingerprint the provisioner lists among its
``former_binding_fingerprints`` (an earlier release's digest of the same place) still matches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from hubd.plugins.protocol import former_fingerprints
from hubd.reconciler.decisions import backoff
from hubd.reconciler.writes import FailNow, Retry
from hubd.store.inputs import Failure
from hubd.store.rows import Allocation, Status

__all__ = ["provisioner_mismatch", "provisioner_problem", "provisioner_unavailable"]


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
    if bound_fingerprint not in (
        None,
        provisioner.binding_fingerprint,
        *former_fingerprints(provisioner),
    ):
        assert bound_fingerprint is not None
        return (
            f"provisioner {provisioner_id} binding changed: this allocation was bound to "
            f"fingerprint {bound_fingerprint[:12]}, the configured one is "
            f"{provisioner.binding_fingerprint[:12]} (the options that say where its sidecars "
            "live differ: a container provisioner's deployment, a local one's command, env or "
            "workdir; e.g. hubd dev and hubd run on one database); serve it from a daemon "
            "configured as when it was bound, or restore those options"
        )
    return None


def provisioner_problem(allocation: Allocation, configured: Mapping[str, _Bindable]) -> str | None:
    """:func:`provisioner_mismatch` for the binding ``allocation`` records."""
    return provisioner_mismatch(
        provisioner_id=allocation.provisioner_id,
        bound_api_version=allocation.provisioner_api_version,
        bound_fingerprint=allocation.provisioner_binding_fingerprint,
        configured=configured,
    )


def provisioner_unavailable(allocation: Allocation, problem: str) -> FailNow | Retry:
    """A missing or re-bound provisioner fails a pending allocation (nothing was provisioned);
    any other status retries after the backoff, since infrastructure may exist."""
    failure = Failure("provisioner_unavailable", problem)
    if allocation.status is Status.PENDING:
        return FailNow(expected=Status.PENDING, failure=failure)
    return Retry(expected=allocation.status, delay=backoff(allocation), failure=failure)
