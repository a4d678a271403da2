"""Warm pools under ``hubd run`` with the ``local`` provisioner: the daemon fills its pool with
real sidecars, a request takes one ready at once, and the pool is made whole again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hubd.store import Database
from hubd.store.pools import PoolStore
from tests.clikit import run_hubd_async
from tests.daemonkit import http_get, kill_sidecars, running, sidecar_generations, write_config
from tests.polling import eventually

POOL = '[[pools]]\nid = "warm"\nprovisioner = "local"\nsize = 2\nrefill_rate = 50\n'

# The sidecar's command: says where its context file is (<dir>/<allocation id>.path, replaced
# whole so a reader never sees half of it), then waits for its stop signal, as a sidecar's
# service runs until it is stopped. A member may be ready (connected) before its command has
# written the file, so a reader waits for the file to appear.
SAY_CONTEXT = """
import os, pathlib, signal, sys
name = os.environ["HUBD_ALLOCATION_ID"] + ".path"
partial = pathlib.Path(sys.argv[1], name + ".partial")
partial.write_text(os.environ["HUBD_CONTEXT_FILE"])
partial.replace(pathlib.Path(sys.argv[1], name))
signal.pause()
"""


async def test_a_request_takes_a_live_sidecar_and_the_pool_is_refilled(
    database_url: str, db: Database, marker: str, state_dir: Path
) -> None:
    config = write_config(
        state_dir / "hubd.toml",
        database_url=database_url,
        state_dir=state_dir,
        marker=marker,
        extra=POOL,
        sidecar_args=("--", sys.executable, "-c", SAY_CONTEXT, str(state_dir)),
    )
    pools = PoolStore(db, instance_id="observer")

    async def ready_members() -> int:
        stats = await pools.stats()
        return stats[0].ready if stats else 0

    async def full() -> bool:
        return await ready_members() == 2

    async with running(config, env={"HUBD_DATABASE_URL": database_url}) as daemon:
        await eventually(full, within=60, every=0.2)
        assert len(_sidecars(marker)) == 2
        made = await db.pool.fetchrow("SELECT * FROM hubd_v1.request('local', 'acme')")
        assert made is not None
        assert (made["warm"], made["ready"], made["tenant"]) == (True, True, "acme")
        # The sidecar is told its session over its socket; its command reads it in the
        # context file, and the sidecar's acknowledgement is recorded after that.
        said = state_dir / f"{made['id']}.path"

        def handed_over() -> bool:
            if not said.exists():
                return False
            context = json.loads(Path(said.read_text()).read_text())
            return (context["tenant"], context["session"]) == ("acme", None)

        await eventually(handed_over, within=60, every=0.2)

        async def acknowledged() -> bool:
            pending = await db.pool.fetchval(
                "SELECT handover_pending FROM hubd_allocations WHERE id = $1", made["id"]
            )
            return pending is False

        await eventually(acknowledged, within=60, every=0.2)
        # The taken sidecar keeps running for its tenant; a new member joins the pool.
        await eventually(full, within=60, every=0.2)
        assert len(_sidecars(marker)) == 3
        released = await db.pool.fetchrow("SELECT * FROM hubd_v1.release($1)", made["id"])
        assert released is not None

        async def gone() -> bool:
            status = await db.pool.fetchval(
                "SELECT status FROM hubd_allocations WHERE id = $1", made["id"]
            )
            return status == "released" and len(_sidecars(marker)) == 2

        await eventually(gone, within=60, every=0.2)
        assert await ready_members() == 2
        env = {"HUBD_DATABASE_URL": database_url}
        listed = await run_hubd_async("alloc", "pools", "--json", env=env)
        assert listed.code == 0, listed.err
        [pool] = json.loads(listed.out)
        assert (pool["id"], pool["size"], pool["ready"], pool["taken"]) == ("warm", 2, 2, 1)
        shown = await run_hubd_async("alloc", "show", made["id"], "--json", env=env)
        assert shown.code == 0, shown.err
        detail = json.loads(shown.out)
        assert (detail["pool"], detail["handover_pending"]) == ("warm", False)
        assert detail["taken_at"] is not None

        scrapes: list[str] = []

        async def scraped() -> bool:
            scrapes.append((await http_get(daemon.admin_url + "/metrics"))[1])
            return 'hubd_pool_takes_total{pool="warm"} 1.0' in scrapes[-1]

        await eventually(scraped, within=30, every=0.5)
        metrics = scrapes[-1]
        assert 'hubd_pool_members{pool="warm",state="ready"} 2.0' in metrics
        assert 'hubd_pool_size{pool="warm"} 2.0' in metrics

        # Members whose sidecars die are replaced, and no application hears of them.
        events = await db.pool.fetchval("SELECT count(*) FROM hubd_v1.events")
        kill_sidecars(marker)

        async def replaced() -> bool:
            return len(_sidecars(marker)) == 2 and await full()

        await eventually(replaced, within=60, every=0.2)
        assert await db.pool.fetchval("SELECT count(*) FROM hubd_v1.events") == events


def _sidecars(marker: str) -> set[str]:
    """The allocations with a live sidecar (the sidecar and its command carry the marker)."""
    return {allocation for allocation, _ in sidecar_generations(marker)}
