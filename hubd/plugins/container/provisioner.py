"""The ``container`` provisioner itself: create, find again and remove sidecar containers."""

from __future__ import annotations

import asyncio
import contextlib
import socket as socketlib
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import structlog

from hubd.aio import KeyedFifo
from hubd.plugins.container.engine import (
    EngineFailed,
    EngineSession,
    EngineTimeout,
    EngineUnavailable,
    open_session,
)
from hubd.plugins.container.failures import (
    discard,
    exited,
    misconfigured,
    not_owned,
    runtime_refused,
)
from hubd.plugins.container.options import ContainerOptions, check_options, parse_options
from hubd.plugins.container.output import container_output, find_container
from hubd.plugins.container.probe import probe_engine
from hubd.plugins.container.removal import ClaimLost, remove_sidecar
from hubd.plugins.container.spec import (
    LABEL_DEPLOYMENT,
    SIDECAR_ID,
    Kinship,
    container_name,
    create_body,
    endpoint_of,
    external_ref,
    kinship,
    running_sidecar,
)
from hubd.plugins.container.watch import Recent, watch_exits
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRejected,
    DestroyRequest,
    DestroyResult,
    EnsureRequest,
    EnsureResult,
    Ownership,
    Rejected,
    RunningSidecar,
    SidecarExit,
    checks_options,
)

__all__ = ["API_VERSION", "SETTLE", "ContainerProvisioner", "create"]

log = structlog.get_logger(__name__)

API_VERSION: Final = "1"
SETTLE: Final = 0.2
"""How long ``ensure`` watches a started container: an exit within it is a failed start,
answered with the tail of its logs."""
_RUNNING: Final = frozenset({"running", "restarting"})
_NOT_STARTED: Final = frozenset({"created", "configured"})  # "configured": Podman's word
LATE_CREATE_WINDOW: Final = 1.0
"""How long an ensure cancelled during its create waits for that create to land at the engine,
to remove it."""
_DESTROYED_KEPT: Final = 1024
"""How many sidecar ids ``destroy`` was called for are remembered, so that ``watch_sidecars``
spends no inspect and no logs call on the deaths hubd caused itself."""


@checks_options(check_options)
def create(*, id: str, options: Mapping[str, Any], state_dir: Path) -> ContainerProvisioner:
    """The plugin factory (see :mod:`hubd.plugins.registry`). Keeps nothing under
    ``state_dir``: the engine's labels are the provisioner's whole state."""
    del state_dir
    parsed = parse_options(options, provisioner_id=id)
    log.info(
        "container_engine_socket",
        provisioner=id,
        socket=parsed.socket.display,
        found_by=parsed.socket.found_by,
        image=parsed.image,
    )
    return ContainerProvisioner(id=id, options=parsed)


class ContainerProvisioner:
    """Runs each sidecar as a container named after its sidecar id; see :mod:`hubd.plugins.
    container` for the guarantees."""

    def __init__(self, *, id: str, options: ContainerOptions, settle: float = SETTLE) -> None:
        self.id = id
        self.api_version = API_VERSION
        self.binding_fingerprint = options.binding_fingerprint
        self.former_binding_fingerprints = options.former_binding_fingerprints
        self.options = options
        self._settle = settle
        self._host = socketlib.gethostname()
        # One call at a time per sidecar in this process; across processes the engine's
        # unique names are the arbiter.
        self._turns = KeyedFifo()
        self._destroyed = Recent(_DESTROYED_KEPT)

    def __repr__(self) -> str:
        return (
            f"<ContainerProvisioner id={self.id!r} socket={self.options.socket.display!r} "
            f"image={self.options.image!r}>"
        )

    def _session(
        self, ownership: Ownership, secret: str | None = None
    ) -> contextlib.AbstractAsyncContextManager[EngineSession]:
        return open_session(
            self.options.socket,
            api_timeout=self.options.api_timeout,
            ownership=ownership,
            secret=secret,
        )

    async def probe(self) -> str:
        """``hubd check-config --probe``: the engine answers, and what it has (the image, the
        network, the runtime) is what the options need; nothing is created."""
        return await probe_engine(self.options)

    # -- ensure ----------------------------------------------------------------------------------

    async def ensure(self, request: EnsureRequest) -> EnsureResult:
        """Create and start the sidecar's container, or adopt the one already there."""
        if not SIDECAR_ID.fullmatch(request.sidecar_id):
            return Rejected(
                code="invalid_sidecar_id",
                message="sidecar id is not usable as a container name",
                retryable=False,
            )
        async with self._turns.hold(request.sidecar_id):
            try:
                async with self._session(request.ownership, request.token) as engine:
                    try:
                        return await self._ensure(engine, request)
                    except EngineFailed as exc:
                        refused = misconfigured(exc)
                        if refused is None:
                            raise
                        # A failure to remove is answered as such (retryable): the retry
                        # adopts the container, fails alike, and removes it.
                        await discard(engine, self.options.deployment, request)
                        log.warning("sidecar_misconfigured", provisioner=self.id,
                                    code=refused.code, message=refused.message)  # fmt: skip
                        return refused
            except EngineUnavailable as exc:
                return Rejected(code="engine_unavailable", message=str(exc), retryable=True)
            except EngineTimeout as exc:
                return Rejected(code="engine_timeout", message=str(exc), retryable=True)
            except EngineFailed as exc:
                return Rejected(
                    code="engine_error",
                    message=f"container engine answered {exc.status}: {exc.message}",
                    retryable=True,
                )

    async def _ensure(self, engine: EngineSession, request: EnsureRequest) -> EnsureResult:
        name = container_name(request.sidecar_id)
        found = await engine.inspect(name)
        if found is not None:
            adopted = await self._adopt(engine, request, found)
            if adopted is not None:
                return adopted
        if not request.ownership.still_owned():
            return Rejected(code="claim_lost", message=not_owned("nothing was created"),
                            retryable=True)  # fmt: skip
        body = create_body(self.options, self.id, request)
        try:
            created = await self._create(engine, body, name)
        except asyncio.CancelledError:
            # The create may be on its way to the engine, which finishes it whatever becomes
            # of this call: the destroy hubd runs next could come first and miss it. Remove
            # what it leaves, for a moment, before the cancellation goes on (the orphan sweep
            # stays the backstop).
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._remove_late_create(engine, name))
            raise
        except EngineFailed as exc:
            if not exc.conflict:
                raise
            # Another process (a replica that took the claim over, this one before a
            # restart) created it between our inspect and our create: adopt that one.
            found = await engine.inspect(name)
            adopted = None if found is None else await self._adopt(engine, request, found)
            if adopted is None:
                raise
            return adopted
        except _ImageMissing as exc:
            return Rejected(code="image_not_found", message=str(exc), retryable=False)
        # Recorded in the engine from here on (by name and labels): a cancellation now
        # leaves a container that the destroy hubd runs next will find.
        if not request.ownership.still_owned():
            with contextlib.suppress(EngineFailed, EngineUnavailable, EngineTimeout):
                await engine.remove(created)
            return Rejected(code="claim_lost", message=not_owned("the container was removed"),
                            retryable=True)  # fmt: skip
        return await self._start(engine, request, name)

    async def _remove_late_create(self, engine: EngineSession, name: str) -> None:
        """Remove the container ``name`` if a create interrupted on its way lands within
        LATE_CREATE_WINDOW seconds."""
        loop = asyncio.get_running_loop()
        until = loop.time() + LATE_CREATE_WINDOW
        with contextlib.suppress(EngineFailed, EngineUnavailable, EngineTimeout):
            while True:
                landed = await engine.inspect(name)
                if landed is not None:
                    await engine.remove(str(landed["Id"]))
                    return
                if loop.time() >= until:
                    return
                await asyncio.sleep(0.1)

    async def _create(self, engine: EngineSession, body: Mapping[str, Any], name: str) -> str:
        """The new container's id."""
        try:
            return await engine.create(body, name)
        except EngineFailed as exc:
            if not exc.image_missing:
                raise
            if self.options.pull == "never":
                raise _ImageMissing(
                    f"image {self.options.image!r} is not on the engine at "
                    f'{self.options.socket.display} and pull = "never"'
                ) from None
            try:
                await engine.pull(self.options.image)
            except EngineFailed as pulled:
                raise _ImageMissing(
                    f"image {self.options.image!r} is not on the engine at "
                    f"{self.options.socket.display} and could not be pulled: {pulled.message}"
                ) from None
            return await engine.create(body, name)

    async def _adopt(
        self, engine: EngineSession, request: EnsureRequest, found: Mapping[str, Any]
    ) -> EnsureResult | None:
        """What to answer for a container already under the sidecar's name; ``None`` when it
        was removed (stale) and a new one is to be created."""
        name = container_name(request.sidecar_id)
        labels = (found.get("Config") or {}).get("Labels")
        match kinship(labels, self.options.deployment, request):
            case Kinship.FOREIGN:
                # A new sidecar id gets a new name, so the replacement does not meet it.
                return Rejected(
                    code="name_conflict",
                    message=f"a container named {name} exists that this provisioner did not "
                    f"create (its {LABEL_DEPLOYMENT} label is not {self.options.deployment!r})",
                    retryable=True,
                )
            case Kinship.STALE:
                if not request.ownership.still_owned():
                    return Rejected(code="claim_lost", message=not_owned("nothing was removed"),
                                    retryable=True)  # fmt: skip
                log.warning("stale_container_replaced", provisioner=self.id, container=name)
                # By the id inspected: whatever took the name since is not what was judged.
                await engine.remove(str(found["Id"]))
                return None
            case Kinship.OURS:
                pass
        status = str((found.get("State") or {}).get("Status", ""))
        if status in _RUNNING:
            log.info("sidecar_container_adopted", provisioner=self.id, container=name)
            return self._accepted(found)
        if status in _NOT_STARTED:
            # An ensure that was interrupted between create and start.
            if not request.ownership.still_owned():
                return Rejected(code="claim_lost", message=not_owned("nothing was started"),
                                retryable=True)  # fmt: skip
            return await self._start(engine, request, name)
        return await exited(engine, name, found)

    async def _start(
        self, engine: EngineSession, request: EnsureRequest, name: str
    ) -> EnsureResult:
        if self.options.runtime is not None:
            refused = await runtime_refused(engine, request, name, self.options.runtime)
            if refused is not None:
                return refused
        await engine.start(name)
        if self._settle > 0:
            await asyncio.sleep(self._settle)
        found = await engine.inspect(name)
        if found is None:
            return Rejected(
                code="sidecar_exited",
                message=f"container {name} was removed right after it started",
                retryable=True,
            )
        if str((found.get("State") or {}).get("Status", "")) not in _RUNNING:
            return await exited(engine, name, found)
        log.info(
            "sidecar_container_started",
            provisioner=self.id,
            container=name,
            allocation_id=request.allocation_id,
            generation=request.generation,
        )
        return self._accepted(found)

    def _accepted(self, found: Mapping[str, Any]) -> Accepted:
        container_id = str(found.get("Id", ""))
        return Accepted(
            external_ref(container_id),
            endpoint=endpoint_of(self.options, found),
            metadata={
                "container": str(found.get("Name", "")).lstrip("/"),
                "id": container_id[:12],
                "image": self.options.image,
                "engine": self.options.socket.display,
                "host": self._host,
            },
        )

    # -- destroy ---------------------------------------------------------------------------------

    async def destroy(self, request: DestroyRequest) -> DestroyResult:
        """Stop (SIGTERM, SIGKILL after ``stop_timeout``) and remove the sidecar's containers,
        found by the recorded id and by name (:mod:`~hubd.plugins.container.removal`);
        ``Destroyed`` when there is none (anymore), ``removed`` saying whether this call
        removed one."""
        if not SIDECAR_ID.fullmatch(request.sidecar_id):
            return Destroyed(removed=False)  # no container can carry that name
        # Before the stop: the watch may see the death before this call returns.
        self._destroyed.add(request.sidecar_id)
        async with self._turns.hold(request.sidecar_id):
            try:
                async with self._session(request.ownership) as engine:
                    removed, foreign = await remove_sidecar(
                        engine,
                        request,
                        deployment=self.options.deployment,
                        stop_timeout=self.options.stop_timeout,
                    )
            except ClaimLost:
                self._destroyed.discard(request.sidecar_id)  # left running: still watched
                return DestroyRejected(code="claim_lost", message=not_owned("nothing was stopped"),
                                       retryable=True)  # fmt: skip
            except (EngineUnavailable, EngineTimeout) as exc:
                return DestroyRejected(code="engine_unavailable", message=str(exc),
                                       retryable=True)  # fmt: skip
            except EngineFailed as exc:
                return DestroyRejected(
                    code="engine_error",
                    message=f"container engine answered {exc.status}: {exc.message}",
                    retryable=True,
                )
        if foreign:
            log.warning("foreign_container_left_alone", provisioner=self.id, containers=foreign,
                        sidecar_id=request.sidecar_id)  # fmt: skip
        if removed:
            log.info("sidecar_container_removed", provisioner=self.id, containers=removed)
        return Destroyed(removed=bool(removed))

    # -- inventory -------------------------------------------------------------------------------

    async def list_sidecars(self) -> Sequence[RunningSidecar]:
        """Every container labelled with this deployment, running or not (an exited one is
        still something to remove)."""
        async with self._session(Ownership.unbounded()) as engine:
            listed = await engine.list_labelled(LABEL_DEPLOYMENT, self.options.deployment)
        found = (running_sidecar(container) for container in listed)
        return [sidecar for sidecar in found if sidecar is not None]

    async def watch_sidecars(self) -> AsyncIterator[SidecarExit | None]:
        """``None`` once the engine's events are followed, then the sidecars whose containers
        are dead now, then each one whose container dies or is removed, from the engine's
        events (:mod:`~hubd.plugins.container.watch`), but those ``destroy`` was called for.
        Raises the engine's errors, each with its ``code``."""
        async with (
            self._session(Ownership.unbounded()) as engine,
            contextlib.aclosing(
                watch_exits(engine, self.options.deployment, skip=self._destroyed.__contains__)
            ) as exits,
        ):
            async for report in exits:
                yield report

    async def sidecar_output(
        self, sidecar_id: str, external_ref: str | None, *, tail: int | None, follow: bool
    ) -> AsyncIterator[str]:
        """What the sidecar's container wrote (:mod:`~hubd.plugins.container.output`);
        :class:`LookupError` when the engine has no container of this sidecar."""
        async with self._session(Ownership.unbounded()) as engine:
            found = None
            if SIDECAR_ID.fullmatch(sidecar_id):
                found = await find_container(
                    engine, self.options.deployment, sidecar_id, external_ref
                )
            if found is None:
                raise LookupError(f"the engine has no container of sidecar {sidecar_id}")
            written = container_output(
                engine, found, tail=tail, follow=follow, read_timeout=self.options.api_timeout
            )
            async with contextlib.aclosing(written) as chunks:
                async for chunk in chunks:
                    yield chunk


class _ImageMissing(Exception):
    pass
