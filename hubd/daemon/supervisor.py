"""The daemon's background tasks in one TaskGroup: claim slots, listeners, sweeps, and the stop.

If any task dies, the group cancels the rest and the daemon exits loudly with code 1. A stop
signal ends the group on purpose: claiming stops, claims in progress get ``shutdown_grace`` to
finish (then they are cancelled: their leases expire, nothing is written half-way).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import attrs
import structlog

from hubd.backoff import Retries
from hubd.daemon.cancellation import raise_if_cancelled
from hubd.daemon.stopping import Stopping
from hubd.daemon.sweeps import Sweeps, watchdog
from hubd.daemon.systemd import notify
from hubd.daemon.wakeups import Waker
from hubd.errors import DatabaseUnavailable, OperationTimeout, StoreError
from hubd.reconciler.engine import Reconciler

__all__ = ["Supervisor"]

log = structlog.get_logger(__name__)


class _Stop(Exception):
    """Raised inside the TaskGroup to end it on purpose (a signal arrived)."""


@attrs.define(kw_only=True)
class Supervisor:
    sweeps: Sweeps
    stopping: Stopping
    waker: Waker
    announce: Callable[[], Awaitable[None]]
    _claims_waiting: bool = attrs.field(default=False, init=False)
    """Whether the claim slots are waiting out a database outage (said once, not per slot)."""

    async def run(self) -> int:
        workers: set[asyncio.Task[None]] = set()
        reconciler = self.sweeps.running.reconciler
        try:
            async with asyncio.TaskGroup() as group:

                def start(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
                    return group.create_task(_supervised(name, coro), name=name)

                for index in range(self.sweeps.config.reconciler.max_concurrent_claims):
                    workers.add(start(f"claim-{index}", self._claim_loop(reconciler)))
                start("wake-listener", self.sweeps.running.listener.run())
                start("announce-ready", self._announce_ready())
                start("heartbeat", self.sweeps.heartbeat.run())
                start("repair", self.sweeps.repair())
                start("socket-check", self.sweeps.socket_check())
                if self.sweeps.config.orphans.mode != "off":
                    start("orphans", self.sweeps.orphans())
                start("allocation-counts", self.sweeps.counts())
                start("watchdog", watchdog())
                start("shutdown", self._stop_when_asked(workers))
        except* _Stop:
            log.info("claim_loops_stopped")
        return 0

    async def _announce_ready(self) -> None:
        """READY=1 once every listener serves: sidecars, admin, and the wake-up LISTEN."""
        await self.sweeps.running.listener.up.wait()
        notify("READY=1")
        await self.announce()

    async def _stop_when_asked(self, workers: set[asyncio.Task[None]]) -> None:
        await self.stopping.requested.wait()
        log.info("stopping_claims_waiting_for_claims_in_progress")
        self.waker.wake()
        if workers:
            await self.stopping.unless_hurried(
                asyncio.wait(workers), self.sweeps.config.reconciler.shutdown_grace
            )
        unfinished = [w for w in workers if not w.done()]
        if unfinished:
            log.warning(
                "grace_period_over_abandoning_claims",
                hint="their leases will expire",
                claims=len(unfinished),
            )
        raise _Stop

    async def _claim_loop(self, reconciler: Reconciler) -> None:
        """One claim slot: reconcile while there is work, sleep until woken or the next poll."""
        poll = self.sweeps.config.reconciler.poll_interval
        stopping = self.stopping.requested
        retries = Retries.doubling(0.5, poll)
        while not stopping.is_set():
            raise_if_cancelled()
            try:
                worked = await reconciler.reconcile_next()
                retries.reset()
                if self._claims_waiting:
                    self._claims_waiting = False
                    log.info("claim_loops_reach_database_again")
            except (DatabaseUnavailable, OperationTimeout) as exc:
                self.sweeps.metrics.loop_errors.labels(kind=type(exc).__name__).inc()
                # Every claim slot meets the same outage at once: one warning per outage, not
                # one per slot; the others say it at debug.
                if not self._claims_waiting:
                    self._claims_waiting = True
                    log.warning("claim_loops_wait_for_database", error=str(exc))
                else:
                    log.debug("claim_loop_waits_for_database", error=str(exc))
                await self._pause(retries.next_delay())
                continue
            except StoreError as exc:
                self.sweeps.metrics.loop_errors.labels(kind=type(exc).__name__).inc()
                log.exception("claim_failed_in_store")
                await self._pause(poll)
                continue
            if not worked and not stopping.is_set():
                await self.waker.wait(poll)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.stopping.requested.wait()


async def _supervised(name: str, coro: Coroutine[Any, Any, None]) -> None:
    """Run a background task; if it dies, say which one, loudly, and let the group stop the
    daemon."""
    try:
        await coro
    except (asyncio.CancelledError, _Stop):
        raise
    except BaseException:
        log.critical("background_task_died_stopping_hubd", task=name, exc_info=True)
        raise
