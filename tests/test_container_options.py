"""The ``container`` provisioner's options: what each check refuses, what the create call's
body says for the confinement and log options, what the binding fingerprint covers; and, on a
real engine (``tests/containerkit.py``), a confined container that still runs the reference
sidecar, and an image changed under live allocations (a rolling upgrade)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from hubd.errors import PluginError, PluginLoadError
from hubd.plugins.container import create, parse_options
from hubd.plugins.container.spec import create_body
from hubd.plugins.protocol import EnsureRequest, former_fingerprints
from hubd.reconciler.eligibility import provisioner_mismatch
from hubd.store import AllocationStore, Status
from hubd.tomlout import render_toml
from tests import containerkit
from tests.clikit import run_hubd_async
from tests.daemonkit import LOG_SECTION, daemon_sections, free_port, running
from tests.reconcilerkit import poll_until

SOCKET = "/run/hubd-test/engine.sock"
BASE = {"socket": SOCKET, "image": "registry.example/team/sidecar:1.4"}


def parsed(**options: Any) -> Any:
    return parse_options({**BASE, **options}, provisioner_id="box")


def request() -> EnsureRequest:
    return EnsureRequest(
        allocation_id="al_1",
        generation=1,
        tenant_id=None,
        session_id=None,
        spec={},
        sidecar_id=f"sc_{uuid.uuid4().hex}",
        token=f"hubd_sc_{uuid.uuid4().hex}{uuid.uuid4().hex}",
        hub_ws_url="ws://127.0.0.1:9",
    )


def host_config(**options: Any) -> dict[str, Any]:
    body: dict[str, Any] = create_body(parsed(**options), "box", request(), environ={})
    return dict(body["HostConfig"])


class TestCreateBody:
    def test_defaults(self) -> None:
        """Every container gets no-new-privileges and nothing else it did not ask for."""
        host = host_config()
        assert host["SecurityOpt"] == ["no-new-privileges"]
        assert host["ReadonlyRootfs"] is False
        assert not {"CapAdd", "CapDrop", "Tmpfs", "LogConfig"} & set(host)

    def test_confinement(self) -> None:
        host = host_config(
            cap_drop=["all"],
            cap_add=["CAP_NET_BIND_SERVICE"],
            security_opt=["apparmor=hubd-sidecar", "seccomp=unconfined"],
            read_only=True,
            tmpfs={"/scratch": "size=64m,mode=1777,noexec", "/run/app": ""},
        )
        assert host["CapDrop"] == ["ALL"]
        assert host["CapAdd"] == ["NET_BIND_SERVICE"]
        assert host["SecurityOpt"] == [
            "no-new-privileges",
            "apparmor=hubd-sidecar",
            "seccomp=unconfined",
        ]
        assert host["ReadonlyRootfs"] is True
        assert host["Tmpfs"] == {"/run/app": "", "/scratch": "size=64m,mode=1777,noexec"}

    @pytest.mark.parametrize("off", ["no-new-privileges=false", "no-new-privileges:false"])
    def test_no_new_privileges_turned_off(self, off: str) -> None:
        """An entry naming no-new-privileges is the operator's word on it: sent as written."""
        assert host_config(security_opt=[off])["SecurityOpt"] == [off]

    def test_log_rotation(self) -> None:
        """log_max_size and log_max_files become the driver's max-size (in bytes) and
        max-file, beside log_options; no driver named is the engine's default (Type "")."""
        host = host_config(log_max_size="10m", log_max_files=3, log_options={"compress": "true"})
        assert host["LogConfig"] == {
            "Type": "",
            "Config": {"compress": "true", "max-file": "3", "max-size": str(10 * 1024**2)},
        }
        named = host_config(log_driver="json-file", log_max_size=4096)
        assert named["LogConfig"] == {"Type": "json-file", "Config": {"max-size": "4096"}}
        journald = host_config(log_driver="journald", log_options={"tag": "hubd"})
        assert journald["LogConfig"] == {"Type": "journald", "Config": {"tag": "hubd"}}

    def test_publish_host_brackets(self) -> None:
        """An IPv6 publish_host may be written with brackets; the engine is handed none."""
        body = create_body(parsed(port=8080, publish_host="[::1]"), "box", request(), environ={})
        assert body["HostConfig"]["PortBindings"] == {
            "8080/tcp": [{"HostIp": "::1", "HostPort": ""}]
        }


@pytest.mark.parametrize(
    ("options", "option", "words"),
    [
        ({"cap_drop": ["NET_RAWW"]}, "cap_drop", "not a Linux capability"),
        ({"cap_drop": "ALL"}, "cap_drop", "must be a list"),
        ({"cap_add": ["CHOWN"], "cap_drop": ["chown"]}, "cap_add", "CHOWN is in cap_drop too"),
        ({"security_opt": ["bogus=1"]}, "security_opt", "a key the engines know"),
        ({"security_opt": ["no-new-privileges=maybe"]}, "security_opt", "true or false"),
        ({"security_opt": ["apparmor="]}, "security_opt", "needs a value"),
        ({"security_opt": ["seccomp=profile.json"]}, "security_opt", "seccomp is 'unconfined'"),
        ({"read_only": "yes"}, "read_only", "true or false"),
        ({"tmpfs": ["/scratch"]}, "tmpfs", "must be a table"),
        ({"tmpfs": {"scratch": ""}}, "tmpfs", "must be an absolute path"),
        ({"tmpfs": {"/scratch": "bogus"}}, "tmpfs", "not a tmpfs option"),
        ({"tmpfs": {"/scratch": "size=lots"}}, "tmpfs", "no valid value for size"),
        ({"tmpfs": {"/data": ""}, "binds": ["/srv:/data"]}, "tmpfs", "also a bind's"),
        ({"log_max_size": "0"}, "log_max_size", "positive size"),
        ({"log_max_files": 3}, "log_max_files", "needs log_max_size"),
        ({"log_max_size": "1m", "log_max_files": 0}, "log_max_files", "positive integer"),
        ({"log_options": {"max-size": "1m"}}, "log_options", "log_max_size"),
        ({"log_options": {"tag": 1}}, "log_options", "must be a string"),
        ({"log_driver": "syslog", "log_max_size": "1m"}, "log_driver", "does not rotate"),
        ({"log_driver": "bad driver"}, "log_driver", "not a logging driver"),
        ({"cpus": 0.001}, "cpus", "least the engines accept"),
        ({"binds": ["/srv:/data:bogus"]}, "binds", "not a bind option"),
        ({"binds": [":/data"]}, "binds", "absolute path or a volume"),
        ({"binds": ["srv/data:/data"]}, "binds", "absolute path or a volume"),
        ({"binds": ["/a:/b:ro:z"]}, "binds", "is not 'host:container"),
        ({"image": "Registry.example/Team/Sidecar"}, "image", "not an image reference"),
        ({"image": "sidecar:bad tag"}, "image", "not an image reference"),
        ({"hub_url": "ws://"}, "hub_url", "with a host"),
        ({"hub_url": "ws://a:1,http://b:2"}, "hub_url", "'http://b:2'"),
        ({"network": "my net"}, "network", "network mode"),
        ({"publish_host": "127.0.0.300"}, "publish_host", "not an IP address"),
    ],
)
def test_refused(options: dict[str, Any], option: str, words: str) -> None:
    """Each is refused at load, naming the option: an engine would refuse it per allocation."""
    with pytest.raises(PluginLoadError, match=f"option {option!r}") as caught:
        parsed(**options)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    "options",
    [
        {"image": "localhost:5000/team/side-car_x:1.4-rc.1"},
        {"image": "busybox@sha256:" + "a" * 64},
        {"image": "[fd00::1]:5000/sidecar:1"},
        {"binds": ["data:/data", "/srv:/srv:ro,Z", "/x:/y:idmap=uids=0-1000-10"]},
        {"network": "container:other"},
        {"network": "slirp4netns:allow_host_loopback=true"},
        {"hub_url": "ws://10.0.0.1:8765,wss://hub.example/hubd/v1/connect"},
        {"security_opt": ["seccomp=/etc/hubd/seccomp.json", "label=disable"]},
        {"security_opt": ['seccomp={"defaultAction": "SCMP_ACT_ERRNO"}']},
        {"memory": "6m", "cpus": 0.01},
    ],
)
def test_accepted(options: dict[str, Any]) -> None:
    parsed(**options)


class TestFingerprint:
    def test_covers_where_sidecars_live_only(self) -> None:
        """The fingerprint follows the deployment label, and nothing a container is made of:
        not the image, command, env, binds, network, runtime, confinement, nor the socket."""
        base = parsed().binding_fingerprint
        for changed in (
            {"image": "registry.example/team/sidecar:1.5"},
            {"command": ["hubd", "sidecar", "--verbose"]},
            {"env": {"LOG": "debug"}},
            {"binds": ["/srv:/srv:ro"]},
            {"network": "host", "port": 8080},
            {"runtime": "runsc"},
            {"user": "1000:1000", "workdir": "/srv"},
            {"read_only": True, "cap_drop": ["ALL"]},
            {"socket": "unix:///var/run/docker.sock"},
        ):
            assert parsed(**changed).binding_fingerprint == base, changed
        assert parsed(deployment="elsewhere").binding_fingerprint != base

    def test_former_fingerprint_keeps_earlier_bindings_servable(self) -> None:
        """An allocation bound under the fingerprint earlier releases computed (over the
        socket, image, command …) is still served by the same options; one bound under an
        unrelated fingerprint is not."""
        options = parsed(command=["hubd", "sidecar"], env={"A": "1"})
        made = create(id="box", options={**BASE, "env": {"A": "1"}}, state_dir=Path("/none"))
        (former,) = options.former_binding_fingerprints
        assert former != options.binding_fingerprint
        for bound, problem in ((former, False), (options.binding_fingerprint, False),
                               ("f" * 64, True)):  # fmt: skip
            found = provisioner_mismatch(
                provisioner_id="box",
                bound_api_version="1",
                bound_fingerprint=bound,
                configured={"box": made},
            )
            assert (found is not None) is problem, found
        assert "a container provisioner's deployment" in str(found)

    def test_former_fingerprints_of_any_provisioner(self) -> None:
        """A provisioner that declares none, or declares something else than strings, has
        none: the check never fails on what a plugin put there."""

        class Declares:
            def __init__(self, former: object) -> None:
                self.former_binding_fingerprints = former

        assert former_fingerprints(object()) == frozenset()
        assert former_fingerprints(Declares("abc")) == frozenset()
        assert former_fingerprints(Declares(None)) == frozenset()
        assert former_fingerprints(Declares(("a", 1, ""))) == frozenset({"a"})

    def test_former_fingerprint_is_what_earlier_releases_computed(self) -> None:
        """Pinned: the digest hubd computed before the fingerprint was narrowed (over the
        socket, the deployment and the container's make-up) for these options."""
        options = parse_options({"socket": "/x.sock", "image": "busybox"}, provisioner_id="c")
        assert options.former_binding_fingerprints == (
            "598635fea45ac3908a6d4bd7b38f3c0043f3144b6caf387213c4cb8da012340e",
        )


# -- on a real engine -----------------------------------------------------------------------


@pytest.fixture(scope="session", params=containerkit.ENGINES)
def engine(request: pytest.FixtureRequest) -> containerkit.Engine:
    return containerkit.engine(request.param)


@pytest.fixture
def deployment() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def daemon_config(
    state_dir: Path, database_url: str, options: dict[str, Any], *, server_port: int = 0
) -> Path:
    # The project's own writer: option tables may have keys TOML must quote ("/scratch").
    provisioner = {"id": "container", "plugin": "container", "options": options}
    path = state_dir / "hubd.toml"
    path.write_text(
        daemon_sections(
            database_url=database_url,
            state_dir=state_dir,
            server_port=server_port,
            operation_timeout="8s",
            max_concurrent_claims=None,
        )
        + LOG_SECTION
        + render_toml({"provisioners": [provisioner]})
    )
    return path


async def request_ready(database_url: str) -> str:
    done = await run_hubd_async(
        "alloc", "request", "--provisioner", "container", "--wait", "--timeout", "60s",
        env={"HUBD_DATABASE_URL": database_url},
    )  # fmt: skip
    assert done.code == 0, done.err
    return done.out.strip()


async def release(database_url: str, observer: AllocationStore, allocation_id: str) -> None:
    done = await run_hubd_async(
        "alloc", "release", allocation_id, env={"HUBD_DATABASE_URL": database_url}
    )
    assert done.code == 0, done.err

    async def released() -> bool:
        return (await observer.get(allocation_id)).status is Status.RELEASED

    await poll_until(released, within=60, every=0.2)


def status_fields(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


@pytest.mark.timeout(240)
class TestOnEngine:
    async def test_confined_container_runs_the_sidecar(
        self,
        engine: containerkit.Engine,
        deployment: str,
        database_url: str,
        observer: AllocationStore,
        state_dir: Path,
    ) -> None:
        """A container with a read-only root, no-new-privileges (the default), every
        capability dropped, a tmpfs and rotated logs still runs the reference sidecar, which
        connects: the allocation becomes ready, and the engine made what was asked."""
        options = containerkit.options(
            engine,
            deployment=deployment,
            read_only=True,
            cap_drop=["ALL"],
            tmpfs={"/scratch": "size=16m,mode=1777"},
            log_max_size="1m",
            log_max_files=2,
        )
        try:
            async with running(daemon_config(state_dir, database_url, options)):
                allocation_id = await request_ready(database_url)
                (found,) = await containerkit.containers(engine, deployment)
                host = found["HostConfig"]
                assert host["ReadonlyRootfs"] is True
                assert host["SecurityOpt"] == ["no-new-privileges"]
                assert "/scratch" in host["Tmpfs"]
                # What the sidecar's process really has, as the host's kernel says.
                status = status_fields(found["State"]["Pid"])
                assert status["NoNewPrivs"] == "1"
                assert int(status["CapEff"], 16) == 0
                if engine.kind == "dockerd":
                    logs = host["LogConfig"]
                    assert logs["Config"] == {"max-size": str(1024**2), "max-file": "2"}
                else:
                    # Podman keeps one file of at most max-size (max-file is dockerd's), and
                    # only its own CLI shows it, in decimal units: 1 MiB is 1.049 MB.
                    name = found["Name"].lstrip("/")
                    template = "{{.HostConfig.LogConfig.Size}}"
                    size = engine.cli("inspect", "--format", template, name).stdout.strip()
                    assert size == "1.049MB"
                await release(database_url, observer, allocation_id)
                assert await containerkit.containers(engine, deployment) == []
        finally:
            await containerkit.remove_all(engine, deployment)

    async def test_image_change_is_a_rolling_upgrade(
        self,
        engine: containerkit.Engine,
        deployment: str,
        database_url: str,
        observer: AllocationStore,
        state_dir: Path,
    ) -> None:
        """hubd restarted with another image: the allocation made before keeps its container
        (old image, same generation) and its release finishes, removing that container; a new
        allocation gets the new image."""
        upgraded = f"localhost/hubd-sidecar-upgrade-{deployment}:2"
        engine.cli("tag", containerkit.IMAGE, upgraded)
        port = free_port()
        before = containerkit.options(engine, deployment=deployment)
        after = {**before, "image": upgraded}
        try:
            async with running(daemon_config(state_dir, database_url, before, server_port=port)):
                old = await request_ready(database_url)
            async with running(daemon_config(state_dir, database_url, after, server_port=port)):
                new = await request_ready(database_url)

                async def both_ready() -> bool:
                    rows = [await observer.get(i) for i in (old, new)]
                    return all(row.ready for row in rows)

                await poll_until(both_ready, within=90, every=0.3)
                images = {
                    c["Config"]["Labels"]["io.hubd.allocation-id"]: c["Config"]["Image"]
                    for c in await containerkit.containers(engine, deployment)
                }
                assert images == {old: containerkit.IMAGE, new: upgraded}
                assert (await observer.get(old)).generation == 1
                await release(database_url, observer, old)
                left = await containerkit.containers(engine, deployment)
                assert [c["Config"]["Labels"]["io.hubd.allocation-id"] for c in left] == [new]
                await release(database_url, observer, new)
        finally:
            await containerkit.remove_all(engine, deployment)
            engine.cli("rmi", upgraded, check=False)


async def test_probe_through_the_engine(
    engine: containerkit.Engine, deployment: str, tmp_path: Path
) -> None:
    """``check-config --probe`` asks the engine, creating nothing: it answers, and has the
    image; an image it lacks, with pull = "never", is the problem named."""
    made = create(
        id="box", options=containerkit.options(engine, deployment=deployment), state_dir=tmp_path
    )
    found = await made.probe()
    assert found.startswith("Docker " if engine.kind == "dockerd" else "Podman ")
    assert f"answers at {engine.path} (option socket)" in found
    assert f"image {containerkit.IMAGE} is there" in found
    missing = create(
        id="box",
        options=containerkit.options(engine, deployment=deployment, image="localhost/absent:1"),
        state_dir=tmp_path,
    )
    with pytest.raises(PluginError, match="image 'localhost/absent:1' is not on the engine"):
        await missing.probe()
    assert await containerkit.containers(engine, deployment) == []


async def test_probe_names_what_this_engine_refuses(
    engine: containerkit.Engine, deployment: str, tmp_path: Path
) -> None:
    """An option one engine takes and the other refuses at create is named by the probe of
    the engine that refuses it: Podman has no 'local' log driver, dockerd no seccomp path."""
    if engine.kind == "podman":
        option, problem = {"log_driver": "local"}, "log_driver 'local' is dockerd's"
    else:
        option = {"security_opt": ["seccomp=/etc/hubd/seccomp.json"]}
        problem = "dockerd takes the profile's JSON"
    made = create(
        id="box",
        options=containerkit.options(engine, deployment=deployment, **option),
        state_dir=tmp_path,
    )
    with pytest.raises(PluginError, match=problem):
        await made.probe()
