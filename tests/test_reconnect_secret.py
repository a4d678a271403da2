"""Protocol v2's reconnect secret: a generation's identity is bound to its latest connection, so a
token copied from a sidecar's environment opens nothing once that sidecar has connected.

Real websockets on loopback, real PostgreSQL; two hubs on one database stand for two replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from hubd.backoff import Backoff
from hubd.sidecar.client import SidecarClient, SidecarExit
from hubd.sidecar.settings import SidecarSettings
from hubd.store import Database
from hubd.store.connection_values import RecordOutcome
from hubd.store.connections import ConnectionStore
from hubd.store.secrets import Rotation
from hubd.tokens import hash_token, new_reconnect_secret, new_sidecar_id, new_token
from tests.polling import eventually
from tests.wskit import (
    Hub,
    Sidecar,
    close_code_of,
    dial,
    record_row,
    rejection,
    running_hub,
    secret_acknowledged,
    secret_row,
    welcome_of,
)

SECRET = "Hubd-Reconnect-Secret"
FAST = Backoff(base=0.05, cap=0.2)


@pytest.fixture
async def hub(db: Database) -> AsyncIterator[Hub]:
    async with running_hub(db) as running:
        yield running


async def acknowledge(ws: ClientConnection) -> None:
    await ws.send(json.dumps({"type": "welcome_ack"}))


async def database_state(db: Database, allocation_id: str) -> tuple[Any, ...]:
    """Everything a takeover would change: the record, the secret row, the allocation's
    connection number and the ledger's length."""
    async with db.pool.acquire() as conn:
        seq = await conn.fetchval(
            "SELECT connection_seq FROM hubd_allocations WHERE id = $1", allocation_id
        )
        ledger = await conn.fetchval(
            "SELECT count(*) FROM hubd_allocation_ledger WHERE allocation_id = $1", allocation_id
        )
    return (
        await record_row(db, allocation_id),
        await secret_row(db, allocation_id),
        seq,
        ledger,
    )


class TestCopiedToken:
    async def test_copied_token_cannot_supersede(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """Once the sidecar connected and acknowledged its welcome, its token alone (what any
        process of its uid reads from /proc/<pid>/environ) is refused with the one 401; the
        live socket stays and nothing changes in the database."""
        async with dial(hub.url, sidecar.headers()) as live:
            await welcome_of(live)
            await acknowledge(live)
            await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
            before = await database_state(db, sidecar.allocation_id)
            refused = await rejection(hub.url, sidecar.headers())
            assert refused.response.status_code == 401
            assert refused.response.body == b"unauthorized\n"
            # A guessed secret is no better, and looks the same.
            guessed = await rejection(hub.url, sidecar.headers(**{SECRET: new_reconnect_secret()}))
            assert guessed.response.status_code == 401
            assert guessed.response.body == b"unauthorized\n"
            assert await database_state(db, sidecar.allocation_id) == before
            assert [e.closed_by_hub for e in hub.router.sockets(sidecar.allocation_id)] == [None]
            await live.ping()

    async def test_v1_refused_once_a_secret_exists(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """A v1 handshake (which cannot present a secret) opens a generation that has none,
        with v1's welcome; once a v2 sidecar of that generation connected, v1 is refused 401."""
        v1 = [Subprotocol("hubd.sidecar.v1")]
        async with dial(hub.url, sidecar.headers(), subprotocols=v1) as old:
            assert old.subprotocol == "hubd.sidecar.v1"
            assert "reconnect_secret" not in await welcome_of(old)
        async with dial(hub.url, sidecar.headers()) as live:
            await welcome_of(live)
            await acknowledge(live)
            await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
            refused = await rejection(hub.url, sidecar.headers(), subprotocols=v1)
            assert refused.response.status_code == 401
        with_secret = sidecar.headers(**{SECRET: new_reconnect_secret()})
        malformed = await rejection(hub.url, with_secret, subprotocols=v1)
        assert malformed.response.status_code == 400

    async def test_replacement_starts_without_secret(
        self, db: Database, hub: Hub, sidecar: Sidecar
    ) -> None:
        """A new generation's sidecar connects with its token alone: the secret of the
        generation before it is no secret of this one."""
        async with dial(hub.url, sidecar.headers()) as live:
            await welcome_of(live)
            await acknowledge(live)
            await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
        token = new_token()
        async with db.pool.acquire() as conn:
            generation = await conn.fetchval(
                "UPDATE hubd_allocations SET generation = generation + 1, sidecar_id = $2, "
                "token_hash = $3 WHERE id = $1 RETURNING generation",
                sidecar.allocation_id,
                new_sidecar_id(),
                hash_token(token),
            )
            sidecar_id = await conn.fetchval(
                "SELECT sidecar_id FROM hubd_allocations WHERE id = $1", sidecar.allocation_id
            )
        successor = Sidecar(
            allocation_id=sidecar.allocation_id,
            sidecar_id=sidecar_id,
            generation=generation,
            token=token,
        )
        async with dial(hub.url, successor.headers()) as ws:
            assert (await welcome_of(ws))["generation"] == generation


class TestReconnect:
    async def test_real_sidecar_reconnects_through_another_replica(
        self, db: Database, sidecar: Sidecar
    ) -> None:
        """The reference sidecar, dropped by one replica, reconnects to the other with its
        secret (any replica verifies it: it is in the database); the token alone is then
        refused by both."""
        async with (
            running_hub(db, instance_id="in_a") as first,
            running_hub(db, instance_id="in_b") as second,
        ):
            env = sidecar.env(f"{first.server.url},{second.server.url}")
            client = SidecarClient(SidecarSettings.from_env(env), backoff=FAST)
            task = asyncio.create_task(client.run())
            try:
                await eventually(lambda: client.welcomes == 1)
                await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
                # The replica drops the socket as a hub restart would (1001: reconnect).
                await first.router.close_all()
                await eventually(lambda: client.welcomes == 2)
                row = await record_row(db, sidecar.allocation_id)
                assert row is not None
                assert row["instance_id"] == "in_b"
                await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
                for hub in (first, second):
                    with pytest.raises(InvalidStatus) as refused:
                        async with dial(hub.url, sidecar.headers()):
                            pass
                    assert refused.value.response.status_code in (401, 503)
                assert second.server.stats.rejected[401] == 1
                assert client.connected
            finally:
                client.stop()
                assert await asyncio.wait_for(task, 30) == SidecarExit(0, "stopped")

    async def test_racing_reconnects_one_wins(self, db: Database, sidecar: Sidecar) -> None:
        """Two handshakes presenting the same secret on two replicas at once: in the end
        exactly one socket stays open and the database holds its record and secret. The
        other is refused (401) or closed before any welcome; or, if it reached its hub after
        the first was recorded but before that one acknowledged its welcome (the lost-welcome
        allowance cannot tell it from a sidecar whose welcome was lost), it takes over and the
        first is closed as superseded (4000)."""
        async with (
            running_hub(db, instance_id="in_a") as first,
            running_hub(db, instance_id="in_b") as second,
            contextlib.AsyncExitStack() as sockets,
        ):
            async with dial(first.url, sidecar.headers()) as ws:
                secret = (await welcome_of(ws))["reconnect_secret"]
                await acknowledge(ws)
                await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
            headers = sidecar.headers(**{SECRET: secret})

            async def attempt(hub: Hub) -> tuple[str, Any, ClientConnection | None]:
                try:
                    racer = await sockets.enter_async_context(dial(hub.url, headers))
                except InvalidStatus as exc:
                    return "refused", exc.response.status_code, None
                try:
                    return "welcomed", await welcome_of(racer), racer
                except ConnectionClosed:
                    return "closed", await close_code_of(racer), None

            outcomes = await asyncio.gather(attempt(first), attempt(second))
            for kind, detail, _ in outcomes:
                if kind == "refused":
                    assert detail == 401
                elif kind == "closed":
                    assert detail == 4000
            welcomed = [(detail, racer) for kind, detail, racer in outcomes if racer is not None]
            assert welcomed, outcomes
            if len(welcomed) == 2:
                # Both got through: the later record took over (its hub's peer closes the
                # earlier socket with 4000 when told, which this harness does not wire), and
                # the database holds the later one's record and secret.
                record = await record_row(db, sidecar.allocation_id)
                assert record is not None
                by_hub = dict(zip(("in_a", "in_b"), outcomes, strict=True))
                _, winner, _ = by_hub[record["instance_id"]]
            else:
                ((winner, _),) = welcomed
            row = await secret_row(db, sidecar.allocation_id)
            assert row is not None
            assert bytes(row["secret_hash"]) == hash_token(winner["reconnect_secret"])

    async def test_store_race_exactly_one_records(self, db: Database, sidecar: Sidecar) -> None:
        """At the store: two rotations guarded on the same seen state, from two instances at
        once — exactly one records, the other is SUPERSEDED and writes nothing."""
        a = ConnectionStore(db, instance_id="in_a")
        b = ConnectionStore(db, instance_id="in_b")
        presented = new_reconnect_secret()
        seen = hash_token(presented)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO hubd_sidecar_secrets (allocation_id, generation, sidecar_id, "
                "secret_hash, acknowledged) VALUES ($1, $2, $3, $4, true)",
                sidecar.allocation_id,
                sidecar.generation,
                sidecar.sidecar_id,
                seen,
            )
        rotations = [
            Rotation(
                seen_hash=seen,
                secret_hash=hash_token(new_reconnect_secret()),
                presented_hash=seen,
            )
            for _ in range(2)
        ]
        records = await asyncio.gather(
            a.record("cn_a", sidecar.target, sidecar.sidecar_id, rotation=rotations[0]),
            b.record("cn_b", sidecar.target, sidecar.sidecar_id, rotation=rotations[1]),
        )
        outcomes = sorted(r.outcome for r in records)
        assert outcomes == sorted([RecordOutcome.RECORDED, RecordOutcome.SUPERSEDED])
        winner = 0 if records[0].outcome is RecordOutcome.RECORDED else 1
        row = await record_row(db, sidecar.allocation_id)
        assert row is not None
        assert row["connection_id"] == ("cn_a", "cn_b")[winner]
        secrets_row = await secret_row(db, sidecar.allocation_id)
        assert secrets_row is not None
        assert bytes(secrets_row["secret_hash"]) == rotations[winner].secret_hash


class TestLostWelcome:
    async def test_first_welcome_lost(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """A first connection that never acknowledged its welcome leaves the token alone
        valid: the sidecar, which never got a secret, connects again with it."""
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
        async with dial(hub.url, sidecar.headers()) as ws:
            await welcome_of(ws)
            await acknowledge(ws)
            await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
        refused = await rejection(hub.url, sidecar.headers())
        assert refused.response.status_code == 401

    async def test_later_welcome_lost(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """A sidecar that presented secret S and lost the welcome with S's successor still
        holds S: S opens the next connection until a welcome is acknowledged, then no more."""
        async with dial(hub.url, sidecar.headers()) as ws:
            held = (await welcome_of(ws))["reconnect_secret"]
            await acknowledge(ws)
            await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
        with_held = sidecar.headers(**{SECRET: held})
        async with dial(hub.url, with_held) as ws:
            await welcome_of(ws)  # "lost": never acknowledged, never used
        async with dial(hub.url, with_held) as ws:
            newest = (await welcome_of(ws))["reconnect_secret"]
            await acknowledge(ws)
            await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
            refused = await rejection(hub.url, with_held)
            assert refused.response.status_code == 401
        async with dial(hub.url, sidecar.headers(**{SECRET: newest})) as ws:
            await welcome_of(ws)


class TestSecrecy:
    async def test_secret_never_logged(self, db: Database, hub: Hub, sidecar: Sidecar) -> None:
        """Neither the welcome's secret nor a presented one reaches a log line, the record or
        the ledger; only its digest is stored."""
        with structlog.testing.capture_logs() as logs:
            async with dial(hub.url, sidecar.headers()) as ws:
                secret = (await welcome_of(ws))["reconnect_secret"]
                await acknowledge(ws)
                await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
            await rejection(hub.url, sidecar.headers())
            async with dial(hub.url, sidecar.headers(**{SECRET: secret})) as ws:
                await welcome_of(ws)
        assert logs
        assert secret not in repr(logs)
        assert secret[len("hubd_rs_") :] not in repr(logs)
        state = await database_state(db, sidecar.allocation_id)
        assert secret not in repr(state)
        assert secret.encode() not in repr(state).encode()
