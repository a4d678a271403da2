"""``hubd dev`` as a real process: its own state dir, its own work, an honest stop."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from hubd.config import Config, StateConfig
from hubd.daemon.dev import dev_config
from hubd.store import AllocationStore, Status
from tests.clikit import Result, hubd_env, run_hubd, run_hubd_async
from tests.daemonkit import DaemonProcess, kill_writing_under
from tests.polling import eventually

pytestmark = pytest.mark.timeout(180)

READY = "is READY"
ANY_PORTS = {"HUBD_SERVER_LISTEN": "127.0.0.1:0", "HUBD_ADMIN_LISTEN": "127.0.0.1:0"}


@pytest.fixture
def home() -> Iterator[Path]:
    # Short: the embedded server's Unix socket lives under it.
    with tempfile.TemporaryDirectory(prefix="hubd-v") as path:
        try:
            yield Path(path)
        finally:
            # Sidecars of a dev that ended without releasing its work (one test stops it on
            # purpose) keep dialling a hub that is gone; their logs are under its state dir.
            kill_writing_under(Path(path))


async def run_python(script: str) -> Result:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        env=hubd_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        out, err = await process.communicate()
    assert process.returncode is not None
    return Result(process.returncode, out.decode(), err.decode())


def demo_id(process: DaemonProcess) -> str:
    found = re.search(r"(al_[0-9a-f]{32}) is READY", process.output)
    assert found is not None, process.output
    return found.group(1)


async def shows_what_was_published_and_works_as_printed(
    dev: DaemonProcess, state: Path, allocation_id: str
) -> None:
    """The demo's endpoint and metadata are shown (the local provisioner's metadata at least:
    the sidecar's pid), and the application's three lines dev prints, run as printed against
    the DSN `hubd db-url` gives, get a ready sidecar and its metadata."""
    shown = re.search(r"\n    endpoint: (.*)\n    metadata: (.*)\n", dev.output)
    assert shown is not None, dev.output
    metadata = json.loads(shown.group(2))
    assert isinstance(metadata["pid"], int)
    db_url = await run_hubd_async("db-url", env={"HUBD_STATE_DIR": str(state)})
    assert db_url.code == 0, db_url.err
    dsn = db_url.out.strip()
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT endpoint, metadata FROM hubd_v1.allocations WHERE id = $1", allocation_id
        )
    finally:
        await conn.close()
    assert row is not None
    assert json.loads(row["metadata"])["pid"] == metadata["pid"]
    text = dev.output
    start = text.index("  async with await Client.connect(")
    lines = text[start : text.index("\nTry, in another terminal:", start)].splitlines()
    assert lines[0] == f"  async with await Client.connect({dsn!r}) as hubd:"
    assert len(lines) == 4
    body = "\n".join(line[2:] for line in lines)
    script = (
        "import asyncio\nfrom hubd.client import Client\n\n\nasync def main():\n"
        + textwrap.indent(body, "    ")
        + "\n        await hubd.release(allocation.id)\n\n\nasyncio.run(main())\n"
    )
    ran = await run_python(script)
    assert ran.code == 0, ran.err
    assert "'pid': " in ran.out


class TestRefusal:
    def test_refuses_a_database_url_from_the_environment(self) -> None:
        """dev refuses HUBD_DATABASE_URL with exit 2, naming the variable and the flag that
        allows it, without the password."""
        result = run_hubd(
            "dev", env={"HUBD_DATABASE_URL": "postgresql://u:pw-canary@127.0.0.1:1/x"}
        )
        assert result.code == 2
        assert "HUBD_DATABASE_URL" in result.err
        assert "--allow-external-database" in result.err
        assert "pw-canary" not in result.out + result.err

    def test_refuses_a_database_url_from_the_config(self, tmp_path: Path) -> None:
        """dev refuses database.url from a config file (given before the command), naming the
        key and the file."""
        path = tmp_path / "hubd.toml"
        path.write_text('[database]\nurl = "postgresql://u:pw-canary@db/hubd"\n')
        result = run_hubd("--config", str(path), "dev")
        assert result.code == 2
        assert f"database.url in {path}" in result.err
        assert "pw-canary" not in result.out + result.err


class TestStateDir:
    @pytest.mark.parametrize("euid", [0, 1000])
    def test_dev_has_a_state_dir_of_its_own(
        self, monkeypatch: pytest.MonkeyPatch, home: Path, euid: int
    ) -> None:
        """With state.dir empty, dev's state dir is hubd-dev beside run's hubd: /var/lib for
        root, the user data dir otherwise; an explicit state.dir is honoured."""
        monkeypatch.setattr(os, "geteuid", lambda: euid)
        monkeypatch.setenv("XDG_DATA_HOME", str(home))
        base = Path("/var/lib") if euid == 0 else home
        assert Config().state_path == base / "hubd"
        assert dev_config(Config()).state_path == base / "hubd-dev"
        explicit = Config(state=StateConfig(dir=str(home / "mine")))
        assert dev_config(explicit).state_path == home / "mine"


class TestOwnWork:
    async def test_follow_up_commands_reach_its_database(self, home: Path) -> None:
        """dev prints follow-up commands that reach its own database (the state dir, the
        config file), the demo's endpoint and metadata and an application's three lines that
        work as printed, and Ctrl-C releases its demo and exits 0."""
        state = home  # its parents must be world-searchable for a root-run embedded server
        config = home / "hubd.toml"
        config.write_text('[log]\nlevel = "info"\n')
        env = {"HUBD_STATE_DIR": str(state), **ANY_PORTS}
        dev = DaemonProcess(None, env, args=("dev", "--config", str(config)))
        try:
            await dev.start(ready_text=READY)
            allocation_id = demo_id(dev)
            assert f"Data: {state / 'pgdata'}" in dev.output
            listing = await dev.wait_for_text(" alloc list")
            assert f"HUBD_CONFIG={config} HUBD_STATE_DIR={state} " in listing
            await shows_what_was_published_and_works_as_printed(dev, state, allocation_id)
            await dev.signal(signal.SIGINT)
            assert await dev.wait(within=60) == 0, dev.output
        finally:
            await dev.kill()
        assert "releasing 1 allocation(s) this session requested" in dev.output
        listed = run_hubd(
            "alloc",
            "list",
            "--json",
            env={"HUBD_STATE_DIR": str(state), "HUBD_CONFIG": str(config)},
        )
        assert listed.code == 0, listed.err
        # The demo, and the allocation the application's lines requested and released.
        rows = json.loads(listed.out)
        assert allocation_id in [a["id"] for a in rows]
        assert [a["status"] for a in rows] == ["released", "released"]

    async def test_releases_only_what_it_requested(
        self, database_url: str, observer: AllocationStore, home: Path
    ) -> None:
        """On a shared database (allowed explicitly) dev's Ctrl-C releases its own demo and
        leaves an allocation someone else requested active, saying so."""
        theirs = await observer.request(provisioner_id="local", session_id="production")
        env = {
            "HUBD_DATABASE_URL": database_url,
            "HUBD_STATE_DIR": str(home),
            **ANY_PORTS,
        }
        dev = DaemonProcess(None, env, args=("dev", "--allow-external-database"))
        try:
            await dev.start(ready_text=READY)
            mine = demo_id(dev)
            await eventually(
                lambda: _ready(observer, theirs.id), within=60, what="their allocation ready"
            )
            await dev.signal(signal.SIGINT)
            assert await dev.wait(within=60) == 0, dev.output
        finally:
            await dev.kill()
        assert (await observer.get(mine)).status is Status.RELEASED
        assert (await observer.get(theirs.id)).status is Status.ALLOCATED
        assert f"did not request active: {theirs.id}" in dev.output

    async def test_stranded_release_exits_1_naming_the_mismatch(
        self, database_url: str, observer: AllocationStore, home: Path
    ) -> None:
        """When dev's demo is bound to another binding than dev's local provisioner, Ctrl-C
        does not wait out the grace: dev names the mismatch (both fingerprints) and what was
        left, and exits 1."""
        env = {
            "HUBD_DATABASE_URL": database_url,
            "HUBD_STATE_DIR": str(home),
            **ANY_PORTS,
        }
        dev = DaemonProcess(None, env, args=("dev", "--allow-external-database"))
        try:
            await dev.start(ready_text=READY)
            mine = demo_id(dev)
            # As if another daemon, configured otherwise, had bound it.
            conn = await asyncpg.connect(database_url)
            try:
                await conn.execute(
                    "UPDATE hubd_allocations SET provisioner_binding_fingerprint = $2 "
                    "WHERE id = $1",
                    mine,
                    "f" * 64,
                )
            finally:
                await conn.close()
            await dev.signal(signal.SIGINT)
            code = await dev.wait(within=60)
        finally:
            await dev.kill()
        assert code == 1, dev.output
        assert "stopped before the release finished" in dev.output
        assert f"{mine} releasing: provisioner local binding changed" in dev.output
        assert "f" * 12 in dev.output
        assert (await observer.get(mine)).status is Status.RELEASING


async def _ready(store: AllocationStore, allocation_id: str) -> bool:
    return (await store.get(allocation_id)).ready
