"""The HTTP API under ``hubd run``: keys made with ``hubd api-key``, a sidecar requested over
HTTP becomes ready (the local provisioner, a real process), and a revoked key is refused at
once."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hubd.store import AllocationStore, Status
from tests.clikit import run_hubd_async
from tests.daemonkit import running, sidecar_pids, write_config
from tests.polling import eventually

pytestmark = pytest.mark.timeout(180)


async def test_request_wait_release_over_http(
    database_url: str, observer: AllocationStore, marker: str, state_dir: Path
) -> None:
    env = {"HUBD_DATABASE_URL": database_url}
    made = await run_hubd_async("api-key", "create", "--tenant", "acme", "--name", "ci", env=env)
    assert made.code == 0, made.err
    key = made.out.strip()
    assert key.startswith("hubd_")
    assert key not in made.err
    config = write_config(
        state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
    )
    async with running(config, env={**env, "HUBD_HTTP_LISTEN": "127.0.0.1:0"}) as daemon:
        announced = next(line for line in daemon.lines if line.get("event") == "hubd_running")
        url = f"http://{announced['http']}"
        headers = {"Authorization": f"Bearer {key}"}
        async with aiohttp.ClientSession(headers=headers) as http:

            async def call(method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
                async with http.request(method, url + path, **kwargs) as response:
                    return response.status, await response.json()

            status, created = await call(
                "POST", "/v1/allocations", json={"provisioner": "local", "session": "s-1"}
            )
            assert (status, created["tenant"]) == (201, "acme"), created
            status, ready = await call(
                "GET", f"/v1/allocations/{created['id']}/wait?until=ready&timeout=60"
            )
            assert (status, ready["ready"]) == (200, True), ready
            assert ready["metadata"]["pid"] in sidecar_pids(marker)
            status, released = await call("POST", f"/v1/allocations/{created['id']}/release")
            assert (status, released["status"]) == (200, "releasing")
            status, ended = await call(
                "GET", f"/v1/allocations/{created['id']}/wait?until=ended&timeout=60"
            )
            assert (status, ended["status"]) == (200, "released")
            assert (await observer.get(created["id"])).status is Status.RELEASED
            listed = await run_hubd_async("api-key", "list", "--json", env=env)
            keys = json.loads(listed.out)
            assert [(k["tenant"], k["name"]) for k in keys] == [("acme", "ci")]
            assert key.split(".", 1)[1] not in listed.out
            revoked = await run_hubd_async("api-key", "revoke", keys[0]["id"], env=env)
            assert revoked.code == 0, revoked.err
            status, refused = await call("GET", "/v1/allocations")
            assert (status, refused["error"]["code"]) == (401, "unauthorized")
        await eventually(lambda: not sidecar_pids(marker), within=30, every=0.2)
    logged = "\n".join(json.dumps(line) for line in daemon.lines)
    assert key.split(".", 1)[1] not in logged


EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "http"


async def test_the_node_client_runs(
    database_url: str, marker: str, state_dir: Path, tmp_path: Path
) -> None:
    """``examples/http/demo.mjs`` (fetch, no dependencies) against a real daemon: requested,
    followed over the event stream until ready, released and ended."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH (CI has it)")
    env = {"HUBD_DATABASE_URL": database_url}
    key = (await run_hubd_async("api-key", "create", "--tenant", "acme", env=env)).out.strip()
    config = write_config(
        state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
    )
    async with running(config, env={**env, "HUBD_HTTP_LISTEN": "127.0.0.1:0"}) as daemon:
        announced = next(line for line in daemon.lines if line.get("event") == "hubd_running")
        process = await asyncio.create_subprocess_exec(
            node,
            str(EXAMPLE / "demo.mjs"),
            "local",
            env={**os.environ, "HUBD_HTTP_URL": f"http://{announced['http']}", "HUBD_KEY": key},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, err.decode()
    steps = {line["step"]: line for line in map(json.loads, out.decode().splitlines())}
    assert steps["requested"]["tenant"] == "acme"
    assert steps["events"]["events"][0] == "requested"
    assert steps["events"]["events"][-1] == "ready"
    assert (steps["ready"]["outcome"], steps["ready"]["ready"]) == ("ready", True)
    assert (steps["ended"]["status"], steps["ended"]["end_reason"]) == ("released", "application")
