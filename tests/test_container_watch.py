"""The ``container`` provisioner's optional capabilities against each real engine (see
``tests/containerkit.py``): ``watch_sidecars`` reports the sidecars whose containers die or are
removed, from the engine's events, and those dead before it began; ``sidecar_output`` reads a
container's output. Every test that takes the ``engine`` fixture runs once per engine."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import pytest

from hubd.plugins.container import ContainerProvisioner, create
from hubd.plugins.container.engine import EngineFailed, EngineTimeout, EngineUnavailable
from hubd.plugins.container.spec import container_name, create_body
from hubd.plugins.container.watch import exit_reason, sidecar_of
from hubd.plugins.protocol import (
    Accepted,
    EnsureRequest,
    SidecarExit,
    SidecarOutput,
    WatchesSidecars,
)
from tests import containerkit
from tests import test_container_provisioner as kit
from tests.reconcilerkit import poll_until
from tests.test_container_provisioner import destroy_request, ensure_request, provisioner

# The container tests' fixtures: the engine, the test's deployment label, its clean-up.
engine = kit.engine
deployment = kit.deployment
cleanup = kit.cleanup
only_on = kit.only_on

pytestmark = pytest.mark.timeout(180)

# Waits for SIGTERM, then says so on stderr and exits 3; the token it was given goes to stdout
# first, to show that no report carries it.
EXITS_ON_TERM = [
    "sh", "-c",
    'echo "token $HUBD_TOKEN"; trap "echo boom >&2; exit 3" TERM; '
    "while :; do sleep 0.1; done",
]  # fmt: skip
SLEEPS = ["sleep", "300"]


async def started(made: ContainerProvisioner, request: EnsureRequest | None = None) -> str:
    """The id of the running container of a new sidecar (``request``'s)."""
    request = request or ensure_request()
    result = await made.ensure(request)
    assert isinstance(result, Accepted), result
    async with aiodocker.Docker(url=made.options.socket.url) as docker:
        found = await docker.containers.container(container_name(request.sidecar_id)).show()
    return str(found["Id"])


async def kill(engine: containerkit.Engine, container_id: str, signal: str) -> None:
    async with aiodocker.Docker(url=engine.socket) as docker:
        await docker.containers.container(container_id).kill(signal=signal)


async def remove(engine: containerkit.Engine, container_id: str) -> None:
    async with aiodocker.Docker(url=engine.socket) as docker:
        await docker.containers.container(container_id).delete(force=True)


async def state(engine: containerkit.Engine, container_id: str) -> str:
    async with aiodocker.Docker(url=engine.socket) as docker:
        found = await docker.containers.container(container_id).show()
        return str(found["State"]["Status"])


class Watching:
    """A running ``watch_sidecars``, its reports queued as they come."""

    def __init__(self, made: ContainerProvisioner) -> None:
        self.reports: asyncio.Queue[SidecarExit] = asyncio.Queue()
        self.following = asyncio.Event()
        self.signs: list[int] = []
        """How many reports had come when each ``None`` (following) came."""
        self.task = asyncio.create_task(self._run(made), name="watch_sidecars")

    async def _run(self, made: ContainerProvisioner) -> None:
        count = 0
        async for report in made.watch_sidecars():
            if report is None:
                self.signs.append(count)
                self.following.set()
                continue
            count += 1
            self.reports.put_nowait(report)

    async def next(self, within: float = 60) -> SidecarExit:
        """The next report; the watch's own error if it ends first."""
        waiting = asyncio.ensure_future(self.reports.get())
        try:
            done, _ = await asyncio.wait(
                {waiting, self.task}, timeout=within, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiting.cancel()
        if waiting in done:
            return waiting.result()
        if self.task in done:
            self.task.result()
            raise AssertionError("the watch ended without an error")
        raise AssertionError(f"no report within {within}s")

    async def close(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def watching(
    engine: containerkit.Engine, deployment: str
) -> AsyncIterator[tuple[ContainerProvisioner, Watching]]:
    """A provisioner on the test's engine and deployment, watched from the start; on exit the
    watch is cancelled and the deployment's containers removed."""
    made = provisioner(engine, deployment, command=EXITS_ON_TERM)
    watch = Watching(made)
    try:
        yield made, watch
    finally:
        await watch.close()
        await containerkit.remove_all(engine, deployment)


class TestWatch:
    def test_the_provisioner_has_both_capabilities(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        made = provisioner(engine, deployment)
        assert isinstance(made, WatchesSidecars)
        assert isinstance(made, SidecarOutput)

    async def test_exit_reported_with_its_code_and_output(
        self, watching: tuple[ContainerProvisioner, Watching], engine: containerkit.Engine
    ) -> None:
        """A sidecar whose process exits (code 3, after writing to stderr) is reported with
        its sidecar id, allocation and generation, its exit code and its output's tail, the
        token it printed hidden; reason ``exited``."""
        made, watch = watching
        request = ensure_request(generation=4)
        container_id = await started(made, request)
        await kill(engine, container_id, "SIGTERM")
        report = await watch.next()
        assert (report.sidecar_id, report.allocation_id, report.generation) == (
            request.sidecar_id,
            request.allocation_id,
            4,
        )
        assert (report.exit_code, report.reason) == (3, "exited")
        assert report.output.endswith("boom"), report.output
        assert "token ***" in report.output
        assert request.token not in repr(report)
        assert request.token.removeprefix("hubd_sc_") not in repr(report)

    async def test_killed_reported_as_killed(
        self, watching: tuple[ContainerProvisioner, Watching], engine: containerkit.Engine
    ) -> None:
        """A sidecar killed with SIGKILL through the engine is reported with exit code 137,
        reason ``killed``; one killed for good by the engine, and then removed, once."""
        made, watch = watching
        request = ensure_request()
        container_id = await started(made, request)
        await kill(engine, container_id, "SIGKILL")
        report = await watch.next()
        assert (report.sidecar_id, report.exit_code, report.reason) == (
            request.sidecar_id,
            137,
            "killed",
        )
        # Its removal now is not a second report: the next one is another sidecar's.
        await remove(engine, container_id)
        other = ensure_request()
        await kill(engine, await started(made, other), "SIGTERM")
        assert (await watch.next()).sidecar_id == other.sidecar_id

    async def test_oom_kill(self, engine: containerkit.Engine, deployment: str) -> None:
        """A sidecar the kernel's OOM killer ends is reported with exit code 137: reason
        ``oom_killed`` on dockerd; Podman 4.3 on cgroup v1 does not report the OOM kill, so
        there it may read ``killed``."""
        hog = ["sh", "-c", "echo hungry; a=xxxxxxxxxxxxxxxx; while :; do a=$a$a; done"]
        made = provisioner(engine, deployment, command=hog, memory="16m")
        watch = Watching(made)
        try:
            request = ensure_request()
            result = await made.ensure(request)
            # The hog may die within the ensure's settle: a failed start, and a report too.
            assert isinstance(result, Accepted) or result.code == "sidecar_exited", result
            report = await watch.next()
            assert (report.sidecar_id, report.exit_code) == (request.sidecar_id, 137)
            expected = {"oom_killed"} if engine.kind == "dockerd" else {"oom_killed", "killed"}
            assert report.reason in expected, report
            assert "hungry" in report.output
        finally:
            await watch.close()
            await containerkit.remove_all(engine, deployment)

    async def test_removed_container_reported_as_removed(
        self, watching: tuple[ContainerProvisioner, Watching], engine: containerkit.Engine
    ) -> None:
        """A sidecar's container removed without ever running (created, never started) is
        reported ``removed`` with no exit code; one removed while it runs is reported once,
        ``removed`` or, when it could still be inspected after its death, ``killed``."""
        made, watch = watching
        never = ensure_request()
        async with aiodocker.Docker(url=engine.socket) as docker:
            created = await docker.containers.create(
                create_body(made.options, made.id, never), name=container_name(never.sidecar_id)
            )
        await remove(engine, created.id)
        report = await watch.next()
        assert (report.sidecar_id, report.allocation_id, report.generation) == (
            never.sidecar_id,
            never.allocation_id,
            1,
        )
        assert (report.exit_code, report.reason, report.output) == (None, "removed", "")

        running = ensure_request()
        await remove(engine, await started(made, running))
        report = await watch.next()
        assert report.sidecar_id == running.sidecar_id
        assert (report.exit_code, report.reason) in {(None, "removed"), (137, "killed")}
        other = ensure_request()
        await kill(engine, await started(made, other), "SIGTERM")
        assert (await watch.next()).sidecar_id == other.sidecar_id

    async def test_dead_before_the_watch_reported_first(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A sidecar that died while nobody watched is reported on the watch's first call,
        once it says it follows, and again on the next call (with those that died during the
        first); a dead container of the deployment whose labels name no sidecar is not
        reported, nor one running."""
        made = provisioner(engine, deployment, command=EXITS_ON_TERM)
        try:
            dead = ensure_request(generation=2)
            container_id = await started(made, dead)
            await started(made)  # runs on
            async with aiodocker.Docker(url=engine.socket) as docker:
                body = {**create_body(made.options, made.id, ensure_request())}
                body["Labels"] = {"io.hubd.deployment": deployment}
                body["Cmd"] = ["true"]
                unlabelled = await docker.containers.create(body, name=f"u-{uuid.uuid4().hex}")
                await unlabelled.start()
            await kill(engine, container_id, "SIGTERM")

            async def exited() -> bool:
                return {await state(engine, container_id), await state(engine, unlabelled.id)} == {
                    "exited"
                }

            await poll_until(exited, within=30, every=0.1)
            dead_ones = {dead.sidecar_id}
            for _ in range(2):
                watch = Watching(made)
                try:
                    reports = {}
                    for _ in dead_ones:
                        report = await watch.next()
                        reports[report.sidecar_id] = report
                    assert set(reports) == dead_ones
                    assert watch.signs == [0]  # following, said before any report
                    first = reports[dead.sidecar_id]
                    assert (first.generation, first.exit_code, first.reason) == (2, 3, "exited")
                    assert "boom" in first.output
                    # Nothing else was reported: the next report is a death from now on.
                    later = ensure_request()
                    await kill(engine, await started(made, later), "SIGTERM")
                    assert (await watch.next()).sidecar_id == later.sidecar_id
                    dead_ones.add(later.sidecar_id)  # dead now: the next call reports it too
                finally:
                    await watch.close()
        finally:
            await containerkit.remove_all(engine, deployment)

    async def test_hubds_own_destroy_not_reported(
        self, watching: tuple[ContainerProvisioner, Watching], engine: containerkit.Engine
    ) -> None:
        """A sidecar hubd destroys through this provisioner is not reported (its death is
        hubd's doing): the next report is another sidecar's."""
        made, watch = watching
        request = ensure_request()
        accepted = await made.ensure(request)
        assert isinstance(accepted, Accepted)
        await made.destroy(destroy_request(request, accepted.external_ref))
        other = ensure_request()
        await kill(engine, await started(made, other), "SIGTERM")
        assert (await watch.next()).sidecar_id == other.sidecar_id

    async def test_unreachable_engine_raises_engine_unavailable(
        self, engine: containerkit.Engine, tmp_path: Path
    ) -> None:
        """A watch against a socket where no engine answers raises EngineUnavailable, whose
        code is ``engine_unavailable``, naming the socket, having yielded nothing."""
        socket = tmp_path / "gone.sock"
        made = create(
            id="container",
            options=containerkit.options(engine, socket=str(socket)),
            state_dir=tmp_path,
        )
        watch = made.watch_sidecars()
        # Raised by the first step: it never said it follows.
        with pytest.raises(EngineUnavailable) as raised:
            await anext(watch)
        assert raised.value.code == "engine_unavailable"
        assert str(socket) in str(raised.value)

    @pytest.mark.usefixtures("cleanup")
    async def test_engine_restart_ends_the_watch(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """The engine's daemon restarted under a watch that follows: its events stream ends,
        and the watch raises EngineUnavailable (``engine_unavailable``) for hubd to call it
        again; the next call follows the restarted engine."""
        made = provisioner(engine, deployment, command=EXITS_ON_TERM)
        watch = Watching(made)
        try:
            async with asyncio.timeout(30):
                await watch.following.wait()
            await asyncio.to_thread(engine.restart)
            with pytest.raises(EngineUnavailable) as raised:
                await watch.next()
            assert raised.value.code == "engine_unavailable"
        finally:
            watch.task.cancel()
        again = Watching(made)
        try:
            async with asyncio.timeout(30):
                await again.following.wait()
            request = ensure_request()
            await kill(engine, await started(made, request), "SIGTERM")
            assert (await again.next()).sidecar_id == request.sidecar_id
        finally:
            await again.close()

    def test_error_codes(self) -> None:
        """Each engine error names itself for the daemon's metrics."""
        assert EngineUnavailable("x").code == "engine_unavailable"
        assert EngineTimeout("x").code == "engine_timeout"
        assert EngineFailed(500, "x").code == "engine_error"

    @pytest.mark.usefixtures("cleanup")
    async def test_cancelled_watch_closes_its_session(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A watch cancelled while it follows ends at once, its connection closed (no
        unclosed-session warning when it is collected)."""
        made = provisioner(engine, deployment, command=SLEEPS)
        watch = Watching(made)
        dead = ensure_request()
        await kill(engine, await started(made, dead), "SIGKILL")
        assert (await watch.next()).sidecar_id == dead.sidecar_id
        async with asyncio.timeout(10):
            await watch.close()
        del watch
        gc.collect()


class TestValues:
    @pytest.mark.parametrize(
        ("state", "reason"),
        [
            ({"ExitCode": 3, "OOMKilled": False}, "exited"),
            ({"ExitCode": 0}, "exited"),
            ({"ExitCode": 137, "OOMKilled": False}, "killed"),
            ({"ExitCode": 143}, "killed"),
            ({"ExitCode": 137, "OOMKilled": True}, "oom_killed"),
        ],
    )
    def test_exit_reason(self, state: dict[str, Any], reason: str) -> None:
        assert exit_reason(state) == reason

    def test_labels_that_name_no_sidecar(self) -> None:
        """Labels of another deployment, or missing a sidecar id, an allocation id or a
        positive generation, name no sidecar."""
        labels = {
            "io.hubd.deployment": "d",
            "io.hubd.sidecar-id": "sc_1",
            "io.hubd.allocation-id": "al_1",
            "io.hubd.generation": "2",
        }
        found = sidecar_of(labels, "d")
        assert found is not None
        assert (found.sidecar_id, found.allocation_id, found.generation) == ("sc_1", "al_1", 2)
        assert sidecar_of(labels, "e") is None
        for key, value in [
            ("io.hubd.sidecar-id", ""),
            ("io.hubd.allocation-id", ""),
            ("io.hubd.generation", "0"),
            ("io.hubd.generation", "x"),
        ]:
            assert sidecar_of({**labels, key: value}, "d") is None
