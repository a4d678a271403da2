"""The reference sidecar: its pure reconnect policy, its settings, and runs against a real hub."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import pytest
from websockets.exceptions import InvalidMessage

from hubd.backoff import Backoff, Retries
from hubd.server import handshake
from hubd.sidecar import client as sidecar_client
from hubd.sidecar import settings as sidecar_settings
from hubd.sidecar.client import Publication, SidecarClient, SidecarExit
from hubd.sidecar.main import run_sidecar
from hubd.sidecar.policy import (
    Action,
    after_close,
    after_connect_error,
    after_http_status,
    parse_retry_after,
)
from hubd.sidecar.settings import SidecarConfigError, SidecarSettings, connect_url
from hubd.store import AllocationStore, Database, connect_database
from hubd.tokens import new_token
from tests.daemonkit import free_port
from tests.polling import eventually
from tests.wskit import (
    Sidecar,
    bring_back,
    dial,
    record_row,
    running_hub,
    secret_acknowledged,
    sidecar_in,
    take_away,
    welcome_of,
    wrong_token,
)

FAST = Backoff(base=0.05, cap=0.2)


def settings_for(sidecar: Sidecar, url: str, **changes: str) -> SidecarSettings:
    env = sidecar.env(url)
    env.update(changes)
    return SidecarSettings.from_env(env)


async def finish(task: asyncio.Task[SidecarExit]) -> SidecarExit:
    async with asyncio.timeout(30):
        return await task


class TestClosePolicy:
    @pytest.mark.parametrize("code", [4000, 4001, 4002])
    def test_protocol_stop_codes(self, code: int) -> None:
        """Superseded, retired and fenced sidecars never reconnect."""
        assert after_close(code).action is Action.STOP

    @pytest.mark.parametrize("code", [4003, 4500, 4999])
    def test_unknown_application_codes_stop(self, code: int) -> None:
        """An application close code the sidecar does not know stops it rather than risk
        coming back against the hub's wish."""
        assert after_close(code).action is Action.STOP

    @pytest.mark.parametrize("code", [1000, 1001, 1006, 1008, 1009, 1011, 1012, 1013, 1014, None])
    def test_transient_codes_reconnect(self, code: int | None) -> None:
        """Hub shutdown, a lost connection, internal errors and other closes are retried."""
        decision = after_close(code)
        assert decision.action is Action.RECONNECT
        assert decision.reconnect

    def test_reasons_name_the_code(self) -> None:
        """Each decision says which close code caused it, in one line."""
        assert (
            after_close(4001).reason
            == "closed 4001: retired: the allocation was released or failed"
        )
        assert after_close(None).reason == "closed 1006: connection lost"

    def test_an_ordinary_release_does_not_read_as_an_error(self) -> None:
        """4001 and 4002 (what a release sends) say "released" and are ordinary; a
        superseded connection is not."""
        fenced = after_close(4002)
        assert fenced.reason.startswith("closed 4002: released or replaced")
        assert "newer generation" not in fenced.reason
        assert fenced.ordinary
        assert after_close(4001).ordinary
        assert not after_close(4000).ordinary


class TestHttpPolicy:
    @pytest.mark.parametrize("status", [400, 401, 403, 404, 409, 418, 426])
    def test_refusals_stop(self, status: int) -> None:
        """401, 403, 409 and every other refusal that asking again cannot change stop."""
        decision = after_http_status(status)
        assert decision.action is Action.STOP
        assert str(status) in decision.reason

    @pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
    def test_unavailable_reconnects(self, status: int) -> None:
        """503 (and any other "not now") is retried."""
        assert after_http_status(status).action is Action.RECONNECT

    @pytest.mark.parametrize(
        "error",
        [
            ConnectionRefusedError(111, "refused"),
            ConnectionResetError(),
            TimeoutError(),
            OSError("name resolution"),
            InvalidMessage("no HTTP response"),
        ],
    )
    def test_connect_errors_reconnect(self, error: BaseException) -> None:
        """A hub that cannot be reached at all is retried."""
        assert after_connect_error(error).action is Action.RECONNECT

    @pytest.mark.parametrize(
        ("value", "seconds"),
        [("5", 5.0), (" 3 ", 3.0), ("0", 0.0), (None, None), ("-1", None), ("soon", None),
         ("Wed, 21 Oct 2015 07:28:00 GMT", None), ("9999999", None)],
    )  # fmt: skip
    def test_retry_after(self, value: str | None, seconds: float | None) -> None:
        """Retry-After is read in delta-seconds; other forms count as absent."""
        assert parse_retry_after(value) == seconds


class TestBackoff:
    def test_ceiling_doubles_up_to_cap(self) -> None:
        """The ceiling doubles per attempt from the base and stops at the cap."""
        backoff = Backoff(base=0.5, cap=30.0)
        assert [backoff.ceiling(n) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
        assert backoff.ceiling(10_000) == 30

    def test_full_jitter(self) -> None:
        """The delay is the ceiling scaled by the injected random draw."""
        backoff = Backoff(base=1.0, cap=10.0)
        assert backoff.delay(3, lambda: 0.0) == 0.0
        assert backoff.delay(3, lambda: 0.5) == 4.0
        assert backoff.delay(3, lambda: 0.999) == pytest.approx(7.992)

    def test_jitter_spreads_a_fleet(self) -> None:
        """A fleet reconnecting at the same attempt spreads over the whole window."""
        backoff = Backoff()
        draw = random.Random(4).random
        delays = [backoff.delay(4, draw) for _ in range(1000)]
        assert all(0 <= d < 8 for d in delays)
        assert min(delays) < 0.5
        assert max(delays) > 7.5

    def test_retry_after_is_a_floor(self) -> None:
        """A server's Retry-After is a floor under the jitter, and the cap still holds."""
        backoff = Backoff(base=1.0, cap=10.0)
        assert backoff.delay(0, lambda: 0.0, floor=3) == 3.0
        assert backoff.delay(0, lambda: 0.5, floor=3) == 3.5
        assert backoff.delay(6, lambda: 0.9, floor=3600) == 10.0

    @pytest.mark.parametrize(("base", "cap"), [(0, 1), (-1, 1), (2, 1)])
    def test_invalid(self, base: float, cap: float) -> None:
        """A backoff needs 0 < base <= cap."""
        with pytest.raises(ValueError, match="base"):
            Backoff(base=base, cap=cap)


class TestRetries:
    def test_a_retry_loop_waits_the_ceilings_and_starts_over_after_a_success(self) -> None:
        """A daemon loop's waits double from the first up to the cap, without jitter, and a
        success starts the schedule over."""
        retries = Retries.doubling(0.5, 10.0)
        assert [retries.next_delay() for _ in range(7)] == [0.5, 1, 2, 4, 8, 10, 10]
        retries.reset()
        assert retries.next_delay() == 0.5

    def test_a_cap_below_the_first_wait_lowers_it(self) -> None:
        """A loop whose cap (a poll interval) is shorter than the first wait never waits
        longer than the cap."""
        retries = Retries.doubling(0.5, 0.1)
        assert [retries.next_delay() for _ in range(3)] == [0.1, 0.1, 0.1]


ENV: Final = MappingProxyType(
    {
        "HUBD_URL": "ws://127.0.0.1:8765",
        "HUBD_TOKEN": new_token(),
        "HUBD_ALLOCATION_ID": "al_" + "0" * 32,
        "HUBD_SIDECAR_ID": "sc_" + "1" * 32,
        "HUBD_GENERATION": "2",
    }
)


class TestSettings:
    def test_from_env(self) -> None:
        """The five HUBD_* variables make the settings; the token stays out of repr."""
        settings = SidecarSettings.from_env(ENV)
        assert settings.url == "ws://127.0.0.1:8765/v1/sidecars/connect"
        assert settings.generation == 2
        assert ENV["HUBD_TOKEN"] not in repr(settings)

    @pytest.mark.parametrize(
        ("base", "url"),
        [
            ("ws://h:1", "ws://h:1/v1/sidecars/connect"),
            ("ws://h:1/", "ws://h:1/v1/sidecars/connect"),
            ("wss://h/custom/path", "wss://h/custom/path"),
        ],
    )
    def test_connect_url(self, base: str, url: str) -> None:
        """The endpoint path is appended only when HUBD_URL names none."""
        assert connect_url(base) == url

    @pytest.mark.parametrize("name", list(ENV))
    def test_missing(self, name: str) -> None:
        """A missing variable is an error that names it."""
        env = {k: v for k, v in ENV.items() if k != name}
        with pytest.raises(SidecarConfigError, match=name):
            SidecarSettings.from_env(env)

    @pytest.mark.parametrize(
        ("name", "value"),
        [
            ("HUBD_URL", "http://127.0.0.1:8765"),
            ("HUBD_URL", "not a url"),
            ("HUBD_TOKEN", "hubd_sc_" + "Z" * 64),
            ("HUBD_GENERATION", "0"),
            ("HUBD_GENERATION", "two"),
        ],
    )
    def test_malformed(self, name: str, value: str) -> None:
        """A malformed variable is an error that names it and never repeats a token."""
        with pytest.raises(SidecarConfigError, match=name) as caught:
            SidecarSettings.from_env({**ENV, name: value})
        assert "Z" * 64 not in str(caught.value)

    def test_run_sidecar_usage_error(self, capsys: pytest.CaptureFixture[str]) -> None:
        """run_sidecar exits 2 with one line on stderr when the environment is incomplete."""
        env = {k: v for k, v in ENV.items() if k != "HUBD_GENERATION"}
        assert run_sidecar(env) == 2
        err = capsys.readouterr().err
        assert err == "hubd sidecar: HUBD_GENERATION is not set\n"

    def test_protocol_constants_agree(self) -> None:
        """The sidecar's copy of the protocol constants matches the hub's."""
        assert sidecar_settings.CONNECT_PATH == handshake.CONNECT_PATH
        assert sidecar_client.SUBPROTOCOL == handshake.SUBPROTOCOL


class TestClient:
    async def test_reconnects_after_restart_and_stops_when_retired(
        self, db: Database, sidecar: Sidecar
    ) -> None:
        """The sidecar gets its welcome, reconnects with backoff after the hub closes with
        1001 (through refused connections while it is down), and stops with a non-zero exit
        and a one-line reason on 4001."""
        async with running_hub(db) as first:
            port = first.server.port
            client = SidecarClient(settings_for(sidecar, first.server.url), backoff=FAST)
            task = asyncio.create_task(client.run())
            await eventually(lambda: client.welcomes == 1, what="first welcome")
            assert client.connected
        # The hub shut down: 1001, then nothing listening.
        await eventually(
            lambda: any(d.reason.startswith("closed 1001") for d in client.decisions),
            what="a 1001 close",
        )
        await eventually(
            lambda: any(d.reason == "connection refused" for d in client.decisions),
            what="a refused reconnect",
        )
        assert all(d.reconnect for d in client.decisions)
        async with running_hub(db, port=port) as second:
            await eventually(lambda: client.welcomes == 2, what="welcome after restart")
            await eventually(lambda: second.router.connection_count == 1)
            second.router.retire(sidecar.allocation_id, sidecar.generation)
            outcome = await finish(task)
        assert outcome.code == 1
        assert "retired" in outcome.reason
        assert "\n" not in outcome.reason
        assert client.decisions[-1].action is Action.STOP

    async def test_stops_on_401(self, db: Database, sidecar: Sidecar) -> None:
        """A refused credential stops the sidecar after one attempt."""
        async with running_hub(db) as hub:
            settings = settings_for(sidecar, hub.server.url, HUBD_TOKEN=wrong_token())
            client = SidecarClient(settings, backoff=FAST)
            outcome = await finish(asyncio.create_task(client.run()))
        assert outcome == SidecarExit(1, "hub refused the credentials (401)")
        assert client.attempts == 1

    async def test_superseded_stays_away(self, db: Database, sidecar: Sidecar) -> None:
        """A sidecar superseded (4000) by a connection that holds its reconnect secret stops
        instead of stealing the socket back; the newer connection stays."""
        async with running_hub(db) as hub:
            older = SidecarClient(settings_for(sidecar, hub.server.url), backoff=FAST)
            older_task = asyncio.create_task(older.run())
            await eventually(lambda: older.welcomes == 1)
            # The secret lives only in the sidecar's memory; the test plays the process that
            # legitimately holds it (a restarted sidecar handed it over, say).
            assert older._secret is not None
            headers = sidecar.headers(**{"Hubd-Reconnect-Secret": older._secret})
            async with dial(hub.url, headers) as newer:
                await welcome_of(newer)
                outcome = await finish(older_task)
                assert outcome.code == 1
                assert "superseded" in outcome.reason
                assert older.attempts == 1
                assert [e.connection_id for e in hub.router.sockets(sidecar.allocation_id)] == [
                    (await record_row(db, sidecar.allocation_id) or {})["connection_id"]
                ]

    async def test_copied_environment_cannot_take_over(
        self, db: Database, sidecar: Sidecar
    ) -> None:
        """A second process started from the same environment (the token copied) is refused
        with 401 once the first has connected, and stops; the first stays connected."""
        async with running_hub(db) as hub:
            first = SidecarClient(settings_for(sidecar, hub.server.url), backoff=FAST)
            first_task = asyncio.create_task(first.run())
            await eventually(lambda: first.welcomes == 1)
            await eventually(lambda: secret_acknowledged(db, sidecar.allocation_id))
            copy = SidecarClient(settings_for(sidecar, hub.server.url), backoff=FAST)
            outcome = await finish(asyncio.create_task(copy.run()))
            assert outcome == SidecarExit(1, "hub refused the credentials (401)")
            assert copy.welcomes == 0
            assert first.connected
            assert hub.server.stats.rejected[401] == 1
            first.stop()
            assert await finish(first_task) == SidecarExit(0, "stopped")

    async def test_retries_503(
        self, db: Database, store: AllocationStore, database_url: str
    ) -> None:
        """A 503 while the hub cannot check identities is retried until it can."""
        sidecar, _ = await sidecar_in(store, db)
        lookups = await connect_database(database_url, pool_size=2)
        try:
            async with running_hub(db, lookup_db=lookups, retry_after=0) as hub:
                await take_away(lookups)
                client = SidecarClient(settings_for(sidecar, hub.server.url), backoff=FAST)
                task = asyncio.create_task(client.run())
                await eventually(lambda: hub.server.stats.rejected[503] >= 2)
                assert client.welcomes == 0
                await bring_back(lookups, database_url)
                await eventually(lambda: client.welcomes == 1)
                assert all(d.reason == "hub unavailable (503)" for d in client.decisions)
                client.stop()
                assert (await finish(task)).code == 0
        finally:
            await lookups.close()

    async def test_stop_closes_normally(self, db: Database, sidecar: Sidecar) -> None:
        """stop() closes with 1000 and run() returns 0; the hub sees a plain disconnect."""
        async with running_hub(db) as hub:
            client = SidecarClient(settings_for(sidecar, hub.server.url), backoff=FAST)
            task = asyncio.create_task(client.run())
            await eventually(lambda: client.welcomes == 1)
            client.stop()
            client.stop()
            assert await finish(task) == SidecarExit(0, "stopped")
            await eventually(lambda: hub.events.disconnected == [sidecar.target])

    async def test_heartbeats(self, db: Database, sidecar: Sidecar) -> None:
        """The sidecar sends a heartbeat message at the interval the welcome names."""
        async with running_hub(db, heartbeat_interval=1.0) as hub:
            client = SidecarClient(settings_for(sidecar, hub.server.url), backoff=FAST)
            task = asyncio.create_task(client.run())
            await eventually(lambda: hub.server.stats.heartbeats >= 1)
            client.stop()
            await finish(task)


class TestProcess:
    async def spawn(self, env: dict[str, str]) -> asyncio.subprocess.Process:
        code = "import os, sys; from hubd.sidecar.main import run_sidecar; "
        code += "sys.exit(run_sidecar(os.environ))"
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            code,
            env={**os.environ, **env},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def test_sigterm_exits_0_and_retire_exits_1(
        self, db: Database, store: AllocationStore
    ) -> None:
        """`hubd sidecar` exits 0 on SIGTERM, and non-zero with one line on stderr when
        retired; its token appears in none of its output."""
        first, _ = await sidecar_in(store, db)
        second, _ = await sidecar_in(store, db)
        async with running_hub(db) as hub:
            stopped = await self.spawn(first.env(hub.server.url))
            retired = await self.spawn(second.env(hub.server.url))
            await eventually(
                lambda: len(hub.events.connected) == 2, within=30, what="both sidecars connected"
            )
            stopped.send_signal(signal.SIGTERM)
            hub.router.retire(second.allocation_id, second.generation)
            async with asyncio.timeout(30):
                out_stopped, err_stopped = await stopped.communicate()
                out_retired, err_retired = await retired.communicate()
        assert stopped.returncode == 0, err_stopped
        assert err_stopped == b""
        assert retired.returncode == 1
        lines = err_retired.decode().splitlines()
        assert lines == [
            "hubd sidecar: closed 4001: retired: the allocation was released or failed"
        ]
        for output in (out_stopped, err_stopped):
            assert first.token.encode() not in output
        for output in (out_retired, err_retired):
            assert second.token.encode() not in output


class TestSeveralReplicas:
    def test_several_urls_are_read_in_order(self) -> None:
        """HUBD_URL may list every replica; each gets the connect path, order kept."""
        settings = SidecarSettings.from_env(
            {
                "HUBD_URL": "ws://10.0.0.1:8765, ws://10.0.0.2:8765/v1/sidecars/connect",
                "HUBD_TOKEN": "hubd_sc_" + "a" * 64,
                "HUBD_ALLOCATION_ID": "al_" + "b" * 32,
                "HUBD_SIDECAR_ID": "sc_x",
                "HUBD_GENERATION": "1",
            }
        )
        assert settings.urls == (
            "ws://10.0.0.1:8765/v1/sidecars/connect",
            "ws://10.0.0.2:8765/v1/sidecars/connect",
        )

    async def test_a_dead_replica_is_skipped(self, db: Database, store: AllocationStore) -> None:
        """With the first listed replica gone (nothing listens there), the sidecar moves on
        to the next address and is welcomed there."""
        sidecar, _ = await sidecar_in(store, db)
        async with running_hub(db) as hub:
            dead = f"ws://127.0.0.1:{free_port()}"
            env = sidecar.env(f"{dead},{hub.server.url}")
            client = SidecarClient(SidecarSettings.from_env(env), backoff=FAST)
            running = asyncio.create_task(client.run())
            try:
                await eventually(lambda: client.welcomes == 1, within=20)
                assert client.url_index == 1
                assert hub.router.connection_count == 1
            finally:
                client.stop()
                await running


class TestPublishing:
    async def test_publishes_pid_and_endpoint_and_declares_ready(
        self, db: Database, store: AllocationStore
    ) -> None:
        """After its welcome the sidecar hands the welcome's context over, publishes its pid,
        its endpoint and what the handler returned, and, where the allocation waits for a
        declaration, declares itself ready once the handler returned: the row shows all of it."""
        sidecar, _ = await sidecar_in(store, db)
        async with db.pool.acquire() as conn:
            await conn.execute(
                "UPDATE hubd_allocations SET ready_when = 'declared', tenant_id = 'acme', "
                "spec = '{\"size\": 3}', lease_id = NULL, lease_expires_at = NULL "
                "WHERE id = $1",
                sidecar.allocation_id,
            )
        seen: list[Mapping[str, Any]] = []

        async def on_welcome(context: Mapping[str, Any]) -> Mapping[str, Any]:
            seen.append(context)
            return {"port": 8080}

        async with running_hub(db, ready_on_connect=True) as hub:
            client = SidecarClient(
                settings_for(sidecar, hub.server.url),
                backoff=FAST,
                publication=Publication(endpoint="http://127.0.0.1:8080", metadata={"k": "v"}),
                on_welcome=on_welcome,
            )
            task = asyncio.create_task(client.run())
            await eventually(lambda: client.published == 1 and client.declared == 1)
            async with db.pool.acquire() as conn:
                row = await conn.fetchrow(
                    "SELECT endpoint, metadata, connection_ready FROM hubd_allocations "
                    "WHERE id = $1",
                    sidecar.allocation_id,
                )
            client.stop()
            await finish(task)
        assert row["endpoint"] == "http://127.0.0.1:8080"
        assert row["metadata"] == {"pid": os.getpid(), "port": 8080, "k": "v"}
        assert row["connection_ready"]
        assert seen == [
            {
                "allocation_id": sidecar.allocation_id,
                "sidecar_id": sidecar.sidecar_id,
                "generation": sidecar.generation,
                "spec": {"size": 3},
                "tenant": "acme",
                "session": None,
                "ready_when": "declared",
            }
        ]
        assert client.context == seen[0]

    async def test_command_gets_the_context_file_and_not_the_token(
        self, db: Database, store: AllocationStore, tmp_path: Path
    ) -> None:
        """`hubd sidecar -- COMMAND` runs the command once welcomed, with HUBD_CONTEXT_FILE
        naming a file of the welcome's context and without HUBD_TOKEN; it publishes its own and
        the command's pid, and ends with the command's status."""
        sidecar, _ = await sidecar_in(store, db)
        out = tmp_path / "seen.json"
        child = (
            "import json, os, sys, time; "
            "context = json.load(open(os.environ['HUBD_CONTEXT_FILE'])); "
            "context['token_seen'] = 'HUBD_TOKEN' in os.environ; "
            f"open({str(out)!r}, 'w').write(json.dumps(context)); "
            # Long enough for the publish to land before the sidecar ends with the command.
            f"deadline = time.time() + 30\n"
            f"while time.time() < deadline and not os.path.exists({str(out) + '.stop'!r}):\n"
            "    time.sleep(0.02)\n"
            "sys.exit(3)"
        )
        code = "import sys; from hubd.cli import main; sys.exit(main(sys.argv[1:]))"
        async with running_hub(db) as hub:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                code,
                "sidecar",
                "--publish-endpoint",
                "tcp://127.0.0.1:7000",
                "--",
                sys.executable,
                "-c",
                child,
                env={**os.environ, **sidecar.env(hub.server.url)},
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:

                async def metadata() -> Any:
                    async with db.pool.acquire() as conn:
                        return await conn.fetchval(
                            "SELECT metadata FROM hubd_allocations WHERE id = $1",
                            sidecar.allocation_id,
                        )

                async def published() -> bool:
                    return (await metadata()) is not None

                await eventually(published, within=30, what="the sidecar's publish")
                await eventually(out.exists, within=30, what="the command's output")
                (tmp_path / "seen.json.stop").touch()
                async with asyncio.timeout(30):
                    _, err = await process.communicate()
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
            found = await metadata()
        assert process.returncode == 3, err
        assert err.decode().splitlines() == ["hubd sidecar: the command exited with status 3"]
        assert sidecar.token.encode() not in err
        assert found["pid"] == process.pid
        assert isinstance(found["command_pid"], int)
        assert found["command_pid"] != process.pid
        seen = json.loads(out.read_text())
        assert seen.pop("token_seen") is False
        assert seen == {
            "allocation_id": sidecar.allocation_id,
            "sidecar_id": sidecar.sidecar_id,
            "generation": sidecar.generation,
            "spec": {},
            "tenant": None,
            "session": None,
            "ready_when": "connected",
        }
