"""The daemon's background tasks in one TaskGroup: the claim dispatcher, listeners, sweeps, and
the stop.

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

from hubd.aio import raise_if_cancelled
from hubd.backoff import Retries
from hubd.daemon.stopping import Stopping
from hubd.daemon.sweeps import Sweeps, watchdog
from hubd.daemon.systemd import notify
from hubd.daemon.wakeups import Waker
from hubd.errors import DatabaseUnavailable, OperationTimeout, StoreError
from hubd.reconciler.engine import Reconciler

__all__ = ["Supervisor"]

log = structlog.get_logger(__name__)

GATHER_SECONDS = 0.05
"""How long the dispatcher, under a backlog, waits for more claim slots to free before its
next claim statement (see ``Supervisor._gather_slots``)."""

RECHECKS = (0.05, 0.25, 1.0)
"""After a notification whose claim found nothing, when to look again (seconds, in turn) before
falling back to the poll: long enough for a statement that held the row to commit."""


class _Stop(Exception):
    """Raised inside the TaskGroup to end it on purpose (a signal arrived)."""


@attrs.define(kw_only=True)
class Supervisor:
    sweeps: Sweeps
    stopping: Stopping
    waker: Waker
    announce: Callable[[], Awaitable[None]]
    _claims_waiting: bool = attrs.field(default=False, init=False)
    """Whether claims are waiting out a database outage (said once per outage)."""

    async def run(self) -> int:
        reconciler = self.sweeps.running.reconciler
        try:
            async with asyncio.TaskGroup() as group:

                def start(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
                    return group.create_task(_supervised(name, coro), name=name)

                dispatcher = start("claim-dispatcher", self._dispatch(reconciler))
                start("wake-listener", self.sweeps.running.listener.run())
                start("announce-ready", self._announce_ready())
                start("heartbeat", self.sweeps.heartbeat.run())
                start("feed-lock-watch", self.sweeps.feed_lock.run())
                start("repair", self.sweeps.repair())
                start("socket-check", self.sweeps.socket_check())
                start("deadlines", self.sweeps.deadlines(self.waker.requested))
                start("pools", self.sweeps.pools.run())
                if self.sweeps.config.orphans.mode != "off":
                    start("orphans", self.sweeps.orphans())
                for watch in self.sweeps.running.exits:
                    start(f"exit-watch-{watch.provisioner_id}", watch.run())
                start("watchdog", watchdog())
                start("shutdown", self._stop_when_asked(dispatcher, reconciler))
        except* _Stop:
            log.info("claims_stopped")
        return 0

    async def _announce_ready(self) -> None:
        """READY=1 once every listener serves: sidecars, admin, and the wake-up LISTEN."""
        await self.sweeps.running.listener.up.wait()
        notify("READY=1")
        await self.announce()

    async def _stop_when_asked(
        self, dispatcher: asyncio.Task[None], reconciler: Reconciler
    ) -> None:
        await self.stopping.requested.wait()
        log.info("stopping_claims_waiting_for_claims_in_progress")
        self.waker.wake()
        await asyncio.wait({dispatcher})
        await self.stopping.unless_hurried(
            reconciler.wait_claims(), self.sweeps.config.reconciler.shutdown_grace
        )
        unfinished = reconciler.cancel_claims()
        if unfinished:
            log.warning(
                "grace_period_over_abandoning_claims",
                hint="their leases will expire",
                claims=unfinished,
            )
        raise _Stop

    async def _dispatch(self, reconciler: Reconciler) -> None:
        """The claim dispatcher: claim as many due allocations as there are free claim slots,
        in one statement, then sleep until woken (a request, a connect, a claim that ended) or
        the next poll. Idle, it costs one statement per poll interval, whatever the number of
        claim slots."""
        poll = self.sweeps.config.reconciler.poll_interval
        stopping = self.stopping.requested
        retries = Retries.doubling(0.5, poll)
        rechecks: list[float] = []
        while not stopping.is_set():
            raise_if_cancelled()
            asked = reconciler.free_capacity
            try:
                claimed = await reconciler.claim_batch()
                retries.reset()
                if self._claims_waiting:
                    self._claims_waiting = False
                    log.info("claims_reach_database_again")
            except (DatabaseUnavailable, OperationTimeout) as exc:
                self.sweeps.metrics.loop_errors.labels(kind=type(exc).__name__).inc()
                # An outage meets every attempt: one warning per outage, the rest at debug.
                if not self._claims_waiting:
                    self._claims_waiting = True
                    log.warning("claims_wait_for_database", error=str(exc))
                else:
                    log.debug("claims_still_wait_for_database", error=str(exc))
                # A wake-up ends the pause early: the one that matters comes from the
                # notification listener listening again, the moment the database is back.
                await self.waker.wait(retries.next_delay())
                continue
            except StoreError as exc:
                self.sweeps.metrics.loop_errors.labels(kind=type(exc).__name__).inc()
                log.exception("claim_failed_in_store")
                await self._pause(poll)
                continue
            if (claimed == 0 or reconciler.free_capacity == 0) and not stopping.is_set():
                if claimed == 0 and rechecks:
                    # The database said something is due and the claim found nothing: the row
                    # may have been locked for a moment by another statement (a claim skips
                    # locked rows, and that statement announces nothing). Look again soon.
                    notified = await self.waker.wait(rechecks.pop(0))
                else:
                    # Nothing more is due, or every slot is taken: a claim that ends wakes us.
                    notified = await self.waker.wait(poll)
                    rechecks = []
                if notified:
                    rechecks = list(RECHECKS)
            if 0 < asked == claimed:
                await self._gather_slots(reconciler)

    async def _gather_slots(self, reconciler: Reconciler) -> None:
        """After a batch that filled every slot it asked for (more rows may be due), wait a
        moment for a quarter of the slots to be free, so the next claim statement leases
        several rows rather than one per claim that ends. Bounded by ``GATHER_SECONDS``, a
        cool-down in the manner of River's fetch cool-down: at most that much latency, and
        only while a backlog lasts. While slots are held back from the busiest tenant
        (``Reconciler.holding_back``), a notification ends it: new work is due, perhaps another
        tenant's, which those slots can take now."""
        wanted = max(1, reconciler.settings.max_concurrent_claims // 4)
        loop = asyncio.get_running_loop()
        until = loop.time() + GATHER_SECONDS
        while reconciler.free_capacity < wanted and not self.stopping.requested.is_set():
            left = until - loop.time()
            if left <= 0 or (await self.waker.wait(left) and reconciler.holding_back):
                return

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
