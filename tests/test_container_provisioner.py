"""The ``container`` provisioner against each real engine (a private Podman service and a
private dockerd, see ``tests/containerkit.py``): in process, and under a real ``hubd run`` with
the reference sidecar inside each container. Every test that takes the ``engine`` fixture runs
once per engine. An engine that cannot be had skips its tests with the reason; one named in
``HUBD_REQUIRE_CONTAINER_ENGINE`` fails them instead."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import attrs
import pytest

from hubd.client import Client
from hubd.plugins.container import ContainerProvisioner, create
from hubd.plugins.container.engine import EngineFailed
from hubd.plugins.container.failures import misconfigured
from hubd.plugins.protocol import Accepted, Destroyed, DestroyRequest, EnsureRequest, Rejected
from hubd.store import AllocationStore, LedgerStore, Status, connect_database
from tests import containerkit
from tests.clikit import run_hubd, run_hubd_async
from tests.daemonkit import LOG_SECTION, DaemonProcess, daemon_sections, free_port, running
from tests.reconcilerkit import poll_until

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="session", params=containerkit.ENGINES)
def engine(request: pytest.FixtureRequest) -> containerkit.Engine:
    return containerkit.engine(request.param)


def only_on(kind: str) -> pytest.MarkDecorator:
    """Runs a test on the engine of ``kind`` only, for behaviour that differs between them."""
    return pytest.mark.parametrize("engine", [kind], indirect=True)


@pytest.fixture
def deployment() -> str:
    """A deployment label of the test's own: what it lists and what is removed after it."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def cleanup(engine: containerkit.Engine, deployment: str) -> AsyncIterator[None]:
    yield
    await containerkit.remove_all(engine, deployment)


def provisioner(
    engine: containerkit.Engine, deployment: str, **options: Any
) -> ContainerProvisioner:
    return create(
        id="container",
        options=containerkit.options(engine, deployment=deployment, **options),
        state_dir=Path("/nonexistent"),
    )


def ensure_request(sidecar_id: str | None = None, **overrides: Any) -> EnsureRequest:
    values: dict[str, Any] = {
        "allocation_id": f"al_{uuid.uuid4().hex}",
        "generation": 1,
        "tenant_id": None,
        "session_id": None,
        "spec": {},
        "sidecar_id": sidecar_id or f"sc_{uuid.uuid4().hex}",
        "token": f"hubd_sc_{uuid.uuid4().hex}{uuid.uuid4().hex}",
        "hub_ws_url": "ws://127.0.0.1:9",
        **overrides,
    }
    return EnsureRequest(**values)


def destroy_request(request: EnsureRequest, ref: str | None = None) -> DestroyRequest:
    return DestroyRequest(
        allocation_id=request.allocation_id,
        generation=request.generation + 1,
        sidecar_id=request.sidecar_id,
        external_ref=ref,
    )


@attrs.frozen(kw_only=True)
class Hub:
    """A test of ``hubd run`` with the container provisioner: the engine, the test's
    deployment label, its database and state dir, and an observer reading the rows."""

    engine: containerkit.Engine
    deployment: str
    database_url: str
    observer: AllocationStore
    state_dir: Path

    @property
    def env(self) -> dict[str, str]:
        """What the CLI is run with."""
        return {"HUBD_DATABASE_URL": self.database_url}

    def config(
        self,
        *,
        engine: containerkit.Engine | None = None,
        server_port: int = 0,
        extra: str = "",
        **overrides: Any,
    ) -> Path:
        """The daemon's config in the state dir: the suite's settings (with an 8 s operation
        timeout and 16 claims at once, fewer than the twenty of the concurrency test), ``extra``
        sections, and the container provisioner
        on ``engine`` (the test's by default) publishing port 18080, with ``overrides`` of its
        options."""
        options = containerkit.options(
            engine or self.engine, deployment=self.deployment, port=18080, **overrides
        )
        path = self.state_dir / "hubd.toml"
        path.write_text(
            daemon_sections(
                database_url=self.database_url,
                state_dir=self.state_dir,
                server_port=server_port,
                operation_timeout="8s",
                max_concurrent_claims=16,
            )
            + LOG_SECTION
            + extra
            + '\n[[provisioners]]\nid = "container"\nplugin = "container"\n'
            + "[provisioners.options]\n"
            + containerkit.toml_options(options)
            + "\n"
        )
        return path

    async def containers(self) -> list[dict[str, Any]]:
        """The containers of the test's deployment on the test's engine."""
        return await containerkit.containers(self.engine, self.deployment)

    async def request(self) -> str:
        """``hubd alloc request --wait``: a new allocation, ready."""
        done = await run_hubd_async(
            "alloc", "request", "--provisioner", "container", "--wait", "--timeout", "60s",
            env=self.env,
        )  # fmt: skip
        assert done.code == 0, done.err
        return done.out.strip()

    async def release(self, allocation_id: str) -> None:
        """``hubd alloc release``, then wait until the row says released."""
        done = await run_hubd_async("alloc", "release", allocation_id, env=self.env)
        assert done.code == 0, done.err
        await poll_until(lambda: _released(self.observer, allocation_id), within=60, every=0.2)


@pytest.fixture
def hub(
    engine: containerkit.Engine,
    deployment: str,
    database_url: str,
    observer: AllocationStore,
    state_dir: Path,
) -> Hub:
    return Hub(
        engine=engine,
        deployment=deployment,
        database_url=database_url,
        observer=observer,
        state_dir=state_dir,
    )


async def ready(store: AllocationStore, ids: list[str]) -> bool:
    rows = [await store.get(i) for i in ids]
    return all(row.ready for row in rows)


def token_of(inspected: dict[str, Any]) -> str:
    for item in inspected["Config"]["Env"]:
        if item.startswith("HUBD_TOKEN="):
            return str(item.removeprefix("HUBD_TOKEN="))
    raise AssertionError("the container has no HUBD_TOKEN")


class TestProvisioner:
    """Calls made in this process, as a claim makes them."""

    @pytest.mark.usefixtures("cleanup")
    async def test_retried_ensure_adopts(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A second ensure of one sidecar id, from another provisioner instance (a restarted
        hubd, another replica), adopts the running container: same reference, one container;
        a container left created but never started (an ensure cut short) is started."""
        first = provisioner(engine, deployment, command=["sleep", "300"])
        request = ensure_request()
        accepted = await first.ensure(request)
        assert isinstance(accepted, Accepted), accepted
        assert accepted.metadata is not None
        assert accepted.metadata["container"] == f"hubd-{request.sidecar_id}"
        again = await provisioner(engine, deployment, command=["sleep", "300"]).ensure(request)
        assert again == accepted
        assert len(await containerkit.containers(engine, deployment)) == 1

        interrupted = ensure_request()
        async with aiodocker.Docker(url=engine.socket) as docker:
            from hubd.plugins.container.spec import container_name, create_body

            await docker.containers.create(
                create_body(first.options, first.id, interrupted),
                name=container_name(interrupted.sidecar_id),
            )
        started = await first.ensure(interrupted)
        assert isinstance(started, Accepted), started
        states = sorted(
            c["State"]["Status"] for c in await containerkit.containers(engine, deployment)
        )
        assert states == ["running", "running"]

    @pytest.mark.usefixtures("cleanup")
    async def test_container_that_exits_is_retryable_with_its_logs(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A container whose command exits at once is a retryable sidecar_exited rejection
        quoting its last output, with the token it printed hidden; destroy then removes it."""
        made = provisioner(
            engine,
            deployment,
            command=["sh", "-c", 'echo "token $HUBD_TOKEN"; echo failing; exit 3'],
        )
        request = ensure_request()
        result = await made.ensure(request)
        assert isinstance(result, Rejected), result
        assert (result.code, result.retryable) == ("sidecar_exited", True)
        assert "exit code 3" in result.message
        assert "failing" in result.message
        assert request.token not in result.message
        assert request.token.removeprefix("hubd_sc_") not in result.message
        assert await made.destroy(destroy_request(request)) == Destroyed(removed=True)
        assert await containerkit.containers(engine, deployment) == []

    async def test_missing_image_is_not_retryable(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """With pull = "never", an image the engine lacks fails the allocation: a
        non-retryable image_not_found naming the image; nothing is left behind."""
        made = provisioner(engine, deployment, image="localhost/hubd-absent:1")
        result = await made.ensure(ensure_request())
        assert isinstance(result, Rejected), result
        assert (result.code, result.retryable) == ("image_not_found", False)
        assert "localhost/hubd-absent:1" in result.message
        assert await containerkit.containers(engine, deployment) == []

    @only_on("podman")  # dockerd runs a container under the runtime it names, or refuses it
    async def test_runtime_the_engine_ignores_is_refused(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """A ``runtime`` the engine does not report for the container it made (Podman's
        compatible API ignores it) is a non-retryable runtime_unsupported naming both
        runtimes, before the container ever starts; nothing is left behind."""
        made = provisioner(engine, deployment, runtime="runsc", command=["sleep", "300"])
        result = await made.ensure(ensure_request())
        assert isinstance(result, Rejected), result
        assert (result.code, result.retryable) == ("runtime_unsupported", False)
        assert "'runsc'" in result.message
        assert "'oci'" in result.message
        assert await containerkit.containers(engine, deployment) == []

    @only_on("dockerd")  # Podman's compatible API ignores a container's runtime (test above)
    async def test_runtime_the_engine_does_not_know_is_refused(
        self, engine: containerkit.Engine, deployment: str
    ) -> None:
        """dockerd refuses to create a container for a runtime it has no entry for in its
        daemon.json: the ensure is rejected naming the runtime, and nothing is left behind."""
        made = provisioner(engine, deployment, runtime="runsc", command=["sleep", "300"])
        result = await made.ensure(ensure_request())
        assert isinstance(result, Rejected), result
        assert (result.code, result.retryable) == ("engine_rejected", False)
        assert "Unknown runtime specified runsc" in result.message, result
        assert await containerkit.containers(engine, deployment) == []

    @pytest.mark.parametrize(
        ("option", "value", "named"),
        [
            ("command", ["/nonexistent"], "/nonexistent"),
            ("user", "nosuchuser", "nosuchuser"),
            ("network", "hubd-no-such-network", "hubd-no-such-network"),
        ],
    )
    async def test_misconfiguration_is_not_retryable_and_leaves_nothing(
        self, engine: containerkit.Engine, deployment: str, option: str, value: Any, named: str
    ) -> None:
        """A command that is not in the image, a user it does not know, a network the engine
        does not have: the engine refuses the container at its create or its start, and the
        ensure is a non-retryable sidecar_misconfigured quoting the engine, with no container
        left (a failed start leaves one created, which every retry would adopt and fail)."""
        made = provisioner(engine, deployment, **{option: value})
        request = ensure_request()
        result = await made.ensure(request)
        assert isinstance(result, Rejected), result
        assert (result.code, result.retryable) == ("sidecar_misconfigured", False), result
        assert named in result.message
        assert request.token not in result.message
        assert await containerkit.containers(engine, deployment) == []

    async def test_engine_down_is_retryable_naming_the_socket(
        self, engine: containerkit.Engine, tmp_path: Path
    ) -> None:
        """An engine that does not answer (no socket there) is a retryable rejection of
        ensure and of destroy, naming the socket."""
        socket = tmp_path / "gone.sock"
        made = create(
            id="container",
            options=containerkit.options(engine, socket=str(socket)),
            state_dir=tmp_path,
        )
        request = ensure_request()
        result = await made.ensure(request)
        assert isinstance(result, Rejected), result
        assert (result.code, result.retryable) == ("engine_unavailable", True)
        assert str(socket) in result.message
        gone = await made.destroy(destroy_request(request))
        assert not isinstance(gone, Destroyed)
        assert gone.retryable
        assert str(socket) in gone.message

    def test_check_config_without_aiodocker(self, tmp_path: Path) -> None:
        """Without aiodocker installed, check-config of a config naming the container
        plugin exits 2 saying which extra to install."""
        blocker = tmp_path / "site" / "aiodocker"
        blocker.mkdir(parents=True)
        (blocker / "__init__.py").write_text("raise ImportError('blocked by the test')\n")
        path = tmp_path / "hubd.toml"
        path.write_text(
            '[[provisioners]]\nid = "c"\nplugin = "container"\n'
            '[provisioners.options]\nimage = "x"\n'
        )
        env = {"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        done = run_hubd("check-config", "--config", str(path), env=env)
        assert done.code == 2, done.err
        assert "hubd[containers]" in done.err

    @pytest.mark.parametrize(
        ("status", "message", "gone"),
        [
            (404, "no such container", True),
            # Podman, for a container removed while the call looked at it: what an orphan
            # sweep's destroy meets when another replica's destroy of the same one wins.
            (500, "container 0548ae1e does not exist in database: no such container", True),
            (500, "container state improper", False),
        ],
    )
    def test_engine_errors_that_mean_the_container_is_gone(
        self, status: int, message: str, gone: bool
    ) -> None:
        assert EngineFailed(status, message).not_found is gone

    @pytest.mark.parametrize(
        ("status", "message", "code"),
        [
            # What dockerd 20.10 and Podman 4.3 answered, at the create or the start.
            (400, 'failed to create shim task: OCI runtime create failed: runc create failed: '
             'unable to start container process: exec: "/nonexistent": stat /nonexistent: no '
             "such file or directory: unknown", "sidecar_misconfigured"),
            (400, 'failed to create shim task: OCI runtime create failed: runc create failed: '
             'unable to start container process: exec: "hubd": executable file not found in '
             "$PATH: unknown", "sidecar_misconfigured"),
            (500, 'runc: runc create failed: unable to start container process: exec: '
             '"/nonexistent": stat /nonexistent: no such file or directory: OCI runtime '
             "attempted to invoke a command that was not found", "sidecar_misconfigured"),
            (500, "unable to find user nosuchuser: no matching entries in passwd file",
             "sidecar_misconfigured"),
            (404, "network nosuchnet not found", "sidecar_misconfigured"),
            (500, "container create: unable to find network with name or ID nosuchnet: network "
             "not found", "sidecar_misconfigured"),
            (500, "Cannot mkdir: /bin/sh is not a directory", "sidecar_misconfigured"),
            (400, "Unknown runtime specified nosuchruntime", "engine_rejected"),
            (500, "container state improper", None),
            (404, "no such container", None),
            (409, "Conflict. The container name is already in use", None),
        ],
    )  # fmt: skip
    def test_engine_errors_no_retry_changes(
        self, status: int, message: str, code: str | None
    ) -> None:
        refused = misconfigured(EngineFailed(status, message))
        assert (None if refused is None else refused.code) == code
        assert refused is None or refused.retryable is False


class TestThroughDaemon:
    """``hubd run`` with the container provisioner; the reference sidecar in each container."""

    @pytest.mark.timeout(360)
    @pytest.mark.usefixtures("cleanup")
    async def test_twenty_concurrent_allocations(self, hub: Hub) -> None:
        """Twenty allocations requested at once (more than the daemon claims at a time) all
        become ready, each with exactly one running container, labelled with its allocation
        and its current sidecar; released at once, every one is released and the engine lists
        no container of the deployment."""
        observer = hub.observer
        async with running(hub.config()):
            async with await Client.connect(hub.database_url, max_size=20) as client:
                requested = await asyncio.gather(*(client.request("container") for _ in range(20)))
                ids = [allocation.id for allocation in requested]
                await poll_until(lambda: ready(observer, ids), within=240, every=0.5)
                rows = [await observer.get(i) for i in ids]
                listed = await hub.containers()
                assert sorted(
                    (c["Config"]["Labels"]["io.hubd.allocation-id"],
                     c["Config"]["Labels"]["io.hubd.sidecar-id"],
                     c["State"]["Status"])
                    for c in listed
                ) == sorted((row.id, row.sidecar_id, "running") for row in rows)  # fmt: skip

                await asyncio.gather(*(client.release(i) for i in ids))
                await poll_until(lambda: _all_released(observer, ids), within=120, every=0.5)
            assert await hub.containers() == []
            rows = [await observer.get(i) for i in ids]
            assert {(row.status, row.ready) for row in rows} == {(Status.RELEASED, False)}

    async def test_sidecar_under_gvisor(self, hub: Hub) -> None:
        """Under runsc (on Podman the service's default runtime, on dockerd the runtime the
        provisioner's ``runtime`` option names), the reference sidecar runs inside gVisor's
        user-space kernel and still reaches the hub: the allocation becomes ready, the engine
        ran its container with runsc, no host process is the sidecar (the sandbox runs it);
        released, the container is removed. Skipped with the reason where runsc is missing or
        cannot run a container here."""
        gvisor = containerkit.gvisor_engine(hub.engine.kind)
        runtime = gvisor.gvisor_runtime
        overrides = {} if runtime is None else {"runtime": runtime}
        try:
            async with running(hub.config(engine=gvisor, **overrides)):
                allocation_id = await hub.request()
                row = await hub.observer.get(allocation_id)
                assert row.ready
                (inspected,) = await containerkit.containers(gvisor, hub.deployment)
                assert gvisor.runtime_of(inspected["Name"].lstrip("/")) == "runsc"
                assert _host_processes_with(f"HUBD_SIDECAR_ID={row.sidecar_id}") == []
                await hub.release(allocation_id)
                assert await containerkit.containers(gvisor, hub.deployment) == []
        finally:
            await containerkit.remove_all(gvisor, hub.deployment)

    @pytest.mark.usefixtures("cleanup")
    async def test_ready_then_released(self, hub: Hub) -> None:
        """An allocation becomes ready with its sidecar connected from inside a container
        labelled with it; its endpoint is the published port; the token is in the
        container's environment only (no label, no command line, no log line, no ledger
        entry); released, the container is removed."""
        async with running(hub.config()) as daemon:
            allocation_id = await hub.request()
            row = await hub.observer.get(allocation_id)
            assert row.ready
            assert row.endpoint == "127.0.0.1:18080"
            # The metadata is the sidecar's own: it published before the acceptance was
            # recorded (docs/plugins.md, Results).
            assert row.metadata is not None
            (inspected,) = await hub.containers()
            labels = inspected["Config"]["Labels"]
            assert labels["io.hubd.allocation-id"] == allocation_id
            assert labels["io.hubd.sidecar-id"] == row.sidecar_id
            assert labels["io.hubd.generation"] == "1"
            token = token_of(inspected)
            assert token not in repr(labels) + repr(inspected["Config"]["Cmd"])
            await hub.release(allocation_id)
            assert await hub.containers() == []
        db = await connect_database(hub.database_url)
        try:
            history = await LedgerStore(db, instance_id="observer").history(allocation_id)
        finally:
            await db.close()
        assert history
        assert token not in repr(history)
        assert token not in daemon.output
        assert token.removeprefix("hubd_sc_") not in daemon.output

    @pytest.mark.usefixtures("cleanup")
    async def test_orphan_sweep_removes_a_stray_container(self, hub: Hub) -> None:
        """A container labelled with this deployment and a known allocation, but not its
        current sidecar, is destroyed by the orphan sweep; the allocation's own stays."""
        # The grace outlasts the stray's ensure (create, start, the settle) and the count
        # below on a loaded machine: with one second, a sweep that saw it just created could
        # remove it before either finished.
        path = hub.config(extra='[orphans]\ninterval = "1s"\ngrace = "5s"\n')
        async with running(path) as daemon:
            allocation_id = await hub.request()
            row = await hub.observer.get(allocation_id)
            stray = ensure_request(allocation_id=allocation_id, generation=1)
            made = provisioner(hub.engine, hub.deployment, command=["sleep", "300"])
            assert isinstance(await made.ensure(stray), Accepted)
            assert len(await hub.containers()) == 2

            async def only_the_current() -> bool:
                listed = await hub.containers()
                return [c["Config"]["Labels"]["io.hubd.sidecar-id"] for c in listed] == [
                    row.sidecar_id
                ]

            await poll_until(only_the_current, within=60, every=0.3)
            swept = await daemon.wait_for_log("orphan_sidecar_destroyed", within=30)
            assert swept["sidecar_id"] == stray.sidecar_id
            assert (await hub.observer.get(allocation_id)).ready

    @pytest.mark.usefixtures("cleanup")
    async def test_engine_restart_keeps_every_allocation(self, hub: Hub) -> None:
        """The engine's daemon restarted under a running hubd (dockerd with live-restore, as
        docs/operations.md recommends; Podman's API service, which never owned the containers):
        every container runs on, started when it was, and every allocation stays ready at its
        generation; hubd goes on using the engine, so a release removes its container."""
        async with running(hub.config()):
            ids = list(await asyncio.gather(*(hub.request() for _ in range(2))))
            started = {c["Id"]: c["State"]["StartedAt"] for c in await hub.containers()}
            await asyncio.to_thread(hub.engine.restart)
            after = await hub.containers()
            assert {c["Id"]: c["State"]["StartedAt"] for c in after} == started
            assert {c["State"]["Status"] for c in after} == {"running"}
            rows = [await hub.observer.get(i) for i in ids]
            assert {(row.ready, row.generation) for row in rows} == {(True, 1)}
            await hub.release(ids[0])
            (left,) = await hub.containers()
            assert left["Config"]["Labels"]["io.hubd.allocation-id"] == ids[1]

    @pytest.mark.usefixtures("cleanup")
    async def test_kill_9_then_restart_adopts(self, hub: Hub) -> None:
        """hubd killed with SIGKILL while its sidecars run in containers: the containers stay
        up, their sidecars reconnect to the restarted hubd, every allocation is ready again
        on the same container, and no container is duplicated."""
        # The sidecars dial the same address after the restart.
        path = hub.config(server_port=free_port())
        first = DaemonProcess(path)
        await first.start()
        try:
            ids = list(await asyncio.gather(*(hub.request() for _ in range(3))))
            before = sorted(c["Id"] for c in await hub.containers())
            assert len(before) == 3
            await first.signal(signal.SIGKILL)
            assert await first.wait() == -signal.SIGKILL
        finally:
            await first.kill()
        async with running(path) as second:

            async def reconnected() -> bool:
                connected = [
                    line for line in second.lines if line.get("event") == "sidecar_connected"
                ]
                return len(connected) >= len(ids) and await ready(hub.observer, ids)

            # Connected to the second hubd: the rows' readiness alone may predate the kill.
            await poll_until(reconnected, within=90, every=0.3)
            rows = [await hub.observer.get(i) for i in ids]
            assert all(row.generation == 1 for row in rows)
            after = sorted(c["Id"] for c in await hub.containers())
            assert after == before


def with_reconciler(path: Path, **settings: str) -> Path:
    """The config at ``path`` with ``settings`` added to (or replacing) its ``[reconciler]``
    keys, the values written as TOML literals."""
    lines = path.read_text().splitlines()
    kept = [line for line in lines if line.split(" = ")[0] not in settings]
    start = kept.index("[reconciler]") + 1
    added = [f"{key} = {value}" for key, value in settings.items()]
    path.write_text("\n".join([*kept[:start], *added, *kept[start:]]) + "\n")
    return path


class TestDeaths:
    """``hubd run`` hears from the engine that a container died: at once, whatever
    ``connect_timeout`` is, with the exit code and the output kept."""

    @pytest.mark.usefixtures("cleanup")
    async def test_a_killed_container_ends_its_allocation_at_once(self, hub: Hub) -> None:
        """While it runs, ``alloc logs`` shows the sidecar's output. Killed behind hubd's back
        (connect_timeout is ten minutes, so only the engine's word can end it within the
        poll's deadline), the allocation is released (automatic recovery is off) as
        ``sidecar_exited`` with the exit code, its container removed, and ``alloc logs``
        then prints the kept tail."""
        path = with_reconciler(hub.config(), connect_timeout='"600s"')
        env = {**hub.env, "HUBD_CONFIG": str(path)}
        async with running(path) as daemon:
            allocation_id = await hub.request()
            (container,) = await hub.containers()
            shown = await run_hubd_async("alloc", "logs", allocation_id, "--tail", "50", env=env)
            assert shown.code == 0, shown.err
            assert "welcome" in shown.out or "connected" in shown.out, shown.out
            await asyncio.to_thread(hub.engine.cli, "kill", container["Id"])

            async def ended() -> bool:
                return (await hub.observer.get(allocation_id)).status is Status.RELEASED

            await poll_until(ended, within=60, every=0.2)
            row = await hub.observer.get(allocation_id)
            assert row.failure_code == "sidecar_exited"
            assert row.failure_message is not None
            assert "the sidecar was killed with exit code 137" in row.failure_message
            assert await hub.containers() == []
            died = await daemon.wait_for_log("sidecar_died", within=10)
            assert died["allocation_id"] == allocation_id
        kept = await run_hubd_async("alloc", "logs", allocation_id, env=env)
        assert kept.code == 0, kept.err
        assert "gen 1  the sidecar was killed with exit code 137" in kept.out

    @pytest.mark.usefixtures("cleanup")
    async def test_a_sidecar_that_keeps_crashing_is_given_up(self, hub: Hub) -> None:
        """A container that exits a second after it starts is replaced, each death reported
        with its exit code and output, until replacement_limit: then the allocation ends
        failed saying so, and nothing is left on the engine."""
        path = with_reconciler(
            hub.config(command=["sh", "-c", "echo boom >&2; sleep 1; exit 3"]),
            connect_timeout='"600s"',
            automatic_replacement_recovery="true",
            replacement_limit="2",
        )
        async with running(path):
            requested = await run_hubd_async(
                "alloc", "request", "--provisioner", "container", env=hub.env
            )
            assert requested.code == 0, requested.err
            allocation_id = requested.out.strip()

            async def failed() -> bool:
                return (await hub.observer.get(allocation_id)).status is Status.FAILED

            await poll_until(failed, within=120, every=0.3)
            row = await hub.observer.get(allocation_id)
            assert row.give_up
            assert row.failure_code == "sidecar_exited"
            assert row.failure_message is not None
            assert row.failure_message.startswith(
                "gave up: 3 sidecars failed within 600 s (replacement_limit 2); the last: "
                "the sidecar exited with exit code 3: "
            ), row.failure_message
            assert "boom" in row.failure_message
            shown = await run_hubd_async("alloc", "show", allocation_id, "--json", env=hub.env)
            history = json.loads(shown.out)["history"]
            deaths = [e["message"] for e in history if e["kind"] == "sidecar_exited"]
            assert len(deaths) == 3
            assert all("exit code 3" in message for message in deaths)

            async def nothing_left() -> bool:
                return await hub.containers() == []

            await poll_until(nothing_left, within=60, every=0.3)


async def _released(store: AllocationStore, allocation_id: str) -> bool:
    return (await store.get(allocation_id)).status is Status.RELEASED


async def _all_released(store: AllocationStore, ids: list[str]) -> bool:
    return all([await _released(store, i) for i in ids])


def _host_processes_with(entry: str) -> list[int]:
    """Host processes whose environment holds ``entry`` (``NAME=value``)."""
    needle = entry.encode()
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if needle in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found
