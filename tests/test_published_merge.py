"""The provisioner's metadata and the sidecar's merge in either order (docs/api.md: the
provisioner's keys, then the sidecar's over them): whichever of the acceptance and the sidecar's
publish lands first, the view shows the same object. Real sockets, real PostgreSQL."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hubd.reconciler.writes import Abandon, AcceptAndPark, MarkAllocated, Park
from hubd.store import AllocationStore, Database, Failure, Fence, Status
from hubd.store.inputs import ParkMode
from tests.daemonkit import DaemonProcess, write_config
from tests.polling import eventually
from tests.wskit import Hub, Sidecar, dial, running_hub, sidecar_in, welcome_of

PROVISIONER = {"host": "node-1", "log": "/var/log/s.log", "zone": "a"}
SIDECAR = {"zone": "b", "port": 8080, "log": None}
MERGED = {"host": "node-1", "zone": "b", "port": 8080}
"""The provisioner's keys, the sidecar's over them, the key the sidecar removed gone."""


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db) as running:
        yield running


async def view_of(db: Database, allocation_id: str) -> tuple[str | None, Any]:
    """What an application reads: the view's endpoint and metadata."""
    async with db.pool.acquire() as conn:
        row = await conn.fetchrow(
            "SELECT endpoint, metadata FROM hubd_v1.allocations WHERE id = $1", allocation_id
        )
    assert row is not None
    metadata = row["metadata"]
    return row["endpoint"], json.loads(metadata) if isinstance(metadata, str) else metadata


async def patch_of(db: Database, allocation_id: str) -> Any:
    async with db.pool.acquire() as conn:
        return await conn.fetchval(
            "SELECT sidecar_patch FROM hubd_allocations WHERE id = $1", allocation_id
        )


async def publish(hub: Hub, sidecar: Sidecar, *more: dict[str, Any], **fields: Any) -> None:
    """The sidecar connects (for the first time: its token alone opens it), publishes
    ``fields``, then each of ``more``, each waiting for its answer."""
    async with dial(hub.url, sidecar.headers()) as ws:
        await welcome_of(ws)
        await ws.send(json.dumps({"type": "welcome_ack"}))
        for each in (fields, *more):
            await ws.send(json.dumps({"type": "publish", **each}))
            assert json.loads(await ws.recv()) == {"type": "published"}


async def accept(
    store: AllocationStore, fence: Fence, how: str, metadata: dict[str, Any] | None
) -> None:
    """The provisioner's acceptance, as the claim writes it: ``mark_allocated`` (before an
    on-ready hook) or ``park`` with ``accept`` (the common path)."""
    if how == "mark_allocated":
        done = await store.write(
            fence,
            MarkAllocated(
                external_ref="ref-1", endpoint="http://provisioner:1", metadata=metadata
            ).transition(),
        )
    else:
        done = await store.write(
            fence,
            AcceptAndPark(
                accepted=MarkAllocated(
                    external_ref="ref-1", endpoint="http://provisioner:1", metadata=metadata
                ),
                park=Park(mode=ParkMode.AWAIT_CONNECTION, delay=60),
            ).transition(),
        )
    assert done is not None
    assert done.status is Status.ALLOCATED


ACCEPTANCES = ["mark_allocated", "park"]


class TestEitherOrder:
    @pytest.mark.parametrize("how", ACCEPTANCES)
    async def test_sidecar_first(
        self, db: Database, store: AllocationStore, hub: Hub, how: str
    ) -> None:
        """A sidecar that publishes before the acceptance is recorded keeps its keys and its
        endpoint; the provisioner's keys go under them, and a key the sidecar removed stays
        removed."""
        sidecar, fence = await sidecar_in(store, db, Status.PROVISIONING)
        await publish(hub, sidecar, endpoint="http://sidecar:2", metadata=SIDECAR)
        assert await view_of(db, sidecar.allocation_id) == (
            "http://sidecar:2",
            {"zone": "b", "port": 8080},
        )
        await accept(store, fence, how, PROVISIONER)
        assert await view_of(db, sidecar.allocation_id) == ("http://sidecar:2", MERGED)
        assert await patch_of(db, sidecar.allocation_id) is None

    @pytest.mark.parametrize("how", ACCEPTANCES)
    async def test_acceptance_first(
        self, db: Database, store: AllocationStore, hub: Hub, how: str
    ) -> None:
        """The same publish after the acceptance gives the same view."""
        sidecar, fence = await sidecar_in(store, db, Status.PROVISIONING)
        await accept(store, fence, how, PROVISIONER)
        assert await view_of(db, sidecar.allocation_id) == ("http://provisioner:1", PROVISIONER)
        await publish(hub, sidecar, endpoint="http://sidecar:2", metadata=SIDECAR)
        assert await view_of(db, sidecar.allocation_id) == ("http://sidecar:2", MERGED)
        assert await patch_of(db, sidecar.allocation_id) is None

    async def test_several_publishes_before_the_acceptance(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """Publishes before the acceptance add up as one patch: a key given and later
        removed, or removed and later given, ends as the last publish said."""
        sidecar, fence = await sidecar_in(store, db, Status.PROVISIONING)
        await publish(
            hub,
            sidecar,
            {"metadata": {"zone": None, "host": "mine"}},
            metadata={"host": None, "zone": "c"},
        )
        await accept(store, fence, "park", PROVISIONER)
        assert (await view_of(db, sidecar.allocation_id))[1] == {
            "host": "mine",
            "log": "/var/log/s.log",
        }

    async def test_no_provisioner_metadata(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """A provisioner that says nothing leaves the sidecar's metadata as it published it."""
        sidecar, fence = await sidecar_in(store, db, Status.PROVISIONING)
        await publish(hub, sidecar, metadata=SIDECAR)
        await accept(store, fence, "park", None)
        assert (await view_of(db, sidecar.allocation_id))[1] == {"zone": "b", "port": 8080}

    async def test_a_merge_past_the_cap_keeps_the_sidecar_alone(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """When the two together would pass 16 KiB, the acceptance still lands and keeps
        what the sidecar published, its word being the later one."""
        sidecar, fence = await sidecar_in(store, db, Status.PROVISIONING)
        await publish(hub, sidecar, metadata={"mine": "x" * 9000})
        await accept(store, fence, "park", {"theirs": "y" * 9000})
        assert (await view_of(db, sidecar.allocation_id))[1] == {"mine": "x" * 9000}

    async def test_a_new_generation_forgets_the_patch(
        self, db: Database, store: AllocationStore, hub: Hub
    ) -> None:
        """What a generation's sidecar published before its acceptance goes with the
        generation: its replacement starts with nothing."""
        sidecar, fence = await sidecar_in(store, db, Status.PROVISIONING)
        await publish(hub, sidecar, metadata=SIDECAR)
        assert await patch_of(db, sidecar.allocation_id) == SIDECAR
        replaced = await store.write(
            fence,
            Abandon(
                release=False,
                expected=Status.PROVISIONING,
                delay=0,
                failure=Failure("ensure_failed", "test"),
            ).transition(),
        )
        assert replaced is not None
        assert await patch_of(db, sidecar.allocation_id) is None
        assert await view_of(db, sidecar.allocation_id) == (None, None)


class TestLocalSidecars:
    @pytest.mark.timeout(240)
    async def test_every_local_allocation_shows_both(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """``hubd run`` with the ``local`` provisioner and ``hubd sidecar --publish``: every one
        of ten allocations, whichever of the acceptance and the sidecar's publish landed first,
        shows the provisioner's keys (host, log) and the sidecar's (role)."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        command = json.dumps([sys.executable, "-m", "hubd.cli", "sidecar"])
        published = json.dumps(
            [sys.executable, "-m", "hubd.cli", "sidecar", "--publish", "role=worker"]
        )
        config.write_text(config.read_text().replace(command, published))
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            ids = [(await observer.request(provisioner_id="local")).id for _ in range(10)]

            async def shown() -> bool:
                rows = [await observer.get(i) for i in ids]
                return all(r.ready and "role" in (r.metadata or {}) for r in rows)

            await eventually(shown, within=90, every=0.2, what="every sidecar's publish")
            for allocation_id in ids:
                metadata = (await observer.get(allocation_id)).metadata or {}
                assert {"host", "log", "pid", "role"} <= set(metadata), metadata
            await daemon.signal(signal.SIGTERM)
            assert await daemon.wait() == 0
        finally:
            await daemon.kill()
