"""Keeping the warm pools full (docs/pools.md).

Each daemon writes the ``[[pools]]`` of its configuration at its start, then refills every pool
of a provisioner it serves: at once when the database says a member was taken (the take
notifies ``hubd_handover``), again soon while a pool still lacks members, and every
:data:`IDLE_INTERVAL` otherwise, which also replaces members that ended meanwhile. Any
replica may refill a pool; the pool's row lock makes one do it at a time, and the pool's
refill rate is counted in the database, so it holds across replicas. The members are claimed,
provisioned and watched like any allocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator, Sequence

import structlog
from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from hubd.aio import raise_if_cancelled
from hubd.config import PoolConfig
from hubd.errors import StoreError
from hubd.store.pools import Pool, PoolStats, PoolStore

__all__ = ["IDLE_INTERVAL", "PoolKeeper", "PoolMetrics"]

log = structlog.get_logger(__name__)

IDLE_INTERVAL = 5.0
"""The longest a pool goes without a refill: members that ended for good are replaced within
this. A take starts one at once; a member whose sidecar died is replaced by the reconciler as
any allocation is. Each turn is a transaction, one of the few an idle daemon makes."""
BUSY_INTERVAL = 0.05
"""The wait before the next turn while a pool still lacks members, and the least time between
two turns whatever nudged them."""
MOST_PER_TURN = 500
"""Members one statement makes at most, whatever the refill rate allows."""
ORPHAN_TURNS = 12
"""Turns between two looks for members of pools no longer configured."""


class PoolMetrics:
    """The pools' gauges and counters, from the last count of the metrics' scrape."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.made = Counter(
            "hubd_pool_members_made",
            "Pool members this daemon requested to refill its pools",
            ["pool"],
            registry=registry,
        )
        self.released = Counter(
            "hubd_pool_members_released",
            "Pool members this daemon released as surplus (a pool shrunk, changed or removed)",
            ["pool"],
            registry=registry,
        )
        self._collector = _PoolCollector()
        registry.register(self._collector)

    def set_stats(self, stats: Sequence[PoolStats]) -> None:
        self._collector.stats = tuple(stats)


class _PoolCollector(Collector):
    """Rebuilt from the last count at every scrape: one label per pool in the database."""

    def __init__(self) -> None:
        self.stats: tuple[PoolStats, ...] = ()

    def collect(self) -> Iterator[Metric]:
        size = GaugeMetricFamily("hubd_pool_size", "Members each pool keeps", labels=["pool"])
        members = GaugeMetricFamily(
            "hubd_pool_members",
            "Members no request took yet, by pool and state (ready, or starting: on their way)",
            labels=["pool", "state"],
        )
        taken = CounterMetricFamily(
            "hubd_pool_takes",
            "Requests that took a ready member (hits), by pool; a take rolled back counts too",
            labels=["pool"],
        )
        missed = CounterMetricFamily(
            "hubd_pool_misses",
            "Requests that matched a pool and found no ready member (made cold), by pool",
            labels=["pool"],
        )
        for pool in self.stats:
            size.add_metric([pool.id], pool.size)
            members.add_metric([pool.id, "ready"], pool.ready)
            members.add_metric([pool.id, "starting"], pool.starting)
            taken.add_metric([pool.id], pool.taken)
            missed.add_metric([pool.id], pool.missed)
        yield size
        yield members
        yield taken
        yield missed


class PoolKeeper:
    """Writes this daemon's pools, then keeps every pool of a provisioner it serves full."""

    def __init__(
        self,
        store: PoolStore,
        *,
        pools: Sequence[PoolConfig],
        served: Sequence[str],
        metrics: PoolMetrics,
    ) -> None:
        self._store = store
        self._pools = tuple(
            Pool(
                id=p.id,
                provisioner=p.provisioner,
                spec=p.spec,
                size=p.size,
                refill_rate=p.refill_rate,
                miss=p.miss,
                miss_wait=p.miss_wait,
            )
            for p in pools
        )
        self._served = tuple(served)
        self._metrics = metrics
        self._due = asyncio.Event()

    def nudge(self) -> None:
        """Something may have left a pool (a take, a release): refill soon."""
        self._due.set()

    async def run(self) -> None:
        """Write the pools, then refill them until cancelled; with none configured, release
        what the pools this configuration dropped held, and end."""
        while True:
            raise_if_cancelled()
            try:
                await self._store.set_pools(self._pools, served=self._served)
                if not self._pools:
                    await self._store.release_orphaned()
                    return
                break
            except StoreError as exc:
                log.warning("pools_not_written", error=str(exc))
                await asyncio.sleep(IDLE_INTERVAL)
        loop = asyncio.get_running_loop()
        last = -BUSY_INTERVAL
        for turn in itertools.count():
            raise_if_cancelled()
            # Turns at most BUSY_INTERVAL apart: takes at 100 a second, each heard by every
            # replica, are a refill statement per replica every 50 ms, not one per take.
            await asyncio.sleep(max(0.0, last + BUSY_INTERVAL - loop.time()))
            last = loop.time()
            wait = IDLE_INTERVAL
            # Cleared before the turn: a take heard during it brings the next one at once.
            self._due.clear()
            try:
                # Pools are removed only by a daemon's start, which releases their members
                # itself; this is for one that stopped before it could.
                if turn % ORPHAN_TURNS == 0:
                    released = await self._store.release_orphaned()
                    if released:
                        log.info("pool_members_orphaned_released", count=released)
                for pool in self._pools:
                    refilled = await self._store.refill(pool.id, most=MOST_PER_TURN)
                    if refilled.made:
                        self._metrics.made.labels(pool=pool.id).inc(refilled.made)
                    if refilled.released:
                        self._metrics.released.labels(pool=pool.id).inc(refilled.released)
                        log.info("pool_surplus_released", pool=pool.id, count=refilled.released)
                    if refilled.lacking:
                        wait = BUSY_INTERVAL
            except StoreError as exc:
                log.warning("pool_refill_failed", error=str(exc))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await self._due.wait()
