"""Private container engines for the tests (``.ci/container-engine``): Podman's API service and
dockerd (Debian's docker.io, with a containerd of its own), each started once per test process
on first use and stopped when the process exits, and the options that run the reference
sidecar (this checkout, this interpreter) in them.

No engine of a kind (not root, no Podman or no dockerd, no busybox, or it fails to start) skips
the tests that need it, with the reason. ``HUBD_REQUIRE_CONTAINER_ENGINE`` (set by ``.ci/run``
to what ``.ci/install-podman`` could start, ``podman,dockerd``) names the kinds whose tests fail
instead; ``1``, what it said before dockerd was an engine here, means Podman.

A second engine of each kind runs containers under gVisor (``.ci/container-engine start DIR
runsc KIND``) for the tests of a sandboxed runtime. Where runsc is missing or cannot run a
container here (the script's own probe, exit 3), those tests skip with the reason even when
the kind is required: what is required is that gVisor works wherever it can.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn

import attrs
import pytest

if TYPE_CHECKING:
    import aiodocker

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "container-engine"
IMAGE = "localhost/hubd-sidecar-base:latest"
ENGINES: Final = ("podman", "dockerd")
"""The kinds of engine the container tests run on."""
# The VM's hard limits are below what the engine would otherwise ask of the runtime.
ULIMITS = {"nofile": [1024, 20000], "nproc": [4096, 4096]}
# What each kind needs on the PATH besides busybox (the image).
_TOOLS: Final = {"podman": ("podman",), "dockerd": ("dockerd", "containerd", "docker")}
_PACKAGE: Final = {"podman": "podman", "dockerd": "docker.io"}


def _required(value: str) -> frozenset[str]:
    if value.strip() == "1":
        return frozenset({"podman"})
    return frozenset(part.strip() for part in value.split(",") if part.strip())


REQUIRED: Final = _required(os.environ.get("HUBD_REQUIRE_CONTAINER_ENGINE", ""))
"""The kinds whose tests fail, rather than skip, without an engine."""


@attrs.frozen
class Engine:
    socket: str
    """``unix://…``"""
    directory: Path
    kind: str = "podman"
    """``podman`` or ``dockerd``."""

    @property
    def path(self) -> str:
        return self.socket.removeprefix("unix://")

    @property
    def gvisor_runtime(self) -> str | None:
        """The provisioner's ``runtime`` option that runs a sidecar under this engine's gVisor:
        dockerd runs a container under the runtime it names; Podman ignores it, and its gVisor
        engine runs every container under runsc instead."""
        return "runsc" if self.kind == "dockerd" else None

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The engine's own CLI (``podman`` on this engine's storage, ``docker`` on its
        socket): what a test inspects or does behind the provisioner's back, never the code."""
        if self.kind == "dockerd":
            command = ["docker", "-H", self.socket, *args]
            env = {**os.environ, "DOCKER_CONFIG": str(self.directory / "docker-cli")}
        else:
            command = [
                "podman", "--root", str(self.directory / "storage"),
                "--runroot", str(self.directory / "run"), "--tmpdir", str(self.directory / "tmp"),
                *args,
            ]  # fmt: skip
            env = {**os.environ, "CONTAINERS_CONF": str(self.directory / "containers.conf")}
        return subprocess.run(
            command, env=env, capture_output=True, text=True, check=check, timeout=60
        )

    def restart(self) -> None:
        """Stops and starts the engine's daemon (dockerd; Podman's API service), as an upgrade
        or ``systemctl restart`` does; its containers stay as they are."""
        subprocess.run(
            [str(SCRIPT), "restart", str(self.directory)],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip

    def runtime_of(self, container: str) -> str:
        """The OCI runtime that runs ``container``, as the engine reports it (Podman's compat
        API says ``oci`` whatever it is; its own CLI tells)."""
        template = "{{.HostConfig.Runtime}}" if self.kind == "dockerd" else "{{.OCIRuntime}}"
        return self.cli("inspect", "--format", template, container).stdout.strip()


@attrs.define
class _Slot:
    """One engine of a kind and runtime: started, failed, or unusable here."""

    engine: Engine | None = None
    failure: str | None = None
    unusable: str | None = None


_lock = threading.Lock()
_slots: dict[tuple[str, str], _Slot] = {}


class _RuntimeUnusable(RuntimeError):
    """The engine's runtime cannot run a container on this machine (not hubd's doing)."""


def _start(kind: str, runtime: str = "runc") -> Engine:
    if sys.platform != "linux" or os.geteuid() != 0:
        raise RuntimeError(f"needs root on Linux for a private {kind} engine")
    for tool in (*_TOOLS[kind], "busybox"):
        if shutil.which(tool) is None:
            package = "busybox-static" if tool == "busybox" else _PACKAGE[kind]
            raise RuntimeError(f"needs {tool} (.ci/install-podman installs {package})")
    directory = Path(tempfile.mkdtemp(prefix="hubd-engine"))
    done = subprocess.run(
        [str(SCRIPT), "start", str(directory), runtime, kind],
        # dockerd with live-restore, as docs/operations.md recommends: restarting it keeps the
        # containers running (Podman's service never stops them).
        env={**os.environ, "HUBD_TEST_LIVE_RESTORE": "1"},
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        subprocess.run([str(SCRIPT), "stop", str(directory)], capture_output=True, check=False)
        shutil.rmtree(directory, ignore_errors=True)
        if done.returncode == 3:
            raise _RuntimeUnusable(done.stderr.strip()[-500:])
        raise RuntimeError(f".ci/container-engine start failed: {done.stderr.strip()[-500:]}")
    engine = Engine(socket=done.stdout.strip(), directory=directory, kind=kind)
    atexit.register(_stop, engine)
    return engine


def _stop(engine: Engine) -> None:
    subprocess.run(
        [str(SCRIPT), "stop", str(engine.directory)], capture_output=True, check=False, timeout=120
    )
    shutil.rmtree(engine.directory, ignore_errors=True)


def _slot(kind: str, runtime: str) -> _Slot:
    """The engine of ``kind`` and ``runtime``, started on first call, one per process."""
    with _lock:
        slot = _slots.setdefault((kind, runtime), _Slot())
        if slot.engine is None and slot.failure is None and slot.unusable is None:
            try:
                slot.engine = _start(kind, runtime)
            except _RuntimeUnusable as exc:
                slot.unusable = str(exc)
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                slot.failure = str(exc)
        return slot


def _unavailable(kind: str, what: str, failure: str) -> NoReturn:
    if kind in REQUIRED:
        pytest.fail(f"HUBD_REQUIRE_CONTAINER_ENGINE names {kind} but no {what}: {failure}")
    pytest.skip(f"no {what}: {failure}")


def engine(kind: str = "podman") -> Engine:
    """The process's engine of ``kind``, started on first call; skips (or fails, when the
    kind is required) without."""
    if kind not in ENGINES:
        raise ValueError(f"no engine kind {kind!r} (one of {', '.join(ENGINES)})")
    slot = _slot(kind, "runc")
    if slot.engine is None:
        _unavailable(kind, f"{kind} engine", str(slot.failure))
    return slot.engine


def gvisor_engine(kind: str = "podman") -> Engine:
    """An engine of the process's own of ``kind`` that runs containers under gVisor (runsc;
    on dockerd, those asking for :attr:`Engine.gvisor_runtime`), started on first call; skips
    where runsc is missing or cannot work here, and otherwise as :func:`engine` does."""
    engine(kind)  # the plain engine's verdict first: no engine is no engine, under gVisor too
    if shutil.which("runsc") is None:
        pytest.skip("no gVisor here: runsc is not installed (.ci/install-podman installs it)")
    slot = _slot(kind, "runsc")
    if slot.unusable is not None:
        pytest.skip(f"no gVisor here: {slot.unusable}")
    if slot.engine is None:
        _unavailable(kind, f"gVisor {kind} engine", str(slot.failure))
    return slot.engine


def sidecar_binds() -> list[str]:
    """Read-only binds that make this checkout's reference sidecar run in the busybox image:
    the host's /usr (libc, the dynamic loader), the interpreter's prefix, the virtualenv and
    the checkout (an editable install points there)."""
    paths: list[str] = []
    for candidate in ("/usr", sys.base_prefix, sys.prefix, str(ROOT)):
        resolved = str(Path(candidate).resolve())
        if not any(resolved == p or resolved.startswith(p + "/") for p in paths):
            paths.append(resolved)
    return [f"{path}:{path}:ro" for path in paths]


def sidecar_command() -> list[str]:
    return [sys.executable, "-m", "hubd.cli", "sidecar"]


def options(engine: Engine, **overrides: Any) -> dict[str, Any]:
    """The ``[provisioners.options]`` of a container provisioner running the reference
    sidecar on ``engine``, with host networking (the machines' bridged ranges are blocked)."""
    return {
        "socket": engine.socket,
        "image": IMAGE,
        "pull": "never",
        "command": sidecar_command(),
        "binds": sidecar_binds(),
        # ``python -m`` puts the working directory first on the path: the sidecar runs this
        # checkout's hubd, as the test does, whichever checkout the virtualenv's editable
        # install points at.
        "workdir": str(ROOT),
        "network": "host",
        "ulimits": ULIMITS,
        "stop_timeout": 2,
        **overrides,
    }


def toml_options(values: dict[str, Any]) -> str:
    """``values`` as the body of a ``[provisioners.options]`` table (no sub-tables but the
    ones named in ``values`` as dicts, written inline)."""
    import json

    def literal(value: Any) -> str:
        if isinstance(value, dict):
            return "{ " + ", ".join(f"{k} = {literal(v)}" for k, v in value.items()) + " }"
        return json.dumps(value)

    return "\n".join(f"{key} = {literal(value)}" for key, value in values.items())


def gone(exc: aiodocker.DockerError) -> bool:
    """Whether the engine's error says the container is not there: 404, or the 500 Podman
    answers for one it is removing while it is looked at (``… no such container``)."""
    return exc.status == 404 or (exc.status == 500 and "no such container" in str(exc.message))


async def containers(engine: Engine, deployment: str) -> list[dict[str, Any]]:
    """The containers (any state) labelled with ``deployment``, as the engine lists them; one
    removed between the list and its inspect (a running daemon's destroy, its orphan sweep)
    is not there."""
    import aiodocker

    async with aiodocker.Docker(url=engine.socket) as docker:
        listed = await docker.containers.list(
            all=True, filters={"label": [f"io.hubd.deployment={deployment}"]}
        )
        found = []
        for container in listed:
            try:
                found.append(await container.show())
            except aiodocker.DockerError as exc:
                if not gone(exc):
                    raise
        return found


async def remove_all(engine: Engine, deployment: str) -> None:
    """Remove every container labelled with ``deployment``, whatever its state; one already
    removed meanwhile (by a daemon still stopping it) is not an error."""
    import aiodocker

    async with aiodocker.Docker(url=engine.socket) as docker:
        for container in await docker.containers.list(
            all=True, filters={"label": [f"io.hubd.deployment={deployment}"]}
        ):
            try:
                await container.delete(force=True)
            except aiodocker.DockerError as exc:
                if not gone(exc):
                    raise


def run(coro: Any) -> Any:
    return asyncio.get_event_loop().run_until_complete(coro)
