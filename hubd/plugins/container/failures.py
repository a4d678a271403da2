"""What ``ensure`` answers when a sidecar's container cannot run: retryable when a new container
may do better (it exited: hubd destroys it and makes another), not retryable when every retry
would meet the same answer (the engine ignored the ``runtime``, refused the request, or said the
container cannot run as configured), and then with nothing left on the engine.

What the engines say for a container that cannot run as configured (busybox image), and when:

======================  ==================================  ====================================
misconfiguration        dockerd 20.10                       Podman 4.3 (compatible API)
======================  ==================================  ====================================
``command``             start: 400 ``exec: "/nonexistent":  start: 500, the same runc words and
not there               stat /nonexistent: no such file or  ``OCI runtime attempted to invoke a
                        directory``                         command that was not found``
``user`` unknown        start: 500 ``unable to find user    start: 500, the same
                        nosuchuser: no matching entries in
                        passwd file``
``network`` unknown     start: 404 ``network nosuchnet not  create: 500 ``unable to find network
                        found``                             with name or ID nosuchnet: network
                                                            not found``
``runtime`` unknown     create: 400 ``Unknown runtime       ignored (see :func:`runtime_refused`)
                        specified nosuchruntime``
======================  ==================================  ====================================

A start that fails leaves the container created (dockerd records the exit code 127 or 128 on
it): it is removed before the answer, or every retry would adopt it and fail again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hubd.plugins.container.engine import EngineFailed, EngineSession
from hubd.plugins.container.spec import Kinship, container_name, kinship
from hubd.plugins.protocol import EnsureRequest, Rejected

__all__ = ["discard", "exited", "misconfigured", "not_owned", "runtime_refused"]


def not_owned(what: str) -> str:
    return f"the claim no longer owns the allocation; {what}"


def misconfigured(exc: EngineFailed) -> Rejected | None:
    """The non-retryable answer to an engine error no retry can change: ``sidecar_misconfigured``
    when the engine says the container cannot run as configured, ``engine_rejected`` for any
    other 400 (a request the engine refuses as such, e.g. dockerd's unknown runtime); ``None``
    for an error a retry may not meet (the daemon caps those)."""
    if exc.misconfigured:
        return Rejected(
            code="sidecar_misconfigured",
            message=f"the container engine cannot run the sidecar as configured ({exc.status}): "
            f"{exc.message}; check the provisioner's command, entrypoint, user, network and "
            "workdir",
            retryable=False,
        )
    if exc.status == 400:
        return Rejected(
            code="engine_rejected",
            message=f"the container engine refused the sidecar's container (400): {exc.message}",
            retryable=False,
        )
    return None


async def discard(engine: EngineSession, deployment: str, request: EnsureRequest) -> None:
    """Remove the container an ensure that failed for good left, if the engine kept one (a
    failed start leaves it created): by the full id inspected, only when it is this sidecar's.
    Whatever the claim says: it was never started, and no one else may use it."""
    found = await engine.inspect(container_name(request.sidecar_id))
    labels = None if found is None else (found.get("Config") or {}).get("Labels")
    if found is not None and kinship(labels, deployment, request) is Kinship.OURS:
        await engine.remove(str(found["Id"]))


async def runtime_refused(
    engine: EngineSession, request: EnsureRequest, name: str, runtime: str
) -> Rejected | None:
    """A rejection when the engine did not take the ``runtime`` option, before anything runs:
    Podman's Docker-compatible API ignores a container's runtime (and reports ``oci``), and a
    sidecar meant for a sandboxing runtime must not start under the default one instead. Not
    retryable (the container is removed first): every retry would meet the same engine."""
    found = await engine.inspect(name)
    if found is None:
        return None  # removed meanwhile: the start says so
    reported = (found.get("HostConfig") or {}).get("Runtime")
    if reported == runtime:
        return None
    if not request.ownership.still_owned():
        return Rejected(code="claim_lost", message=not_owned("nothing was removed"),
                        retryable=True)  # fmt: skip
    await engine.remove(str(found["Id"]))
    return Rejected(
        code="runtime_unsupported",
        message=f"the container engine at {engine.socket.display} made container {name} with "
        f"runtime {reported!r}, not {runtime!r}, and it was removed; Podman's Docker-compatible "
        "API ignores a container's runtime: make it the service's default (containers.conf) "
        "and leave the option unset",
        retryable=False,
    )


async def exited(engine: EngineSession, name: str, found: Mapping[str, Any]) -> Rejected:
    """A container of this sidecar that is not running: the sidecar failed. Retryable: hubd
    destroys it (the container stays until then, logs and all) and replaces it."""
    state = found.get("State") or {}
    tail = await engine.logs_tail(name)
    return Rejected(
        code="sidecar_exited",
        message=(
            f"container {name} is {state.get('Status', 'not running')} "
            f"(exit code {state.get('ExitCode', '?')})" + (f": {tail}" if tail else " (no output)")
        ),
        retryable=True,
    )
