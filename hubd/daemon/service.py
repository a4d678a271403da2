"""``hubd run``: every part wired together, supervised, and shut down in order.

Start-up order: plugins (a bad plugin is a config error, before anything starts), the database
(embedded or external) and migrations, the instance row, the sidecar listener, the reconciler's
start-up repair, the admin listener; then ``READY=1``. Background tasks live in one TaskGroup:
if any of them dies, the group cancels the rest and the daemon exits loudly with code 1.

Shutdown (SIGTERM / SIGINT): stop claiming, give in-flight claims ``shutdown_grace`` to finish
(then cancel them: their leases expire, nothing is written half-way), close sidecar sockets with
1001, remove the instance row, close the pools, and let go of the embedded server.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import time
from collections.abc import Callable, Coroutine
from typing import Any

import asyncpg
import structlog

from hubd.config import Config
from hubd.daemon.admin import AdminServer
from hubd.daemon.cancellation import raise_if_cancelled
from hubd.daemon.fdlimit import plan_descriptors, raise_open_file_limit
from hubd.daemon.metrics import Metrics
from hubd.daemon.systemd import notify, watchdog_interval
from hubd.daemon.wakeups import NotificationListener, Waker
from hubd.errors import ConfigError, DatabaseUnavailable, OperationTimeout, StoreError
from hubd.plugins.protocol import ListsSidecars, Provisioner
from hubd.plugins.registry import load_provisioners
from hubd.reconciler.engine import Reconciler
from hubd.reconciler.orphans import OrphanCollector
from hubd.reconciler.settings import Hook, ReconcilerSettings
from hubd.server.limits import ListenerLimits
from hubd.server.router import SocketRouter
from hubd.server.websocket import SidecarServer
from hubd.sidecar.client import SIDECAR_PING_INTERVAL, SIDECAR_PING_TIMEOUT
from hubd.store import AllocationStore, Database, LedgerStore, Status, connect_database
from hubd.store.connect import resolve_dsn
from hubd.store.connections import (
    ConnectionStore,
    parse_connected_payload,
    parse_sockets_payload,
)
from hubd.store.instances import InstanceStore
from hubd.store.migrate import apply_migrations

__all__ = ["Daemon", "listen_error", "new_instance_id"]

log = structlog.get_logger(__name__)

DEAD_INSTANCE_TTLS = 10
"""An instance row is deleted once its heartbeat is this many TTLs old."""



def listen_error(key: str, listen: str, exc: OSError) -> ConfigError:
    """One line for a listener that cannot bind: the key, the address, and what to set."""
    variable = "HUBD_" + key.upper().replace(".", "_")
    fix = f"set {variable}=host:port (port 0: any free one) or {key} in the config"
    if exc.errno == errno.EADDRINUSE:
        return ConfigError(f"{key} {listen} is in use — another hubd? {fix}")
    return ConfigError(f"{key} {listen}: cannot listen: {exc.strerror or exc} — {fix}")


def new_instance_id() -> str:
    host = socket.gethostname().split(".")[0][:32] or "host"
    return f"in_{host}_{os.getpid()}_{os.urandom(3).hex()}"


class _Stop(Exception):
    """Raised inside the TaskGroup to end it on purpose (a signal arrived)."""


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        on_ready: Hook | None = None,
        on_started: Callable[[Daemon], Coroutine[Any, Any, None]] | None = None,
        on_stopping: Callable[[Daemon], Coroutine[Any, Any, None]] | None = None,
    ) -> None:
        self.config = config
        self.instance_id = new_instance_id()
        self.metrics = Metrics()
        self._on_ready = on_ready
        self._on_started = on_started
        self._on_stopping = on_stopping
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()
        """Set by a second stop signal: stop waiting for claims and stop hooks, stop now."""
        self._waker = Waker()
        self._listener: NotificationListener | None = None
        self._db: Database | None = None
        self._server: SidecarServer | None = None
        self.reconciler: Reconciler | None = None
        self.admin: AdminServer | None = None
        self.hub_ws_url = ""
        self.store: AllocationStore | None = None
        self._router: SocketRouter | None = None
        self._connections: ConnectionStore | None = None
        self._verify_soon = asyncio.Event()
        self._heartbeating_since: float | None = None
        self._claims_waiting = False
        self._provisioners: dict[str, Provisioner] = {}
        """Monotonic time since which this instance's heartbeats have kept succeeding."""
        self._last_heartbeat = 0.0
        """Monotonic time of the last heartbeat the database accepted."""
        self._announcement: dict[str, object] = {}
        self._provisioner_ids: list[str] = []

    def stop(self) -> None:
        """Ask the daemon to shut down (what SIGTERM does); asked again, stop without waiting
        for claims in progress or the stop hook (an operator pressing Ctrl-C twice)."""
        if self._stopping.is_set():
            if not self._hurry.is_set():
                log.warning("second stop signal: stopping now, without waiting")
            self._hurry.set()
        self._stopping.set()

    @property
    def hurried(self) -> bool:
        """Whether a second stop signal cut the shutdown short."""
        return self._hurry.is_set()

    async def _unless_hurried(self, work: Coroutine[Any, Any, Any], limit: float) -> bool:
        """Await ``work`` for at most ``limit`` seconds, or until a second stop signal; cancel
        it then. ``True`` when it finished in time (its exceptions propagate)."""
        task = asyncio.ensure_future(work)
        hurry = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait({task, hurry}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pending in (task, hurry):
                if not pending.done():
                    pending.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await pending
        if task.cancelled():
            return False
        task.result()
        return True

    async def run(self) -> int:
        provisioners = load_provisioners(self.config.provisioners, state_dir=self.config.state_path)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        try:
            async with resolve_dsn(self.config.database.url, self.config.state_path) as dsn:
                return await self._run_with(dsn, provisioners)
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    async def _run_with(self, dsn: str, provisioners: dict[str, Provisioner]) -> int:
        cfg = self.config
        rc = cfg.reconciler
        db = await connect_database(
            dsn, pool_size=cfg.database.pool_size, command_timeout=rc.operation_timeout
        )
        self._db = db
        try:
            async with db.connection("migrate") as conn:
                applied = await apply_migrations(conn)
            if applied:
                log.info("schema migrated", applied=[m.name for m in applied])
            return await self._serve(db, dsn, provisioners)
        finally:
            # Pools close before the embedded server is let go, or its shutdown would wait on
            # our connections.
            await db.close()

    async def _serve(self, db: Database, dsn: str, provisioners: dict[str, Provisioner]) -> int:
        self._provisioners = provisioners
        cfg = self.config
        keepalive = SIDECAR_PING_INTERVAL + SIDECAR_PING_TIMEOUT
        if cfg.reconciler.connect_timeout < cfg.instance.ttl + keepalive:
            # A sidecar notices a frozen replica only when its keepalive fails; its records
            # are swept after one TTL. A connect deadline shorter than both gives up on a
            # healthy sidecar before it can reach a live replica.
            log.warning(
                "reconciler.connect_timeout is shorter than instance.ttl plus the reference "
                "sidecar's keepalive: a sidecar whose replica freezes may be given up before "
                "it reaches another",
                connect_timeout=cfg.reconciler.connect_timeout,
                needed=cfg.instance.ttl + keepalive,
            )
        rc = cfg.reconciler
        instances = InstanceStore(db)
        connections = ConnectionStore(
            db, instance_id=self.instance_id, ready_on_connect=self._on_ready is None
        )
        router = SocketRouter(
            connections,
            instance_ttl=cfg.instance.ttl,
            connect_timeout=rc.connect_timeout,
            event_timeout=rc.operation_timeout,
        )
        self._router = router
        self._connections = connections
        limits = ListenerLimits()
        plan = plan_descriptors(
            raise_open_file_limit()[0],
            requested=limits.max_connections,
            # The three pools and the wake-up listener's own connection.
            pool_connections=cfg.database.pool_size + 2 + 2 + 1,
        )
        if plan.too_low:
            log.warning(
                "open_file_limit_low",
                limit=plan.limit,
                reserved=plan.reserved,
                max_connections=plan.max_connections,
                wanted=plan.requested,
                hint="raise LimitNOFILE= (or ulimit -n) so every sidecar socket fits",
            )
        server = SidecarServer.from_config(
            cfg.server,
            router=router,
            connections=connections,
            limits=limits,
            max_connections=plan.max_connections,
        )
        self._server = server
        try:
            await server.start()
        except OSError as exc:
            raise listen_error("server.listen", cfg.server.listen, exc) from None
        self.hub_ws_url = cfg.server.public_url or cfg.server.public_url_for(server.port)
        self._provisioner_ids = sorted(provisioners)
        await instances.register(
            self.instance_id,
            socket.gethostname(),
            os.getpid(),
            self.hub_ws_url,
            self._provisioner_ids,
        )
        self._heartbeating_since = self._last_heartbeat = time.monotonic()
        store = AllocationStore(db, instance_id=self.instance_id)
        self.store = store
        reconciler = Reconciler(
            store=store,
            ledger=LedgerStore(db, instance_id=self.instance_id),
            connections=connections,
            provisioners=provisioners,
            router=router,
            hub_ws_url=self.hub_ws_url,
            settings=ReconcilerSettings(
                lease_duration=rc.lease_duration,
                connect_timeout=rc.connect_timeout,
                operation_timeout=rc.operation_timeout,
                max_concurrent_claims=rc.max_concurrent_claims,
                automatic_replacement_recovery=rc.automatic_replacement_recovery,
                instance_ttl=cfg.instance.ttl,
            ),
            on_ready=self._on_ready,
            observer=self.metrics,
            on_settled=self._waker.wake,
        )
        self.reconciler = reconciler
        self.metrics.bind_gauges(
            active_claims=lambda: reconciler.active_claims,
            queue_depth=lambda: reconciler.queue_depth,
            connected_sidecars=lambda: router.connection_count,
        )
        self.metrics.bind_listener(server.stats)
        self._listener = NotificationListener(
            dsn=dsn,
            db=db,
            on_wake=self._waker.wake,
            on_connected=self._on_connected_notice,
            on_sockets=self._on_sockets_notice,
            on_reconnected=self._verify_soon.set,
            selfcheck_interval=max(rc.poll_interval * 2, 5.0),
            on_selfcheck_failure=self.metrics.selfcheck_failures.inc,
        )
        admin = AdminServer(
            host=cfg.admin.host,
            port=cfg.admin.port,
            readiness=self._readiness,
            metrics=self.metrics.render,
        )
        self.admin = admin
        try:
            await self._initialize(reconciler)
            try:
                await admin.start()
            except OSError as exc:
                raise listen_error("admin.listen", cfg.admin.listen, exc) from None
            self._announcement = {
                "instance_id": self.instance_id,
                "sidecar_url": self.hub_ws_url,
                "admin": f"http://{cfg.admin.host}:{admin.port}",
                "provisioners": sorted(provisioners),
            }
            return await self._supervise(db, reconciler, instances, connections)
        finally:
            notify("STOPPING=1")
            await self._shutdown(server, admin, instances, connections)

    async def _initialize(self, reconciler: Reconciler) -> None:
        # A database that is briefly away at start is waited for, not fatal.
        delay = 0.5
        while True:
            try:
                await reconciler.initialize()
                return
            except DatabaseUnavailable as exc:
                log.warning("start-up repair waits for the database", error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _supervise(
        self,
        db: Database,
        reconciler: Reconciler,
        instances: InstanceStore,
        connections: ConnectionStore,
    ) -> int:
        assert self._listener is not None
        store = self.store
        assert store is not None
        try:
            async with asyncio.TaskGroup() as group:

                def start(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
                    return group.create_task(self._supervised(name, coro), name=name)

                dispatcher = start("claim-dispatcher", self._dispatch_loop(reconciler))
                start("wake-listener", self._listener.run())
                start("announce-ready", self._announce_ready())
                start("heartbeat", self._heartbeat(instances))
                start("repair", self._repair_loop(reconciler, connections, instances))
                start("socket-check", self._socket_check_loop())
                if self.config.orphans.mode != "off":
                    start("orphans", self._orphan_loop(store, db))
                start("allocation-counts", self._count_loop(store))
                start("watchdog", self._watchdog())
                start("shutdown", self._stop_when_asked(dispatcher, reconciler))
        except* _Stop:
            log.info("claims stopped")
        return 0

    async def _supervised(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run a background task; if it dies, say which one, loudly, and let the group stop
        the daemon."""
        try:
            await coro
        except (asyncio.CancelledError, _Stop):
            raise
        except BaseException:
            log.critical("background task died; stopping hubd", task=name, exc_info=True)
            raise

    async def _announce_ready(self) -> None:
        """READY=1 once every listener serves: sidecars, admin, and the wake-up LISTEN."""
        assert self._listener is not None
        await self._listener.up.wait()
        notify("READY=1")
        log.info("hubd running", **self._announcement)
        if self._on_started is not None:
            await self._on_started(self)

    async def _stop_when_asked(
        self, dispatcher: asyncio.Task[None], reconciler: Reconciler
    ) -> None:
        await self._stopping.wait()
        log.info("stopping: no new claims; waiting for claims in progress")
        self._waker.wake()
        await asyncio.wait({dispatcher})
        grace = self.config.reconciler.shutdown_grace
        await self._unless_hurried(reconciler.wait_claims(), grace)
        unfinished = reconciler.cancel_claims()
        if unfinished:
            log.warning(
                "grace period over; abandoning claims in progress (their leases will expire)",
                claims=unfinished,
            )
        raise _Stop

    async def _dispatch_loop(self, reconciler: Reconciler) -> None:
        """The claim dispatcher: claim as many due allocations as there are free claim slots,
        in one statement, then sleep until woken (a request, a connect, a claim that ended) or
        the next poll. Idle, it costs one statement per poll interval, whatever the number of
        claim slots."""
        poll = self.config.reconciler.poll_interval
        backoff = 0.5
        while not self._stopping.is_set():
            raise_if_cancelled()
            try:
                claimed = await reconciler.claim_batch()
                backoff = 0.5
                if self._claims_waiting:
                    self._claims_waiting = False
                    log.info("claims reach the database again")
            except (DatabaseUnavailable, OperationTimeout) as exc:
                self.metrics.loop_errors.labels(kind=type(exc).__name__).inc()
                if not self._claims_waiting:
                    self._claims_waiting = True
                    log.warning("claims wait for the database", error=str(exc))
                else:
                    log.debug("claims still wait for the database", error=str(exc))
                await self._pause(backoff)
                backoff = min(backoff * 2, poll)
                continue
            except StoreError as exc:
                self.metrics.loop_errors.labels(kind=type(exc).__name__).inc()
                log.exception("claim failed in the store")
                await self._pause(poll)
                continue
            if claimed == 0 or reconciler.free_capacity == 0:
                # Nothing more is due, or every slot is taken: a claim that ends wakes us.
                await self._waker_or_stop(poll)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()

    async def _waker_or_stop(self, seconds: float) -> None:
        if not self._stopping.is_set():
            await self._waker.wait(seconds)

    async def _heartbeat(self, instances: InstanceStore) -> None:
        interval = self.config.instance.heartbeat_interval
        ttl = self.config.instance.ttl
        last_success = time.monotonic()
        pause = interval
        while True:
            raise_if_cancelled()
            await asyncio.sleep(pause)
            try:
                present = await instances.heartbeat(self.instance_id)
                if not present:
                    # Removed by an operator or judged dead by a peer: come back, since our
                    # sockets are real.
                    await instances.register(
                        self.instance_id,
                        socket.gethostname(),
                        os.getpid(),
                        self.hub_ws_url,
                        self._provisioner_ids,
                    )
                    log.warning("instance row was missing; registered again")
                now = time.monotonic()
                if not present or now - last_success > ttl:
                    # Peers may have swept our records as dead meanwhile (a database outage, a
                    # pause, a starved pool): write back the records of every socket still
                    # open here before anything else, so no healthy sidecar is released.
                    self.metrics.heartbeat_lapses.inc()
                    log.warning(
                        "heartbeat lapsed; re-asserting the sockets held here",
                        seconds_since_last=round(now - last_success, 1),
                    )
                    self._verify_soon.set()
                    self._heartbeating_since = now
                elif self._heartbeating_since is None:
                    self._heartbeating_since = now
                last_success = self._last_heartbeat = now
                pause = interval
                self.metrics.database_up.set(1)
            except StoreError as exc:
                self._heartbeating_since = None
                self.metrics.database_up.set(0)
                log.warning("heartbeat failed", error=str(exc))
                # After a database restart every pooled connection is dead, and each would cost
                # one failed beat: replace them all at once, and try again soon, since peers
                # count this instance dead after one TTL without a beat.
                if self._db is not None:
                    await self._db.lease_pool.expire_connections()
                pause = 0.2 if pause >= interval else min(pause * 2, interval)

    def _may_judge_peers(self) -> bool:
        """Whether this instance has heartbeated without a break for a whole TTL. After an
        outage every replica comes back at once; one that sweeps before its peers had a TTL
        to heartbeat again would take their healthy sidecars for lost."""
        since = self._heartbeating_since
        return since is not None and time.monotonic() - since >= self.config.instance.ttl

    async def _socket_check_loop(self) -> None:
        """Compare the sockets held here with the database: on demand (a lapsed heartbeat, a
        re-opened listener) and every repair interval as the fallback for lost notifications."""
        router, interval = self._router, self.config.reconciler.repair_interval
        assert router is not None
        while True:
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._verify_soon.wait()
            self._verify_soon.clear()
            try:
                reasserted, closed = await router.verify()
            except StoreError as exc:
                log.warning("socket check failed", error=str(exc))
                # Try again soon: after an outage this is what restores readiness.
                await asyncio.sleep(min(interval, 1.0))
                self._verify_soon.set()
                continue
            self.metrics.connections_reasserted.inc(reasserted)
            self.metrics.remote_closes.inc(closed)
            if reasserted or closed:
                log.info("socket check", reasserted=reasserted, closed=closed)

    async def _orphan_loop(self, store: AllocationStore, db: Database) -> None:
        """Sweep provisioners that can list their sidecars for orphans (one replica at a
        time per provisioner, elected by an advisory lock)."""
        cfg = self.config.orphans
        collector = OrphanCollector(
            store=store,
            ledger=LedgerStore(db, instance_id=self.instance_id),
            grace=cfg.grace,
            dry_run=cfg.mode == "dry-run",
            destroy_unknown=cfg.destroy_unknown,
            operation_timeout=self.config.reconciler.operation_timeout,
            on_orphan=lambda provisioner, outcome: self.metrics.orphans.labels(
                provisioner=provisioner, outcome=outcome
            ).inc(),
        )
        while True:
            raise_if_cancelled()
            await asyncio.sleep(cfg.interval)
            try:
                await collector.sweep_all(self._provisioners)
            except (StoreError, TimeoutError) as exc:
                log.warning("orphan sweep failed", error=str(exc))

    def _on_connected_notice(self, payload: str) -> None:
        notice = parse_connected_payload(payload)
        if notice is None or self._router is None:
            return
        before = self._router.remote_closes
        self._router.notice_connected(notice)
        self.metrics.remote_closes.inc(self._router.remote_closes - before)

    def _on_sockets_notice(self, payload: str) -> None:
        control = parse_sockets_payload(payload)
        if control is None or self._router is None:
            return
        before = self._router.remote_closes
        self._router.apply_control(control)
        self.metrics.remote_closes.inc(self._router.remote_closes - before)

    async def _repair_loop(
        self, reconciler: Reconciler, connections: ConnectionStore, instances: InstanceStore
    ) -> None:
        interval = self.config.reconciler.repair_interval
        ttl = self.config.instance.ttl
        while True:
            raise_if_cancelled()
            await asyncio.sleep(interval)
            try:
                # Records of instances that stopped heartbeating (never our own: our sockets
                # are open, whatever our heartbeat says) are cleared and their sidecars get the
                # usual connect deadline to come back to a live replica, in one statement each.
                swept = (
                    await connections.sweep_stale(
                        ttl, connect_timeout=self.config.reconciler.connect_timeout
                    )
                    if self._may_judge_peers()
                    else []
                )
                if swept:
                    self.metrics.connections_swept.inc(len(swept))
                    log.warning(
                        "swept connection records of dead instances",
                        count=len(swept),
                        instances=sorted({s.instance_id for s in swept}),
                    )
                repaired = (
                    await reconciler.repair_unscheduled_connections()
                    if self._may_judge_peers()
                    else 0
                )
                if repaired:
                    log.info("repaired unscheduled allocations", count=repaired)
                deleted = await instances.delete_dead(ttl * DEAD_INSTANCE_TTLS)
                if deleted:
                    self.metrics.instances_deleted.inc(len(deleted))
                    log.info("deleted rows of dead instances", instances=deleted)
            except StoreError as exc:
                log.warning("repair sweep failed", error=str(exc))

    async def _count_loop(self, store: AllocationStore) -> None:
        statuses = [str(s) for s in Status]
        while True:
            raise_if_cancelled()
            try:
                counts = await store.status_counts()
                self.metrics.set_allocation_counts(
                    {str(status): n for status, n in counts.items()}, statuses
                )
                self.metrics.database_up.set(1)
            except StoreError:
                self.metrics.database_up.set(0)
            self.metrics.listener_up.set(1 if self._listener and self._listener.healthy else 0)
            await asyncio.sleep(self.config.reconciler.poll_interval)

    async def _watchdog(self) -> None:
        interval = watchdog_interval()
        if interval is None:
            return
        while True:
            raise_if_cancelled()
            notify("WATCHDOG=1")
            await asyncio.sleep(interval)

    async def _readiness(self) -> str | None:
        """``None`` when ready; otherwise what is missing.

        Answered from state the daemon already holds (the heartbeat's last success, the
        listener's health), never by a query: a probe must answer at once even while a flood
        of handshakes or slow statements holds every connection, or a liveness check would
        restart a daemon that is merely busy.
        """
        if self._stopping.is_set():
            return "shutting down"
        if self._db is None or self._server is None:
            return "starting"
        # Unready only once the heartbeat is overdue by the TTL, as peers judge it: one failed
        # beat under load is not an outage.
        if time.monotonic() - self._last_heartbeat > self.config.instance.ttl:
            return "database unreachable"
        if self._listener is None or not self._listener.healthy:
            return "wake-up listener down"
        return None

    async def _shutdown(
        self,
        server: SidecarServer,
        admin: AdminServer,
        instances: InstanceStore,
        connections: ConnectionStore,
    ) -> None:
        started = time.monotonic()
        if self._on_stopping is not None:
            try:
                finished = await self._unless_hurried(
                    self._on_stopping(self), self.config.reconciler.shutdown_grace
                )
            except StoreError as exc:
                log.warning("stop hook did not finish", error=str(exc))
            else:
                if not finished:
                    log.warning(
                        "stop hook did not finish",
                        error="second stop signal" if self.hurried else "shutdown_grace passed",
                    )
        await server.close()
        with contextlib.suppress(StoreError, OSError, asyncpg.PostgresError):
            # Records and their sidecars' connect deadlines settled at once, so no allocation
            # reads ready behind a socket that is gone; a record a sidecar already wrote on a
            # peer is not this instance's and is left alone.
            await connections.release_instance(
                connect_timeout=self.config.reconciler.connect_timeout
            )
            await instances.remove(self.instance_id)
        if self.reconciler is not None:
            await self._unless_hurried(self.reconciler.drain(), 5.0)
        await admin.close()
        await self._say_what_keeps_running()
        log.info("hubd stopped", seconds=round(time.monotonic() - started, 2))

    async def _say_what_keeps_running(self) -> None:
        """Sidecars outlive the daemon on purpose (they reconnect to the next one); an operator
        who stopped hubd should hear that they are still there."""
        for provisioner_id, provisioner in sorted(self._provisioners.items()):
            if not isinstance(provisioner, ListsSidecars):
                continue
            try:
                async with asyncio.timeout(5):
                    running = len(await provisioner.list_sidecars())
            except Exception as exc:  # noqa: BLE001 -- a plugin's failure must not spoil the stop
                log.debug(
                    "could not list sidecars at stop", provisioner=provisioner_id, error=str(exc)
                )
                continue
            if running:
                log.info(
                    "sidecars keep running after hubd stops; they reconnect to the next hubd, "
                    "and `hubd alloc release ID` stops one for good",
                    provisioner=provisioner_id,
                    sidecars=running,
                )
