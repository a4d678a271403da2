"""A private container engine for the tests (``.ci/container-engine``), started once per test
process on first use and stopped when the process exits, and the options that run the
reference sidecar (this checkout, this interpreter) in it.

No engine (not root, no Podman, no busybox, or it fails to start) skips the tests that need
one, with the reason; under ``HUBD_REQUIRE_CONTAINER_ENGINE=1`` (set by ``.ci/run`` where
``.ci/install-podman`` started an engine) it fails them instead.

A second engine runs every container under gVisor (``.ci/container-engine start DIR runsc``)
for the tests of a sandboxed runtime. Where runsc is missing or cannot run a container here
(the script's own probe, exit 3), those tests skip with the reason even under that variable:
what is required is that gVisor works wherever it can.
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
from typing import TYPE_CHECKING, Any

import attrs
import pytest

if TYPE_CHECKING:
    import aiodocker

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / ".ci" / "container-engine"
IMAGE = "localhost/hubd-sidecar-base:latest"
REQUIRED = os.environ.get("HUBD_REQUIRE_CONTAINER_ENGINE") == "1"
# The VM's hard limits are below what the engine would otherwise ask of the runtime.
ULIMITS = {"nofile": [1024, 20000], "nproc": [4096, 4096]}


@attrs.frozen
class Engine:
    socket: str
    """``unix://…``"""
    directory: Path

    @property
    def path(self) -> str:
        return self.socket.removeprefix("unix://")

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The Podman CLI on this engine's storage (what a test inspects, never the code)."""
        return subprocess.run(
            ["podman", "--root", str(self.directory / "storage"),
             "--runroot", str(self.directory / "run"), "--tmpdir", str(self.directory / "tmp"),
             *args],
            env={**os.environ, "CONTAINERS_CONF": str(self.directory / "containers.conf")},
            capture_output=True, text=True, check=check, timeout=60,
        )  # fmt: skip


_lock = threading.Lock()
_engine: Engine | None = None
_failure: str | None = None
_gvisor: Engine | None = None
_gvisor_failure: str | None = None
_gvisor_unusable: str | None = None


class _RuntimeUnusable(RuntimeError):
    """The engine's runtime cannot run a container on this machine (not hubd's doing)."""


def _start(runtime: str = "runc") -> Engine:
    if sys.platform != "linux" or os.geteuid() != 0:
        raise RuntimeError("needs root on Linux for a private Podman engine")
    for tool in ("podman", "busybox"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"needs {tool} (.ci/install-podman installs it)")
    directory = Path(tempfile.mkdtemp(prefix="hubd-engine"))
    done = subprocess.run(
        [str(SCRIPT), "start", str(directory), runtime],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    if done.returncode != 0:
        subprocess.run([str(SCRIPT), "stop", str(directory)], capture_output=True, check=False)
        shutil.rmtree(directory, ignore_errors=True)
        if done.returncode == 3:
            raise _RuntimeUnusable(done.stderr.strip()[-500:])
        raise RuntimeError(f".ci/container-engine start failed: {done.stderr.strip()[-500:]}")
    engine = Engine(socket=done.stdout.strip(), directory=directory)
    atexit.register(_stop, engine)
    return engine


def _stop(engine: Engine) -> None:
    subprocess.run(
        [str(SCRIPT), "stop", str(engine.directory)], capture_output=True, check=False, timeout=120
    )
    shutil.rmtree(engine.directory, ignore_errors=True)


def engine() -> Engine:
    """The process's engine, started on first call; skips (or fails, when required) without."""
    global _engine, _failure  # noqa: PLW0603 -- one engine per test process, made on demand
    with _lock:
        if _engine is None and _failure is None:
            try:
                _engine = _start()
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                _failure = str(exc)
    if _engine is not None:
        return _engine
    assert _failure is not None
    if REQUIRED:
        pytest.fail(f"HUBD_REQUIRE_CONTAINER_ENGINE=1 but no container engine: {_failure}")
    pytest.skip(f"no container engine: {_failure}")


def gvisor_engine() -> Engine:
    """An engine of the process's own whose every container runs under gVisor (runsc),
    started on first call; skips where runsc is missing or cannot work here, and otherwise
    as :func:`engine` does."""
    global _gvisor, _gvisor_failure, _gvisor_unusable  # noqa: PLW0603 -- as engine()
    engine()  # the plain engine's verdict first: no Podman is no Podman, under gVisor too
    with _lock:
        if _gvisor is None and _gvisor_failure is None and _gvisor_unusable is None:
            if shutil.which("runsc") is None:
                _gvisor_unusable = "runsc is not installed (.ci/install-podman installs it)"
            else:
                try:
                    _gvisor = _start("runsc")
                except _RuntimeUnusable as exc:
                    _gvisor_unusable = str(exc)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    _gvisor_failure = str(exc)
    if _gvisor is not None:
        return _gvisor
    if _gvisor_unusable is not None:
        pytest.skip(f"no gVisor here: {_gvisor_unusable}")
    assert _gvisor_failure is not None
    if REQUIRED:
        pytest.fail(f"HUBD_REQUIRE_CONTAINER_ENGINE=1 but no gVisor engine: {_gvisor_failure}")
    pytest.skip(f"no gVisor engine: {_gvisor_failure}")


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
