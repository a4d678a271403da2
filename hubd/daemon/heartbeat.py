"""This instance's row: registered at start, heartbeated while running, removed at the end.

Peers judge an instance by its heartbeat alone; the daemon judges itself by the same clock, so
readiness and the right to sweep peers both follow from when the database last took a beat.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence

import structlog

from hubd.aio import raise_if_cancelled
from hubd.backoff import Retries
from hubd.daemon.metrics import Metrics
from hubd.daemon.running import Listening
from hubd.errors import DatabaseReadOnly, StoreError
from hubd.store.database import try_hosts

__all__ = ["Heartbeat", "registered"]

log = structlog.get_logger(__name__)

HOSTS_REPORT_INTERVAL = 30.0
"""While beats fail, how often at most the log says what each of the URL's hosts answers."""

FAILING_RETRY_CAP = 1.0
"""While beats fail, the longest pause before the next one. The first beat that gets through
after an outage is what makes this instance ready again (and alive to its peers), so it is tried
about every second, whatever ``heartbeat_interval`` is; each try costs a connection attempt.
With a beat's own budget (the interval) this bounds the time from a healed partition to ready:
a beat in flight on a dead connection runs out its budget, the next one follows within this."""

FAILED_LOG_INTERVAL = 5.0
"""While beats fail, how often at most each failure is logged (the count of failures since the
last success goes with it): a database that refuses at once would otherwise log one a second."""


@contextlib.asynccontextmanager
async def registered(
    parts: Listening, *, hub_ws_url: str, provisioner_ids: Sequence[str], connect_timeout: float
) -> AsyncIterator[None]:
    """This instance's row, announcing the URL its sidecars dial."""
    await _register(parts, hub_ws_url, provisioner_ids)
    try:
        yield
    finally:
        # The sidecar listener stops accepting before the records go: a socket accepted after
        # they were released would write a record nobody clears. (Closing is idempotent; the
        # listener's own exit then has nothing left to do.)
        await parts.server.close()
        with contextlib.suppress(StoreError):
            # Records and their sidecars' connect deadlines settled at once, so no allocation
            # reads ready behind a socket that is gone; a record a sidecar already wrote on a
            # peer is not this instance's and is left alone.
            await parts.connections.release_instance(connect_timeout=connect_timeout)
            await parts.instances.remove(parts.instance_id)


async def _register(parts: Listening, hub_ws_url: str, provisioner_ids: Sequence[str]) -> None:
    await parts.instances.register(
        parts.instance_id, socket.gethostname(), os.getpid(), hub_ws_url, list(provisioner_ids)
    )


class Heartbeat:
    """The heartbeat loop, and what the daemon knows from it."""

    def __init__(
        self,
        parts: Listening,
        *,
        hub_ws_url: str,
        provisioner_ids: Sequence[str],
        metrics: Metrics,
        interval: float,
        ttl: float,
        verify_soon: asyncio.Event,
        on_recovered: Callable[[], None] = lambda: None,
    ) -> None:
        self._parts = parts
        self._on_recovered = on_recovered
        self._hub_ws_url = hub_ws_url
        self._provisioner_ids = provisioner_ids
        self._metrics = metrics
        self._interval = interval
        self._ttl = ttl
        self._verify_soon = verify_soon
        now = time.monotonic()
        self._since: float | None = now
        """Monotonic time since which this instance's heartbeats have kept succeeding."""
        self._last = now
        """Monotonic time of the last heartbeat the database accepted."""
        self.read_only = False
        """Whether the last beat found only a read-only server (read by readiness)."""
        self._hosts_reported: float | None = None
        self._hosts_report: asyncio.Task[None] | None = None

    @property
    def overdue(self) -> bool:
        """Whether peers would now judge this instance dead. One failed beat under load is not
        an outage: only a beat overdue by the TTL is."""
        return time.monotonic() - self._last > self._ttl

    def may_judge_peers(self) -> bool:
        """Whether this instance has heartbeated without a break for a whole TTL. After an
        outage every replica comes back at once; one that sweeps before its peers had a TTL
        to heartbeat again would take their healthy sidecars for lost."""
        since = self._since
        return since is not None and time.monotonic() - since >= self._ttl

    async def run(self) -> None:
        try:
            await self._beat()
        finally:
            # The report is this loop's own; it never outlives it.
            await self._end_report()

    async def _beat(self) -> None:
        instances, instance_id = self._parts.instances, self._parts.instance_id
        last_success = time.monotonic()
        # After a database restart every pooled connection is dead, and each would cost one
        # failed beat: retry soon, since peers count this instance dead after one TTL.
        retries = Retries.doubling(0.2, min(self._interval, FAILING_RETRY_CAP))
        pause = self._interval
        failing = False
        failures = 0
        logged: float | None = None
        while True:
            raise_if_cancelled()
            await asyncio.sleep(pause)
            try:
                # A beat's budget is the interval: one held by a silent connection is a failed
                # beat (its connection closed, see Database.connection), retried soon on a
                # fresh one, not a wait for TCP to give up.
                async with asyncio.timeout(self._interval):
                    present = await instances.heartbeat(instance_id)
                    if not present:
                        # Removed by an operator or judged dead by a peer: come back, since
                        # our sockets are real.
                        await _register(self._parts, self._hub_ws_url, self._provisioner_ids)
                        log.warning("instance_row_missing_registered_again")
                now = time.monotonic()
                if not present or now - last_success > self._ttl:
                    # Peers may have swept our records as dead meanwhile (a database outage, a
                    # pause, a starved pool): write back the records of every socket still
                    # open here before anything else, so no healthy sidecar is released.
                    self._metrics.heartbeat_lapses.inc()
                    log.warning(
                        "heartbeat_lapsed_reasserting_sockets",
                        seconds_since_last=round(now - last_success, 1),
                    )
                    self._verify_soon.set()
                    self._since = now
                elif self._since is None:
                    self._since = now
                last_success = self._last = now
                self.read_only = False
                self._hosts_reported = None
                if failing:
                    # The database answers again. Whatever else was open across the outage
                    # may be dead without knowing it (a partition that dropped its packets):
                    # the notification listener reconnects now rather than at its next
                    # self-check, which may be a minute away.
                    failing = False
                    self._on_recovered()
                    # A report still waiting on a host would describe the outage that ended.
                    await self._end_report()
                retries.reset()
                pause = self._interval
                failures, logged = 0, None
                self._metrics.database_up.set(1)
            except (StoreError, TimeoutError) as exc:
                self._since = None
                self.read_only = isinstance(exc, DatabaseReadOnly)
                self._metrics.database_up.set(0)
                failures += 1
                now = time.monotonic()
                if logged is None or now - logged >= FAILED_LOG_INTERVAL:
                    logged = now
                    log.warning(
                        "heartbeat_failed",
                        error=str(exc) or "no answer within the interval",
                        failures=failures,
                    )
                failing = True
                # Replace every pooled connection, of every pool, at once: after a restart
                # each would cost one failed statement, and after a partition that dropped
                # its packets each would hold its caller until a budget ran out.
                await self._parts.db.expire_all()
                self._report_hosts_aside()
                pause = retries.next_delay()

    def _report_hosts_aside(self) -> None:
        """Say what each host of the URL answers, at most once per HOSTS_REPORT_INTERVAL, in a
        task beside the beats: a host that swallows packets takes the report's whole budget,
        which the next beat must not wait for (once a partition heals, that beat is what makes
        this instance ready again)."""
        now = time.monotonic()
        reported = self._hosts_reported
        if reported is not None and now - reported < HOSTS_REPORT_INTERVAL:
            return
        if self._hosts_report is not None and not self._hosts_report.done():
            return
        self._hosts_reported = now
        self._hosts_report = asyncio.create_task(
            self._report_hosts(), name="heartbeat-hosts-report"
        )

    async def _end_report(self) -> None:
        report, self._hosts_report = self._hosts_report, None
        if report is not None:
            report.cancel()
            # wait(), not await: the report's cancellation is not ours to raise, and ours
            # (the heartbeat's own) still is.
            await asyncio.wait([report])

    async def _report_hosts(self) -> None:
        try:
            hosts = await try_hosts(self._parts.dsn, within=min(self._interval, 5.0))
        except Exception as exc:  # noqa: BLE001 -- a diagnosis only: a failed one says so
            log.warning("database_hosts_not_tried", error=str(exc) or type(exc).__name__)
            return
        log.warning("database_hosts_tried", hosts=hosts)
