"""The ``local`` provisioner running its sidecar under bubblewrap, with the command that
docs/plugins.md ("Sandboxed local sidecars") shows, under a real ``hubd run``.

Skipped with the reason where ``bwrap`` is missing or cannot create namespaces here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hubd.store import AllocationStore, Status
from tests.clikit import run_hubd_async
from tests.daemonkit import DaemonProcess, sidecar_pids, write_config
from tests.reconcilerkit import poll_until

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
INSTALL = "/opt/hubd"
"""Where the documented command has hubd's virtualenv; this checkout's paths replace it."""


def documented_command() -> list[str]:
    """The ``command`` of docs/plugins.md's bubblewrap example."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", text, re.S) if '"bwrap"' in b]
    assert len(blocks) == 1, "docs/plugins.md has one bubblewrap example"
    command: list[str] = tomllib.loads(blocks[0])["provisioners"][0]["options"]["command"]
    return command


def this_checkouts_binds() -> list[str]:
    """``--ro-bind`` arguments for what this checkout's sidecar runs from that ``/usr`` does
    not hold already: the interpreter's prefix, the virtualenv and the checkout (an editable
    install points there)."""
    paths: list[str] = ["/usr"]
    for candidate in (sys.base_prefix, sys.prefix, str(ROOT)):
        resolved = str(Path(candidate).resolve())
        if not any(resolved == p or resolved.startswith(p + "/") for p in paths):
            paths.append(resolved)
    return [arg for path in paths[1:] for arg in ("--ro-bind", path, path)]


def command_for_this_checkout() -> list[str]:
    """The documented command, run from this checkout instead of ``/opt/hubd``."""
    documented = documented_command()
    separator = documented.index("--")
    flags, program = documented[:separator], documented[separator + 1 :]
    assert program == [f"{INSTALL}/.venv/bin/hubd", "sidecar"]
    install = ["--ro-bind", INSTALL, INSTALL]
    at = next(i for i in range(len(flags)) if flags[i : i + 3] == install)
    del flags[at : at + 3]
    assert INSTALL not in " ".join(flags)
    # Last: bwrap mounts in order, and a checkout under /tmp (CI clones there) would be hidden
    # by the command's own --tmpfs /tmp.
    return [*flags, *this_checkouts_binds(), "--", sys.executable, "-m", "hubd.cli", "sidecar"]


@pytest.fixture(scope="module")
def bwrap() -> str:
    """``bwrap``'s path, once it has shown it can create its namespaces here."""
    found = shutil.which("bwrap")
    if found is None:
        pytest.skip("bwrap is not installed (Debian's bubblewrap; .ci/install-podman installs it)")
    probe = subprocess.run(
        [found, "--unshare-all", "--share-net", "--ro-bind", "/", "/", "--", "true"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"bwrap cannot create its namespaces here: {probe.stderr.strip()[-300:]}")
    return found


def namespace(pid: int | str, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def sidecar_process(marker: str) -> int:
    """The sidecar's interpreter among the processes carrying ``marker``: bwrap's two (the
    parent outside, PID 1 inside) carry it too, under bwrap's command line. One that exits
    between the listing and the read of its command line is not it."""
    (pid,) = [pid for pid in sidecar_pids(marker) if _program(pid) == sys.executable.encode()]
    return pid


def _program(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return None


class TestBubblewrap:
    async def test_documented_command_runs_a_sandboxed_sidecar(
        self,
        bwrap: str,
        database_url: str,
        observer: AllocationStore,
        state_dir: Path,
        marker: str,
    ) -> None:
        """With docs/plugins.md's bubblewrap command, an allocation becomes ready with its
        sidecar connected from PID, mount, IPC and UTS namespaces of its own; released, the
        sidecar and bwrap's processes are gone."""
        del bwrap  # only its verdict: the command names bwrap, found in PATH
        path = write_config(
            state_dir / "hubd.toml",
            database_url=database_url, state_dir=state_dir, marker=marker,
        )  # fmt: skip
        default = json.dumps([sys.executable, "-m", "hubd.cli", "sidecar"])
        text = path.read_text()
        assert f"command = {default}\n" in text
        path.write_text(text.replace(default, json.dumps(command_for_this_checkout())))
        env = {"HUBD_DATABASE_URL": database_url}
        daemon = DaemonProcess(path)
        await daemon.start()
        try:
            done = await run_hubd_async(
                "alloc", "request", "--provisioner", "local", "--wait", "--timeout", "60s",
                env=env,
            )  # fmt: skip
            assert done.code == 0, done.err
            allocation_id = done.out.strip()
            assert (await observer.get(allocation_id)).ready
            pid = sidecar_process(marker)
            for kind in ("pid", "mnt", "ipc", "uts"):
                assert namespace(pid, kind) != namespace("self", kind), kind

            done = await run_hubd_async("alloc", "release", allocation_id, env=env)
            assert done.code == 0, done.err

            async def released() -> bool:
                row = await observer.get(allocation_id)
                return row.status is Status.RELEASED and not sidecar_pids(marker)

            await poll_until(released, within=60, every=0.2)
        finally:
            await daemon.signal(signal.SIGTERM)
            await daemon.wait()
            await daemon.kill()
