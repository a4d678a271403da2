"""Deadlines across two real ``hubd run`` replicas on one database, one of them stopped (SIGSTOP)
while a few dozen lifetimes end: the other ends every one, once, and the stopped one, once it
runs again, moves none of them a second time. The sidecars are the benchmark's farm (one process
holding a websocket per allocation) behind its instant provisioner, so that a few dozen
allocations cost a few dozen sockets rather than a few dozen processes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from bench.procs import FarmClient
from hubd.store import AllocationStore, Database
from tests.daemonkit import DaemonProcess, http_get, write_config
from tests.polling import eventually, scaled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

N = 30
HOUR = 3600.0
ROOT = Path(__file__).resolve().parent.parent
"""The checkout: the daemons import the farm's provisioner (``bench.plugin``) from it."""

READY = (
    "SELECT count(*) FROM hubd_allocations "
    "WHERE id = ANY($1::text[]) AND status = 'allocated' AND connection_ready"
)
# Every lifetime end: one ledger row 'expire', written by the replica whose sweep moved it.
EXPIRES = (
    "SELECT allocation_id, instance_id FROM hubd_allocation_ledger "
    "WHERE allocation_id = ANY($1::text[]) AND kind = 'expire'"
)
# How late each end began after its moment, on the database's clock: its first 'expired' event.
LATENESS = (
    "SELECT DISTINCT ON (allocation_id) extract(epoch FROM at - expires_at)::float8 "
    "FROM hubd_events WHERE allocation_id = ANY($1::text[]) AND end_reason = 'expired' "
    "ORDER BY allocation_id, position"
)


@pytest.fixture
async def farm(state_dir: Path) -> AsyncIterator[FarmClient]:
    farm = FarmClient(state_dir / "farm.sock")
    await farm.start()
    try:
        yield farm
    finally:
        await farm.stop()


def _replica(name: str, *, database_url: str, state_dir: Path, marker: str, farm: Path) -> Path:
    (state_dir / name).mkdir()
    return write_config(
        state_dir / f"hubd-{name}.toml",
        database_url=database_url,
        state_dir=state_dir / name,
        marker=marker,
        plugin="bench.plugin:create",
        plugin_options=f'farm = "{farm}"',
    )


async def _expired_by(daemon: DaemonProcess) -> float:
    """The replica's own count of lifetimes it ended (``hubd_deadlines_total``)."""
    status, body = await http_get(daemon.admin_url + "/metrics")
    assert status == 200
    found = re.search(r'^hubd_deadlines_total\{kind="expired"\} (\S+)$', body, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


async def test_a_stopped_replica_makes_no_lifetime_end_twice_or_never(
    database_url: str, db: Database, store: AllocationStore, marker: str, state_dir: Path,
    farm: FarmClient,
) -> None:  # fmt: skip
    configs = [
        _replica(
            name,
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            farm=farm.socket_path,
        )
        for name in ("a", "b")
    ]
    a, b = (DaemonProcess(config, {"PYTHONPATH": str(ROOT)}) for config in configs)
    pool = db.pool
    async with AsyncExitStack() as stack:
        for daemon in (a, b):
            stack.push_async_callback(daemon.kill)
            await daemon.start()
        ids = [(await store.request(provisioner_id="local", lifetime=HOUR)).id for _ in range(N)]

        async def all_ready() -> bool:
            return int(await pool.fetchval(READY, ids)) == N

        await eventually(all_ready, within=60, every=0.1, what="every allocation ready")

        assert b.process is not None
        os.kill(b.process.pid, signal.SIGSTOP)
        # Resumed whatever happens, so that the kill at the end is not left waiting.
        stack.callback(_resume, b.process.pid)
        # Their ends spread over the next few seconds, all while B is stopped.
        for index, allocation_id in enumerate(ids):
            await store.extend(allocation_id, scaled(1.0) + index * scaled(2.0) / N)

        async def all_ended() -> bool:
            return len(await pool.fetch(EXPIRES, ids)) >= N

        await eventually(all_ended, within=scaled(30), every=0.1, what="every lifetime ended")
        ends = [tuple(row) for row in await pool.fetch(EXPIRES, ids)]
        assert sorted(allocation_id for allocation_id, _ in ends) == sorted(ids)
        late = [float(row[0]) for row in await pool.fetch(LATENESS, ids)]
        assert len(late) == N
        # A stopped replica does not hold the other's sweep back (the bench measures how
        # prompt it is; this bound only says it did not wait for B).
        assert max(late) < scaled(5), late
        a_instance = (await a.wait_for_log("hubd_running"))["instance_id"]
        b_instance = (await b.wait_for_log("hubd_running"))["instance_id"]
        assert {instance for _, instance in ends} <= {a_instance, b_instance}

        # B runs again and A stops: the next lifetime to end can only be ended by B, so once it
        # is, B's sweeps since its resumption have run, and moved nothing already moved.
        _resume(b.process.pid)
        await a.signal(signal.SIGTERM)
        assert await a.wait(within=60) == 0
        control = (await store.request(provisioner_id="local", lifetime=scaled(2.0))).id

        async def control_ended() -> bool:
            return bool(await pool.fetch(EXPIRES, [control]))

        await eventually(control_ended, within=scaled(30), every=0.1, what="B's sweep")
        after = [tuple(row) for row in await pool.fetch(EXPIRES, [*ids, control])]
        assert sorted(after) == sorted([*ends, (control, b_instance)])
        by_b = sum(1 for _, instance in after if instance == b_instance)
        assert await _expired_by(b) == by_b
        await b.signal(signal.SIGTERM)
        assert await b.wait(within=60) == 0
