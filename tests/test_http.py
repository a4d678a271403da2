"""The HTTP API (docs/http.md) over real sockets and a real PostgreSQL: keys and the tenant wall,
every route, errors as JSON with stable codes, quotas as 429, the long-poll wait, and the event
stream resumed with nothing missed or repeated."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import aiohttp
import pytest

import hubd.http.stream
from hubd.config import HttpConfig
from hubd.http import HttpApi, serving
from hubd.http.server import application
from hubd.store import AllocationStore, Database
from hubd.store.api_keys import ApiKeyStore
from hubd.store.quotas import Quotas, QuotaScope
from tests.polling import eventually
from tests.proxykit import blackhole
from tests.ssekit import sse_events

pytestmark = pytest.mark.timeout(120)


class Api:
    def __init__(self, api: HttpApi, session: aiohttp.ClientSession, keys: dict[str, str]):
        self.api = api
        self.session = session
        self.keys = keys
        self.url = f"http://127.0.0.1:{api.port}"

    async def call(
        self, method: str, path: str, *, key: str | None = "acme", **kwargs: Any
    ) -> tuple[int, Any, aiohttp.typedefs.LooseHeaders]:
        headers = dict(kwargs.pop("headers", {}))
        if key is not None:
            headers["Authorization"] = f"Bearer {self.keys.get(key, key)}"
        async with self.session.request(
            method, self.url + path, headers=headers, **kwargs
        ) as response:
            text = await response.text()
            return response.status, json.loads(text) if text else None, response.headers


@pytest.fixture
async def api(database_url: str, db: Database) -> AsyncIterator[Api]:
    keys = ApiKeyStore(db)
    made = {
        "acme": (await keys.create(tenant="acme", name="acme's backend"))[1],
        "globex": (await keys.create(tenant="globex"))[1],
        "ops": (await keys.create(tenant=None, name="operator"))[1],
    }
    config = HttpConfig(listen="127.0.0.1:0", max_streams_per_key=2, pool_size=4)
    async with (
        serving(config, database_url, db) as running,
        aiohttp.ClientSession() as session,
    ):
        assert running is not None
        yield Api(running, session, made)


async def create(api: Api, key: str = "acme", **body: Any) -> dict[str, Any]:
    status, made, _ = await api.call(
        "POST", "/v1/allocations", key=key, json={"provisioner": "fake", **body}
    )
    assert status == 201, made
    result: dict[str, Any] = made
    return result


class TestKeys:
    async def test_no_key_a_wrong_key_and_a_revoked_key_are_refused(
        self, api: Api, db: Database
    ) -> None:
        status, body, headers = await api.call("GET", "/v1/allocations", key=None)
        assert (status, body["error"]["code"]) == (401, "unauthorized")
        assert headers["WWW-Authenticate"] == "Bearer"
        real = api.keys["acme"]
        wrong = real[:-4] + ("AAAA" if not real.endswith("AAAA") else "BBBB")
        for bad in (wrong, "hubd_0123456789abcdef.x", "x" * 5000, real + " extra"):
            status, body, _ = await api.call("GET", "/v1/allocations", key=bad)
            assert (status, body["error"]["code"]) == (401, "unauthorized")
            assert real not in json.dumps(body)
        key_id = real.removeprefix("hubd_").split(".")[0]
        assert await ApiKeyStore(db).revoke(key_id) is not None
        status, _, _ = await api.call("GET", "/v1/allocations", key="acme")
        assert status == 401
        stored = await db.pool.fetchval("SELECT count(*) FROM hubd_api_keys WHERE id = $1", key_id)
        assert stored == 1
        secret = real.split(".", 1)[1]
        dumped = await db.pool.fetchval("SELECT string_agg(t::text, ' ') FROM hubd_api_keys AS t")
        assert secret not in dumped

    async def test_the_openapi_document_needs_no_key_and_names_every_route(self, api: Api) -> None:
        status, document, _ = await api.call("GET", "/v1/openapi.json", key=None)
        assert status == 200
        documented = {
            (method.upper(), path) for path, item in document["paths"].items() for method in item
        }
        app = application(api.api.state)
        served = {
            (route.method, route.resource.canonical)
            for route in app.router.routes()
            if route.method != "HEAD" and route.resource is not None
        }
        assert documented == served


class TestTenantWall:
    async def test_a_tenant_key_sees_and_acts_on_its_tenant_alone(self, api: Api) -> None:
        mine = await create(api, "acme", session="s-1")
        assert mine["tenant"] == "acme"
        theirs = await create(api, "globex")
        status, body, _ = await api.call(
            "POST", "/v1/allocations", json={"provisioner": "fake", "tenant": "globex"}
        )
        assert (status, body["error"]["code"]) == (403, "forbidden")
        for method, path in (
            ("GET", f"/v1/allocations/{theirs['id']}"),
            ("POST", f"/v1/allocations/{theirs['id']}/release"),
            ("POST", f"/v1/allocations/{theirs['id']}/touch"),
            ("GET", f"/v1/allocations/{theirs['id']}/wait?timeout=0"),
        ):
            status, body, _ = await api.call(method, path)
            assert (status, body["error"]["code"]) == (404, "not_found"), path
        status, listed, _ = await api.call("GET", "/v1/allocations")
        assert [a["id"] for a in listed["allocations"]] == [mine["id"]]
        status, listed, _ = await api.call("GET", "/v1/allocations?session=other")
        assert listed["allocations"] == []
        status, listed, _ = await api.call("GET", "/v1/allocations", key="ops")
        assert {a["id"] for a in listed["allocations"]} == {mine["id"], theirs["id"]}
        made = await create(api, "ops", tenant="initech")
        assert made["tenant"] == "initech"

    async def test_release_extend_and_touch(self, api: Api, store: AllocationStore) -> None:
        made = await create(api, lifetime_s=60)
        assert made["expires_at"] is not None
        status, extended, _ = await api.call(
            "POST", f"/v1/allocations/{made['id']}/extend", json={"lifetime_s": 120}
        )
        assert status == 200
        assert extended["expires_at"] > made["expires_at"]
        status, touched, _ = await api.call("POST", f"/v1/allocations/{made['id']}/touch")
        assert (status, touched["id"]) == (200, made["id"])
        status, released, _ = await api.call(
            "POST", f"/v1/allocations/{made['id']}/release", json={"reason": "done"}
        )
        assert (status, released["status"], released["end_reason"]) == (
            200,
            "released",
            "application",
        )


class TestErrors:
    async def test_bad_input_is_a_json_error_with_its_code(self, api: Api) -> None:
        cases: list[tuple[Any, int, str]] = [
            ("not json", 400, "invalid_request"),
            ([1, 2], 400, "invalid_request"),
            ({"provisioner": "fake", "surprise": 1}, 400, "invalid_request"),
            ({"provisioner": "fake", "spec": "x"}, 400, "invalid_request"),
            ({"provisioner": "fake", "lifetime_s": -1}, 400, "invalid_request"),
            ({"provisioner": "fake", "ready_when": "whenever"}, 400, "invalid_request"),
            ({"provisioner": "fake", "spec": {"k": "v" * 400_000}}, 413, "too_large"),
        ]
        for body, status, code in cases:
            data = body if isinstance(body, str) else json.dumps(body)
            got, answer, _ = await api.call("POST", "/v1/allocations", data=data)
            assert (got, answer["error"]["code"]) == (status, code), body
        got, answer, _ = await api.call("GET", "/v1/nothing-here")
        assert (got, answer["error"]["code"]) == (404, "no_route")
        got, answer, _ = await api.call("DELETE", "/v1/allocations")
        assert (got, answer["error"]["code"]) == (405, "method_not_allowed")

    async def test_idempotency_key_header(self, api: Api) -> None:
        headers = {"Idempotency-Key": "order-17"}
        first = await api.call(
            "POST", "/v1/allocations", json={"provisioner": "fake"}, headers=headers
        )
        again = await api.call(
            "POST", "/v1/allocations", json={"provisioner": "fake"}, headers=headers
        )
        assert first[1]["id"] == again[1]["id"]
        status, body, _ = await api.call(
            "POST", "/v1/allocations", json={"provisioner": "other"}, headers=headers
        )
        assert (status, body["error"]["code"]) == (409, "idempotency_conflict")

    async def test_a_quota_is_429_with_retry_after(self, api: Api, db: Database) -> None:
        await Quotas(db).set(QuotaScope.tenant("acme"), rate=0.01, burst=1)
        await create(api)
        status, body, headers = await api.call(
            "POST", "/v1/allocations", json={"provisioner": "fake"}
        )
        assert (status, body["error"]["code"]) == (429, "quota_exceeded")
        assert int(headers["Retry-After"]) >= 1
        assert "acme" in body["error"]["message"]


class TestWait:
    async def test_it_answers_when_the_allocation_is_ready(self, api: Api, db: Database) -> None:
        made = await create(api)
        waiting = asyncio.ensure_future(
            api.call("GET", f"/v1/allocations/{made['id']}/wait?timeout=60")
        )
        # The wait is registered once its first read is done; a ready row then wakes it.
        await eventually(lambda: _streams(api) == 1, within=30, every=0.05)
        await db.pool.execute(
            "UPDATE hubd_allocations SET status = 'allocated', sidecar_id = 'sc_w', "
            "token_hash = sha256('t'), connection_ready = true WHERE id = $1",
            made["id"],
        )
        status, body, headers = await asyncio.wait_for(waiting, 30)
        assert (status, body["ready"], headers["Hubd-Wait"]) == (200, True, "ready")

    async def test_it_answers_at_its_timeout_with_the_state_then(self, api: Api) -> None:
        made = await create(api)
        status, body, headers = await api.call(
            "GET", f"/v1/allocations/{made['id']}/wait?timeout=0.2"
        )
        assert (status, body["status"], headers["Hubd-Wait"]) == (200, "pending", "timeout")


def _streams(api: Api) -> int:
    return sum(api.api.state.open_streams.values())


class TestEvents:
    async def read_events(
        self, api: Api, count: int, *, key: str = "acme", query: str = "", **headers: str
    ) -> list[tuple[int, str, dict[str, Any]]]:
        """The first ``count`` events of a new stream: (id, event, data)."""
        found: list[tuple[int, str, dict[str, Any]]] = []
        got = {"Authorization": f"Bearer {api.keys[key]}", **headers}
        async with api.session.get(f"{api.url}/v1/events{query}", headers=got) as response:
            assert response.status == 200, await response.text()
            assert response.headers["Content-Type"].startswith("text/event-stream")
            async with asyncio.timeout(30):
                async for event in sse_events(response):
                    found.append(event)
                    if len(found) == count:
                        break
        return found

    async def test_a_tenant_follows_its_events_and_resumes_without_a_gap(
        self, api: Api, store: AllocationStore
    ) -> None:
        mine = await create(api, session="s-1")
        await create(api, "globex")
        first = await self.read_events(api, 1, query="?after=0")
        assert [(e, d["allocation_id"]) for _, e, d in first] == [("requested", mine["id"])]
        # Each stream is closed by the reader; its slot comes back once the server sees it.
        await eventually(lambda: _streams(api) == 0, within=30, every=0.05)
        await store.release(mine["id"])
        later = await create(api, session="s-2")
        resumed = await self.read_events(api, 2, **{"Last-Event-ID": str(first[-1][0])})
        assert [(e, d["allocation_id"]) for _, e, d in resumed] == [
            ("released", mine["id"]),
            ("requested", later["id"]),
        ]
        assert resumed[0][0] > first[-1][0]
        await eventually(lambda: _streams(api) == 0, within=30, every=0.05)
        only_s2 = await self.read_events(api, 1, query="?after=0&session=s-2")
        assert only_s2[0][2]["allocation_id"] == later["id"]

    async def test_a_reader_that_hangs_up_gives_its_slot_back_before_any_write(
        self, api: Api, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # With no heartbeat due for an hour, only the transport's state can free the slot.
        monkeypatch.setattr(hubd.http.stream, "HEARTBEAT", 3600.0)
        await create(api)
        await self.read_events(api, 1, query="?after=0")
        await eventually(lambda: _streams(api) == 0, within=30, every=0.05)
        again = await self.read_events(api, 1, query="?after=0")
        assert again[0][1] == "requested"

    async def test_a_live_event_arrives_as_it_commits(self, api: Api, db: Database) -> None:
        # From a cursor read first: a stream with none starts wherever the feed is when it
        # opens, which may be after the request below.
        now = await db.pool.fetchval("SELECT hubd_v1.event_cursor()")
        reading = asyncio.ensure_future(self.read_events(api, 1, query=f"?after={now}"))
        await eventually(lambda: _streams(api) == 1, within=30, every=0.05)
        made = await create(api)
        events = await asyncio.wait_for(reading, 30)
        assert events[0][2]["allocation_id"] == made["id"]

    async def test_an_old_cursor_is_410_and_streams_are_capped_per_key(
        self, api: Api, db: Database
    ) -> None:
        await create(api)
        await create(api)
        # As a prune leaves it: the horizon at an event the feed still holds, never past one.
        await db.pool.execute(
            "UPDATE hubd_event_horizon SET position = (SELECT max(position) FROM hubd_events)"
        )
        status, body, _ = await api.call("GET", "/v1/events?after=0")
        assert (status, body["error"]["code"]) == (410, "cursor_expired")
        now = await db.pool.fetchval("SELECT hubd_v1.event_cursor()")
        query = f"?after={now}"
        readers = [asyncio.ensure_future(self.read_events(api, 1, query=query)) for _ in range(2)]
        await eventually(lambda: _streams(api) == 2, within=30, every=0.05)
        status, body, headers = await api.call("GET", "/v1/events")
        assert (status, body["error"]["code"]) == (429, "too_many_streams")
        assert headers["Retry-After"] == "1"
        # Another key has slots of its own.
        other = asyncio.ensure_future(self.read_events(api, 1, key="globex", query=query))
        await eventually(lambda: _streams(api) == 3, within=30, every=0.05)
        await create(api)
        await create(api, "globex")
        await asyncio.wait_for(asyncio.gather(*readers, other), 30)


class TestDatabaseUnreachable:
    async def test_503_while_the_database_is_unreachable_and_back_after(
        self, database_url: str, db: Database
    ) -> None:
        """Requests whose database stops answering (its connections dead, as a partition
        leaves them) are answered 503 within ``database_timeout``, and served again once it
        heals."""
        key = (await ApiKeyStore(db).create(tenant="acme"))[1]
        config = HttpConfig(listen="127.0.0.1:0", pool_size=2, database_timeout=1.0)
        async with (
            blackhole(database_url) as hole,
            serving(config, hole.url(database_url), db) as running,
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session,
        ):
            assert running is not None
            url = f"http://127.0.0.1:{running.port}/v1/allocations"

            async def status_of() -> int:
                async with session.get(url) as response:
                    return response.status

            assert await status_of() == 200
            hole.drop()
            async with session.get(url) as response:
                body = await response.json()
                assert (response.status, body["error"]["code"]) == (503, "database_unavailable")
                assert response.headers["Retry-After"] == "1"
            hole.heal()
            await eventually(lambda: _ok(status_of()), within=60, every=0.5)


async def _ok(status: Awaitable[int]) -> bool:
    return await status == 200


class TestSlowReader:
    async def test_a_reader_that_takes_nothing_is_cut_off(
        self, api: Api, db: Database, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A stream whose reader stops reading holds one page of its events and no more: once
        a write has waited ``WRITE_TIMEOUT`` the stream ends and frees its slot, while the
        reader still has not read a byte."""
        monkeypatch.setattr("hubd.http.stream.WRITE_TIMEOUT", 0.5)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, ("127.0.0.1", api.api.port or 0))
        try:
            request = (
                "GET /v1/events?after=0 HTTP/1.1\r\nHost: hubd\r\n"
                f"Authorization: Bearer {api.keys['acme']}\r\n\r\n"
            )
            await loop.sock_sendall(sock, request.encode())
            await eventually(lambda: _streams(api) == 1, within=30, every=0.05)
            # About 6 MiB of events, more than the kernel's buffers of both ends hold (4 MiB).
            await db.pool.execute(
                "SELECT hubd_request_allocation('fake', 'acme', NULL, '{}', NULL, NULL, 't') "
                "FROM generate_series(1, 14000)"
            )
            await eventually(lambda: _streams(api) == 0, within=60, every=0.1)
        finally:
            sock.close()
