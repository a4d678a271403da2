"""What the ``container`` provisioner's ``destroy`` removes, against a real engine (see
``tests/containerkit.py``): the container ``ensure`` recorded, by its id, whatever the
configuration became since and whatever the container's name; never a container labelled for
another sidecar; and, through the orphan sweep, exactly what was listed, counted once."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import aiodocker
import pytest

from hubd.plugins.container import ContainerProvisioner
from hubd.plugins.container.spec import create_body, external_ref
from hubd.plugins.protocol import (
    Accepted,
    Destroyed,
    DestroyRequest,
    DestroyResult,
    EnsureRequest,
    EnsureResult,
    RunningSidecar,
)
from hubd.reconciler.clock import ManualClock
from hubd.reconciler.orphans import OrphanCollector
from hubd.reconciler.writes import MarkReleased
from hubd.store import AllocationStore, Database, LedgerStore, Status
from tests import containerkit
from tests import test_container_provisioner as kit
from tests.storekit import drive_to
from tests.test_container_provisioner import destroy_request, ensure_request, provisioner

# The container tests' fixtures: the engine, the test's deployment label, its clean-up.
engine = kit.engine
deployment = kit.deployment
cleanup = kit.cleanup

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("cleanup")]

NEXT_IMAGE = "localhost/hubd-sidecar-next:1"
"""A second name for the test image: a configuration whose ``image`` changed."""


def sleeper(engine: containerkit.Engine, deployment: str, **options: Any) -> ContainerProvisioner:
    """A provisioner whose sidecars sleep; with an init, SIGTERM ends them at once."""
    values: dict[str, Any] = {"command": ["sleep", "300"], "init": True, **options}
    return provisioner(engine, deployment, **values)


async def inspect(engine: containerkit.Engine, handle: str) -> dict[str, Any] | None:
    async with aiodocker.Docker(url=engine.socket) as docker:
        try:
            found: dict[str, Any] = await docker.containers.container(handle).show()
        except aiodocker.DockerError as exc:
            if containerkit.gone(exc):
                return None
            raise
        return found


async def run_under(made: ContainerProvisioner, request: EnsureRequest, name: str) -> str:
    """A running container labelled for ``request``'s sidecar, as ``made`` would create it,
    but under ``name``: the id."""
    async with aiodocker.Docker(url=made.options.socket.url) as docker:
        body = create_body(made.options, made.id, request)
        container = await docker.containers.create(body, name=name)
        await container.start()
        return str(container.id)


async def accepted(made: ContainerProvisioner, request: EnsureRequest) -> Accepted:
    result: EnsureResult = await made.ensure(request)
    assert isinstance(result, Accepted), result
    return result


class TestDestroy:
    async def test_old_sidecar_destroyed_after_the_image_and_command_changed(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A sidecar made under one image and command is destroyed by a provisioner configured
        with another (a rolling upgrade): its container is gone, a repeated destroy answers
        Destroyed having removed nothing, and a new ensure runs the new image and command."""
        async with aiodocker.Docker(url=engine.socket) as docker:
            await docker.images.tag(containerkit.IMAGE, "localhost/hubd-sidecar-next", tag="1")
        old = sleeper(engine, deployment)
        request = ensure_request()
        before = await accepted(old, request)
        assert before.external_ref is not None
        (container,) = await containerkit.containers(engine, deployment)

        upgraded = sleeper(engine, deployment, image=NEXT_IMAGE, command=["sleep", "301"])
        gone = destroy_request(request, before.external_ref)
        assert await upgraded.destroy(gone) == Destroyed(removed=True)
        assert await inspect(engine, container["Id"]) is None
        assert await upgraded.destroy(gone) == Destroyed(removed=False)

        replacement = ensure_request(allocation_id=request.allocation_id, generation=2)
        await accepted(upgraded, replacement)
        (running,) = await containerkit.containers(engine, deployment)
        assert running["Config"]["Image"] == NEXT_IMAGE
        assert running["Config"]["Cmd"] == ["sleep", "301"]
        assert running["Config"]["Labels"]["io.hubd.sidecar-id"] == replacement.sidecar_id
        # The old generation's destroy, repeated now, leaves the new generation's container.
        assert await upgraded.destroy(gone) == Destroyed(removed=False)
        assert await inspect(engine, running["Id"]) is not None

    async def test_by_the_recorded_id_whatever_the_name_never_another_sidecars(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """The recorded id finds the sidecar's container under any name (the name alone does
        not); a recorded id naming a container labelled for another sidecar is left alone, and
        the sidecar's own container, found by name, is removed."""
        made = sleeper(engine, deployment)
        elsewhere = ensure_request()
        elsewhere_id = await run_under(made, elsewhere, f"elsewhere-{uuid.uuid4().hex[:8]}")
        ref = external_ref(elsewhere_id)
        assert await made.destroy(destroy_request(elsewhere, None)) == Destroyed(removed=False)
        assert await inspect(engine, elsewhere_id) is not None

        other = ensure_request()
        other_ref = (await accepted(made, other)).external_ref
        # Another sidecar's destroy, handed this container's reference by mistake.
        assert await made.destroy(destroy_request(other, ref)) == Destroyed(removed=True)
        assert await inspect(engine, elsewhere_id) is not None
        assert await made.destroy(destroy_request(other, other_ref)) == Destroyed(removed=False)
        # Another allocation's destroy of the same sidecar id: labels name this allocation.
        misdirected = DestroyRequest(
            allocation_id=f"al_{uuid.uuid4().hex}",
            generation=2,
            sidecar_id=elsewhere.sidecar_id,
            external_ref=ref,
        )
        assert await made.destroy(misdirected) == Destroyed(removed=False)
        assert await inspect(engine, elsewhere_id) is not None

        assert await made.destroy(destroy_request(elsewhere, ref)) == Destroyed(removed=True)
        assert await containerkit.containers(engine, deployment) == []


class Listed:
    """A container provisioner whose listing was taken earlier: what a sweep sees when the
    container is removed (by another replica, an operator) between its list and its destroy."""

    def __init__(self, inner: ContainerProvisioner, listing: Sequence[RunningSidecar]) -> None:
        self.id = inner.id
        self.api_version = inner.api_version
        self.binding_fingerprint = inner.binding_fingerprint
        self._inner = inner
        self._listing = list(listing)

    async def ensure(self, request: EnsureRequest) -> EnsureResult:
        return await self._inner.ensure(request)

    async def destroy(self, request: DestroyRequest) -> DestroyResult:
        return await self._inner.destroy(request)

    async def list_sidecars(self) -> Sequence[RunningSidecar]:
        return self._listing


class TestOrphanSweep:
    async def released_sidecar(self, store: AllocationStore, db: Database) -> EnsureRequest:
        """The request of a sidecar whose allocation was released: an orphan, once listed."""
        fence = await drive_to(store, db, Status.RELEASING)
        row = await store.get(fence.allocation_id)
        assert row.sidecar_id is not None
        assert await store.write(fence, MarkReleased().transition()) is not None
        return ensure_request(row.sidecar_id, allocation_id=row.id, generation=row.generation)

    async def test_orphan_under_another_name_removed_for_good_counted_once(
        self,
        engine: containerkit.Engine,
        deployment: str,
        store: AllocationStore,
        ledger: LedgerStore,
        db: Database,
    ) -> None:
        """A container with hubd's labels under a name hubd would not give it is removed by
        the one sweep that destroys it (by the id listed), and counted, metered and recorded
        once: the sweeps after list nothing."""
        made = sleeper(engine, deployment)
        request = await self.released_sidecar(store, db)
        stray = await run_under(made, request, f"stray-{uuid.uuid4().hex[:8]}")
        clock = ManualClock()
        outcomes: list[str] = []
        sweeper = OrphanCollector(
            store=store,
            ledger=ledger,
            grace=60.0,
            clock=clock,
            on_orphan=lambda _provisioner, outcome: outcomes.append(outcome),
        )
        first = await sweeper.sweep(made)
        assert (first.listed, first.orphans, first.destroyed) == (1, 1, 0)
        clock.advance(61)
        second = await sweeper.sweep(made)
        assert (second.destroyed, second.gone, second.failed) == (1, 0, 0)
        assert await inspect(engine, stray) is None
        for _ in range(2):
            clock.advance(61)
            later = await sweeper.sweep(made)
            assert (later.listed, later.destroyed) == (0, 0)
        assert outcomes == ["destroyed"]
        history = await ledger.history(request.allocation_id)
        assert [e.kind for e in history].count("orphan_destroyed") == 1

    async def test_orphan_already_gone_is_not_counted(
        self,
        engine: containerkit.Engine,
        deployment: str,
        store: AllocationStore,
        ledger: LedgerStore,
        db: Database,
    ) -> None:
        """An orphan listed, then removed by someone else before the sweep's destroy: the
        destroy answers Destroyed having removed nothing, and the sweep neither counts, meters
        nor records a destruction."""
        made = sleeper(engine, deployment)
        request = await self.released_sidecar(store, db)
        await accepted(made, request)
        listing = await made.list_sidecars()
        assert [s.sidecar_id for s in listing] == [request.sidecar_id]
        await containerkit.remove_all(engine, deployment)
        outcomes: list[str] = []
        sweeper = OrphanCollector(
            store=store,
            ledger=ledger,
            grace=0.0,
            clock=ManualClock(),
            on_orphan=lambda _provisioner, outcome: outcomes.append(outcome),
        )
        swept = await sweeper.sweep(Listed(made, listing))
        assert (swept.orphans, swept.destroyed, swept.gone, swept.failed) == (1, 0, 1, 0)
        assert outcomes == []
        history = await ledger.history(request.allocation_id)
        assert "orphan_destroyed" not in [e.kind for e in history]
