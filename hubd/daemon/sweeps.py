"""The daemon's periodic work besides claiming: socket checks, repair, orphans, watchdog (the
heartbeat and the watch on the feed's lock are loops of their own modules, held here).

Each loop survives a failing database (it logs and tries again at its next turn); none of them
is a claim, so none of them holds a lease.
"""

from __future__ import annotations

import asyncio
import contextlib

import attrs
import structlog

from hubd.aio import raise_if_cancelled
from hubd.config import Config
from hubd.daemon.feedwatch import FeedLockWatch
from hubd.daemon.heartbeat import Heartbeat
from hubd.daemon.metrics import Metrics
from hubd.daemon.pools import PoolKeeper
from hubd.daemon.running import Running
from hubd.daemon.systemd import notify, watchdog_interval
from hubd.errors import StoreError
from hubd.liveness import swept_reconnect_window
from hubd.reconciler.orphans import OrphanCollector
from hubd.store.allocations import ProvisionerLimits
from hubd.store.events import EventStore

__all__ = ["DEADLINE_INTERVAL", "DEAD_INSTANCE_TTLS", "Sweeps"]

log = structlog.get_logger(__name__)

DEAD_INSTANCE_TTLS = 10
"""An instance row is deleted once its heartbeat is this many TTLs old."""
STALE_TAKE = 1.0
"""Seconds after which the socket check announces a take wherever its sidecar is: the replica
holding its socket announces it within milliseconds, unless it died or froze."""
DEADLINE_INTERVAL = 1.0
"""The longest the deadline sweep waits between runs: an allocation made with a lifetime
after a run learns of it within this."""
DEADLINE_QUIET = 30.0
"""The longest it waits while no allocation is active: a request wakes it (``hubd_wake``, and a
re-opened listener's catch-up), so this only bounds a notification lost some other way."""
DEADLINE_FLOOR = 0.05
"""The shortest: a deadline the last run saw as passed (it moved it) is not run for again
at once."""


@attrs.frozen(kw_only=True)
class Sweeps:
    """The periodic loops, over what the daemon runs; also what the claim slots share."""

    config: Config
    running: Running
    metrics: Metrics
    heartbeat: Heartbeat
    feed_lock: FeedLockWatch
    verify_soon: asyncio.Event
    """Set when the sockets held here must be compared with the database soon."""
    pools: PoolKeeper

    async def socket_check(self) -> None:
        """Compare the sockets held here with the database: on demand (a lapsed heartbeat, a
        re-opened listener) and every repair interval as the fallback for lost notifications."""
        router, interval = self.running.router, self.config.reconciler.repair_interval
        while True:
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.verify_soon.wait()
            self.verify_soon.clear()
            try:
                reasserted, closed = await router.repair.verify()
            except StoreError as exc:
                log.warning("socket_check_failed", error=str(exc))
                # Try again soon: after an outage this is what restores readiness.
                await asyncio.sleep(min(interval, 1.0))
                self.verify_soon.set()
                continue
            self.metrics.connections_reasserted.inc(reasserted)
            self.metrics.remote_closes.inc(closed)
            if reasserted or closed:
                log.info("socket_check", reasserted=reasserted, closed=closed)
            # A take whose notice this replica missed is announced, and its hand-over goes,
            # now; one whose replica died, once it is a second old (architecture §4, §8).
            resent = await router.handover.resend(stale_after=STALE_TAKE)
            if resent:
                log.info("handovers_resent", count=resent)

    async def orphans(self) -> None:
        """Sweep provisioners that can list their sidecars for orphans (one replica at a
        time per provisioner, elected by a row lock in ``hubd_sweep_locks``)."""
        cfg, running = self.config.orphans, self.running
        collector = OrphanCollector(
            store=running.store,
            ledger=running.ledger,
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
                await collector.sweep_all(running.provisioners)
            except (StoreError, TimeoutError) as exc:
                log.warning("orphan_sweep_failed", error=str(exc))

    async def repair(self) -> None:
        interval = self.config.reconciler.repair_interval
        ttl = self.config.instance.ttl
        swept_window = swept_reconnect_window(self.config.reconciler.connect_timeout)
        connections, instances = self.running.parts.connections, self.running.parts.instances
        events = EventStore(self.running.parts.db)
        while True:
            raise_if_cancelled()
            await asyncio.sleep(interval)
            try:
                # Records of instances that stopped heartbeating (never our own: our sockets
                # are open, whatever our heartbeat says) are cleared, in one statement. Their
                # sidecars may not know yet: a frozen replica's sockets stay open, so the
                # deadline first allows for the sidecar's keepalive to notice, then the usual
                # connect deadline to come back to a live replica.
                swept = (
                    await connections.sweep_stale(ttl, connect_timeout=swept_window)
                    if self.heartbeat.may_judge_peers()
                    else []
                )
                if swept:
                    self.metrics.connections_swept.inc(len(swept))
                    log.warning(
                        "dead_instance_connections_swept",
                        count=len(swept),
                        instances=sorted({s.instance_id for s in swept}),
                    )
                repaired = (
                    await self.running.reconciler.repair_unscheduled_connections()
                    if self.heartbeat.may_judge_peers()
                    else 0
                )
                if repaired:
                    log.info("unscheduled_allocations_repaired", count=repaired)
                deleted = await instances.delete_dead(ttl * DEAD_INSTANCE_TTLS)
                if deleted:
                    self.metrics.instances_deleted.inc(len(deleted))
                    log.info("dead_instances_deleted", instances=deleted)
                # Every replica prunes; each statement takes the oldest batch, so two replicas
                # pruning at once only delete sooner.
                pruned = await events.prune(self.config.events.retention)
                if pruned:
                    log.info("events_pruned", count=pruned)
            except StoreError as exc:
                log.warning("repair_sweep_failed", error=str(exc))

    async def deadlines(self, requested: asyncio.Event) -> None:
        """End what expired, fail what no daemon took in time, warn of what expires soon:
        every second at most, sooner when the next deadline the last run saw is nearer. Any
        replica may run it first; a row is moved once. While no allocation is active nothing
        can come due, and it waits for ``requested`` (set by every ``hubd_wake``: a request,
        a pool's refill) instead, so an idle daemon commits no sweep a second."""
        rc, store, metrics = self.config.reconciler, self.running.store, self.metrics
        limits = {
            p.id: ProvisionerLimits(
                max_lifetime=p.max_lifetime,
                pending_timeout=rc.pending_timeout,
                idle_timeout=p.idle_timeout,
                provisioning_timeout=p.provisioning_timeout or rc.provisioning_timeout,
            )
            for p in self.config.provisioners
        }
        while True:
            raise_if_cancelled()
            try:
                await store.set_limits(limits)
                break
            except StoreError as exc:
                log.warning("provisioner_limits_not_written", error=str(exc))
                await asyncio.sleep(DEADLINE_INTERVAL)
        while True:
            raise_if_cancelled()
            wait = DEADLINE_INTERVAL
            requested.clear()
            try:
                swept = await store.sweep_deadlines(
                    warning=rc.expiry_warning, pending_timeout=rc.pending_timeout
                )
            except StoreError as exc:
                log.warning("deadline_sweep_failed", error=str(exc))
            else:
                for kind, count in (
                    ("expired", swept.expired),
                    ("idle", swept.idle),
                    ("provisioning_timeout", swept.provisioning_timeout),
                    ("unserved", swept.unserved),
                    ("expiring", swept.warned),
                ):
                    if count:
                        metrics.deadlines.labels(kind=kind).inc(count)
                if swept.expired or swept.idle or swept.provisioning_timeout or swept.unserved:
                    log.info(
                        "deadlines_reached",
                        expired=swept.expired,
                        idle=swept.idle,
                        provisioning_timeout=swept.provisioning_timeout,
                        unserved=swept.unserved,
                    )
                if swept.next_in is not None:
                    wait = min(wait, max(swept.next_in, DEADLINE_FLOOR))
                elif not swept.active:
                    # Cleared before the sweep: a request committed after its snapshot
                    # notifies after the clear, so it is never slept through.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(DEADLINE_QUIET):
                            await requested.wait()
                    continue
            await asyncio.sleep(wait)


async def watchdog() -> None:
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        raise_if_cancelled()
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
