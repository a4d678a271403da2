"""What a sidecar is told and what it tells: the welcome's spec, tenant and session, its publish
and its declared readiness (architecture §4), over real sockets and real PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from websockets.typing import Subprotocol

from hubd.store import AllocationStore, Database
from tests.wskit import Hub, Sidecar, dial, running_hub, sidecar_in, welcome_of


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db) as running:
        yield running


async def serve_for(
    db: Database, sidecar: Sidecar, *, spec: dict[str, Any], tenant: str, session: str
) -> None:
    """Give the sidecar's allocation what an application requested with."""
    async with db.pool.acquire() as conn:
        await conn.execute(
            "UPDATE hubd_allocations SET spec = $2::text::jsonb, tenant_id = $3, session_id = $4"
            " WHERE id = $1",
            sidecar.allocation_id,
            json.dumps(spec),
            tenant,
            session,
        )


class TestWelcome:
    @pytest.mark.parametrize("version", ["hubd.sidecar.v2", "hubd.sidecar.v1"])
    async def test_welcome_says_what_the_sidecar_serves(
        self, db: Database, store: AllocationStore, hub: Hub, version: str
    ) -> None:
        """The welcome of either protocol version carries the allocation's spec, tenant and
        session, and how it becomes ready."""
        sidecar, _ = await sidecar_in(store, db)
        spec = {"image": "worker:1", "limits": {"cpu": 2}, "tags": ["a", "b"]}
        await serve_for(db, sidecar, spec=spec, tenant="acme", session="s-42")
        async with dial(hub.url, sidecar.headers(), subprotocols=[Subprotocol(version)]) as ws:
            welcome = await welcome_of(ws)
        assert welcome["spec"] == spec
        assert welcome["tenant"] == "acme"
        assert welcome["session"] == "s-42"
        assert welcome["ready_when"] == "connected"
        assert ("reconnect_secret" in welcome) == (version == "hubd.sidecar.v2")

    async def test_unlabelled_allocation(self, hub: Hub, sidecar: Sidecar) -> None:
        """An allocation requested without tenant or session says so with nulls, and an
        empty spec."""
        async with dial(hub.url, sidecar.headers()) as ws:
            welcome = await welcome_of(ws)
        assert (welcome["spec"], welcome["tenant"], welcome["session"]) == ({}, None, None)
