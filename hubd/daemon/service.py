"""``hubd run``: every part wired together, supervised, and shut down in order.

The daemon's lifetimes are one :class:`contextlib.AsyncExitStack`, entered in the order the parts
must start and left in the reverse order, each ordering rule stated where it is entered:
database → pools → sidecar listener → instance registration → admin listener → background
tasks. Plugins and the configured on-ready hook load before any of it (a bad one is a config
error, before anything starts).

Shutdown (SIGTERM / SIGINT): stop claiming, give in-flight claims ``shutdown_grace`` to finish
(then cancel them: their leases expire, nothing is written half-way), run the stop hook, close
the admin listener, close sidecar sockets with 1001, remove the instance row, let the
reconciler's own work settle, close the pools, and let go of the embedded server.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any

import structlog

from hubd.backoff import Retries
from hubd.config import Config
from hubd.daemon.feedwatch import FeedLockWatch
from hubd.daemon.heartbeat import Heartbeat, registered
from hubd.daemon.hooks import load_on_ready
from hubd.daemon.loops import loop_name
from hubd.daemon.metrics import Metrics
from hubd.daemon.pools import PoolKeeper
from hubd.daemon.running import (
    Listening,
    Running,
    listen_error,
    listening,
    new_instance_id,
    opened_database,
)
from hubd.daemon.stopping import Stopping, say_what_keeps_running
from hubd.daemon.supervisor import Supervisor
from hubd.daemon.sweeps import Sweeps
from hubd.daemon.systemd import notify
from hubd.daemon.wakeups import Waker
from hubd.errors import DatabaseUnavailable, StoreError
from hubd.http import HttpApi, serving
from hubd.plugins.protocol import Provisioner
from hubd.plugins.registry import load_provisioners
from hubd.reconciler.engine import Reconciler
from hubd.reconciler.settings import Hook
from hubd.store.channels import read_notice_key
from hubd.store.connect import resolve_dsn
from hubd.store.events import EventStore
from hubd.store.pools import PoolStore

__all__ = ["Daemon", "Running", "listen_error", "new_instance_id"]

log = structlog.get_logger(__name__)

DaemonHook = Callable[["Daemon"], Coroutine[Any, Any, None]]


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        on_ready: Hook | None = None,
        on_started: DaemonHook | None = None,
        on_stopping: DaemonHook | None = None,
    ) -> None:
        self.config = config
        self.instance_id = new_instance_id()
        self.metrics = Metrics()
        self._on_ready = on_ready
        self._on_started = on_started
        self._on_stopping = on_stopping
        self._stopping = Stopping()
        self.http: HttpApi | None = None
        """The HTTP API once it listens (``None``: not configured)."""
        self._waker = Waker()
        self._verify_soon = asyncio.Event()
        """Set when the sockets held here must be compared with the database soon."""
        self._running: Running | None = None
        self._heartbeat: Heartbeat | None = None
        self._feed_lock: FeedLockWatch | None = None
        self._stop_began: float | None = None

    @property
    def running(self) -> Running:
        """What the daemon is running; only while it runs (the hooks are called then)."""
        if self._running is None:
            raise RuntimeError("the daemon is not running")
        return self._running

    def stop(self) -> None:
        """Ask the daemon to shut down (what SIGTERM does); asked again, stop without waiting
        for claims in progress or the stop hook (an operator pressing Ctrl-C twice)."""
        self._stopping.stop()

    @property
    def hurried(self) -> bool:
        """Whether a second stop signal cut the shutdown short."""
        return self._stopping.hurried

    async def run(self) -> int:
        provisioners = load_provisioners(self.config.provisioners, state_dir=self.config.state_path)
        if self._on_ready is None:
            # A hook handed in by an embedder wins over the configured one.
            self._on_ready = load_on_ready(self.config.reconciler.on_ready)
        loop = asyncio.get_running_loop()
        # The loop actually running, whatever asked for it (``hubd run``, or a test's own).
        self.metrics.event_loop.labels(loop=loop_name(loop)).set(1)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stop)
        try:
            return await self._run(provisioners)
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)

    async def _run(self, provisioners: Mapping[str, Provisioner]) -> int:
        cfg = self.config
        async with contextlib.AsyncExitStack() as stack:
            # The embedded server, if any, is let go last: everything below connects to it.
            dsn = await stack.enter_async_context(resolve_dsn(cfg.database.url, cfg.state_path))
            # The pools close after every part that uses them has stopped, and before the
            # embedded server goes, or its shutdown would wait on our connections.
            db = await stack.enter_async_context(opened_database(dsn, cfg))
            parts = Listening.build(
                cfg,
                db,
                dsn,
                self.instance_id,
                # Read once: the key never changes (migration 0018).
                notice_key=await read_notice_key(db),
                ready_on_connect=self._on_ready is None,
                events=self.metrics,
            )
            # The listener binds before anything is announced: the URL sidecars are told to
            # dial names its port.
            hub_ws_url = await stack.enter_async_context(listening(parts, cfg))
            pools = PoolKeeper(
                PoolStore(db, instance_id=self.instance_id),
                pools=cfg.pools,
                served=sorted(provisioners),
                metrics=self.metrics.pools,
            )

            running = Running.build(
                cfg,
                parts,
                hub_ws_url=hub_ws_url,
                provisioners=provisioners,
                metrics=self.metrics,
                on_ready=self._on_ready,
                on_wake=self._waker.wake,
                on_notified=self._waker.notify,
                on_taken=pools.nudge,
                on_reconnected=self._verify_soon.set,
                readiness=self._readiness,
                readiness_detail=self._readiness_detail,
            )
            # The reconciler's own work settles after the sockets close (closing them hands it
            # connection events) and before the pools close (its last writes need them).
            stack.push_async_callback(self._wind_down, running)
            provisioner_ids = sorted(provisioners)
            # The instance row goes in once the URL is known; on the way out it goes after the
            # sidecar listener stopped accepting (see registered()).
            await stack.enter_async_context(
                registered(
                    parts,
                    hub_ws_url=hub_ws_url,
                    provisioner_ids=provisioner_ids,
                    connect_timeout=cfg.reconciler.connect_timeout,
                )
            )
            self._heartbeat = Heartbeat(
                parts,
                hub_ws_url=hub_ws_url,
                provisioner_ids=provisioner_ids,
                metrics=self.metrics,
                interval=cfg.instance.heartbeat_interval,
                ttl=cfg.instance.ttl,
                verify_soon=self._verify_soon,
                on_recovered=running.listener.recycle,
            )
            self._feed_lock = FeedLockWatch(
                EventStore(db),
                self.metrics,
                alarm=cfg.events.lock_wait_alarm,
                limit=cfg.events.lock_hold_limit,
            )
            self._running = running
            # Start-up repair comes before anything says ready: a probe that passes must find
            # the allocations this instance left behind already taken care of.
            await _initialize(running.reconciler)
            # The admin listener answers once start-up repair is done, and stays up while the
            # stop hook runs.
            await stack.enter_async_context(self._admin_listening(running))
            # The HTTP API answers from here on, and stops before the sidecar sockets close.
            self.http = await stack.enter_async_context(serving(cfg.http, dsn, db))
            # The stop hook runs once the background tasks have ended, with every listener still
            # up: it may need sidecars and the reconciler to finish what it asks for.
            stack.push_async_callback(self._run_stop_hook)
            sweeps = Sweeps(
                config=cfg,
                running=running,
                metrics=self.metrics,
                heartbeat=self._heartbeat,
                feed_lock=self._feed_lock,
                verify_soon=self._verify_soon,
                pools=pools,
            )
            return await Supervisor(
                sweeps=sweeps, stopping=self._stopping, waker=self._waker, announce=self._announce
            ).run()
        raise AssertionError("unreachable")  # pragma: no cover -- the stack does not swallow

    @contextlib.asynccontextmanager
    async def _admin_listening(self, running: Running) -> AsyncIterator[None]:
        try:
            await running.admin.start()
        except OSError as exc:
            raise listen_error("admin.listen", self.config.admin.listen, exc) from None
        try:
            yield
        finally:
            await running.admin.close()

    async def _announce(self) -> None:
        running = self.running
        log.info(
            "hubd_running",
            instance_id=self.instance_id,
            sidecar_url=running.hub_ws_url,
            admin=f"http://{self.config.admin.host}:{running.admin.port}",
            http=None if self.http is None else f"{self.config.http.host}:{self.http.port}",
            provisioners=sorted(running.provisioners),
            event_loop=loop_name(asyncio.get_running_loop()),
        )
        if self._on_started is not None:
            await self._on_started(self)

    async def _run_stop_hook(self) -> None:
        self._stop_began = time.monotonic()
        notify("STOPPING=1")
        if self._on_stopping is None:
            return
        try:
            finished = await self._stopping.unless_hurried(
                self._on_stopping(self), self.config.reconciler.shutdown_grace
            )
        except StoreError as exc:
            log.warning("stop_hook_unfinished", error=str(exc))
        else:
            if not finished:
                log.warning(
                    "stop_hook_unfinished",
                    error="second stop signal" if self.hurried else "shutdown_grace passed",
                )

    async def _wind_down(self, running: Running) -> None:
        began = self._stop_began or time.monotonic()
        await self._stopping.unless_hurried(running.reconciler.drain(), 5.0)
        await say_what_keeps_running(running.provisioners)
        log.info("hubd_stopped", seconds=round(time.monotonic() - began, 2))

    def _readiness(self) -> str | None:
        """``None`` when ready; otherwise what is missing.

        Answered from state the daemon already holds (the heartbeat's last success, the
        listener's health, the feed lock watch's last reading), never by a query: a probe must
        answer at once even while a flood of handshakes or slow statements holds every
        connection, or a liveness check would restart a daemon that is merely busy. Called on
        the admin listener's own thread, so it reads only flags, monotonic times and strings
        replaced whole.
        """
        if self._stopping.requested.is_set():
            return "shutting down"
        if self._running is None or self._heartbeat is None:
            return "starting"
        if self._heartbeat.read_only:
            # A read-only server answers at once, so no beat is overdue; but none can write.
            return "database read-only"
        if self._heartbeat.overdue:
            return "database unreachable"
        if not self._running.listener.healthy:
            return "wake-up listener down"
        # Last: while the database is away the watch keeps its last reading, and the heartbeat's
        # word is the one that holds then.
        if self._feed_lock is not None and self._feed_lock.problem is not None:
            return self._feed_lock.problem
        return None

    def _readiness_detail(self) -> list[str]:
        """What works only in part, for ``/readyz`` whatever its answer: each provisioner whose
        reports of dead sidecars this daemon does not follow. Read on the admin thread, from
        states replaced whole."""
        running = self._running
        if running is None:
            return []
        lines = (watch.state.describe(watch.provisioner_id) for watch in running.exits)
        return [line for line in lines if line is not None]


async def _initialize(reconciler: Reconciler) -> None:
    # A database that is briefly away at start is waited for, not fatal.
    retries = Retries.doubling(0.5, 10.0)
    while True:
        try:
            await reconciler.initialize()
            return
        except DatabaseUnavailable as exc:
            log.warning("startup_repair_waits_for_database", error=str(exc))
            await asyncio.sleep(retries.next_delay())
