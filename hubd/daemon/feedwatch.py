"""The watch on the event feed's lock: who holds it, how long commits wait for it, the cut-off.

Every commit that changes an allocation takes the feed's lock (``hubd_feed_lock``) for its last
moments, so positions are commit order (docs/api.md). An application role cannot lock the table,
but a transaction that runs ``SET CONSTRAINTS ALL IMMEDIATE`` after a request takes it at once and
holds it for as long as it stays open: every other such commit, the daemon's own included, waits.
The watch reads ``pg_locks`` on the lease pool, which never waits for that lock (see
:mod:`hubd.store.events`): every second while a reading found the lock held or waited for, and
otherwise every ``events.lock_wait_alarm`` (5 s at the default), so an idle daemon does not
commit a reading a second. A wait can only begin while the lock is held, so the first reading
after a hold began sees the holder before any wait has reached the alarm, and the readings go
to every second: a wait past the alarm is seen within a second. While the longest wait is past
``events.lock_wait_alarm`` ``/readyz`` names the holder, and past ``events.lock_hold_limit`` a
holder of another role than the daemon's is ended (docs/operations.md, "The feed's lock"). Every
replica watches; when two end the same holder, the second finds it gone.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import Final, Protocol

import attrs
import structlog

from hubd.aio import raise_if_cancelled
from hubd.daemon.metrics import Metrics
from hubd.errors import StoreError
from hubd.store.events import FeedLock, FeedLockHolder, Outcome, Termination

__all__ = ["CHECK_INTERVAL", "FeedLockStore", "FeedLockWatch", "Judgement", "judge"]

log = structlog.get_logger(__name__)

CHECK_INTERVAL: Final = 1.0
"""Seconds between two readings at most while the lock is held or waited for (one cheap
statement each)."""

CHECK_BUDGET: Final = 5.0
"""Seconds one reading and its cut-off may take."""

REFUSAL_RETRY: Final = 30.0
"""Seconds before a holder whose end the server refused is tried again: the grant may have come
meanwhile, and every refusal is an error in the server's log too."""


class FeedLockStore(Protocol):
    """What the watch asks of the store (:class:`hubd.store.events.EventStore`)."""

    async def feed_lock(self) -> FeedLock: ...

    async def terminate_feed_lock_holder(
        self, pid: int, *, waited: float | None = None
    ) -> Termination: ...


@attrs.frozen(kw_only=True)
class Judgement:
    """What one reading calls for."""

    problem: str | None
    """What ``/readyz`` says while a commit has waited past the alarm; ``None`` otherwise."""
    cut_off: int | None
    """The holder's pid to end, when its commits have waited past the hold limit."""


def judge(lock: FeedLock, *, alarm: float, limit: float) -> Judgement:
    """What a reading of the lock calls for, given the alarm and the hold limit."""
    if lock.longest_wait <= alarm:
        return Judgement(problem=None, cut_off=None)
    holder = lock.holder
    waiting = "1 commit waits" if lock.waiters == 1 else f"{lock.waiters} commits wait"
    problem = (
        f"event feed: {waiting} for its lock, the longest {lock.longest_wait:.1f}s, "
        f"held by {describe(holder)}"
    )
    cut_off = None
    if lock.longest_wait > limit and holder is not None and not holder.own_role:
        cut_off = holder.pid  # None for a prepared transaction: no backend to end
    return Judgement(problem=problem, cut_off=cut_off)


def describe(holder: FeedLockHolder | None) -> str:
    """The holder as an operator looks it up in ``pg_stat_activity``."""
    if holder is None:
        # Only plain reads hold it, and the waiter wants a stronger lock than a commit's (a
        # migration's): nothing here is the application's doing.
        return "no transaction that blocks commits"
    if holder.pid is None:
        return "a prepared transaction (pg_prepared_xacts)"
    state = f", {holder.state}" if holder.state else ""
    own = ", hubd's own role" if holder.own_role else ""
    return f"pid {holder.pid} (role {holder.role or '?'}{own}{state})"


class FeedLockWatch:
    """The loop that reads the lock, and what it found: :attr:`problem` for readiness."""

    def __init__(
        self,
        events: FeedLockStore,
        metrics: Metrics,
        *,
        alarm: float,
        limit: float,
        interval: float = CHECK_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._events = events
        self._metrics = metrics
        self._alarm = alarm
        self._limit = limit
        self._interval = min(interval, alarm / 2)
        self._quiet_interval = max(self._interval, alarm)
        self._busy = False
        """Whether the last reading found the lock held or waited for."""
        self._clock = clock
        self.problem: str | None = None
        """Read by readiness on the admin thread: one reference, replaced whole."""
        self._warned: set[int | None] = set()
        """Holders warned about while the alarm lasts: one warning each."""
        self._refused: dict[int, float] = {}
        """Holders the server would not end, and when it last said so."""
        self._failing = False

    async def run(self) -> None:
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.interval)
            try:
                async with asyncio.timeout(CHECK_BUDGET):
                    await self.check()
            except (StoreError, TimeoutError) as exc:
                # An outage meets every reading: said once, and readiness has the heartbeat's
                # word for it.
                if not self._failing:
                    log.warning("feed_lock_check_failed", error=str(exc) or "no answer in time")
                self._failing = True
            else:
                self._failing = False

    @property
    def interval(self) -> float:
        """Seconds until the next reading."""
        return self._interval if self._busy or self._failing else self._quiet_interval

    async def check(self) -> Judgement:
        """One reading: the metrics, readiness and the log brought up to it, and a holder past
        the limit ended."""
        lock = await self._events.feed_lock()
        self._busy = lock.holder is not None or lock.waiters > 0
        self._metrics.feed_lock_waiters.set(lock.waiters)
        self._metrics.feed_lock_wait.set(lock.longest_wait)
        verdict = judge(lock, alarm=self._alarm, limit=self._limit)
        self._report(lock, verdict)
        if verdict.cut_off is not None:
            await self._cut_off(lock, verdict.cut_off)
        return verdict

    def _report(self, lock: FeedLock, verdict: Judgement) -> None:
        if verdict.problem is None:
            if self.problem is not None:
                log.info("feed_lock_wait_ended", waiters=lock.waiters)
            self.problem = None
            self._warned.clear()
            self._refused.clear()
            return
        self.problem = verdict.problem
        holder = lock.holder
        pid = None if holder is None else holder.pid
        if pid in self._warned:
            return
        self._warned.add(pid)
        log.warning(
            "feed_lock_commits_waiting",
            waiters=lock.waiters,
            longest_wait=round(lock.longest_wait, 1),
            holder=describe(holder),
            holder_pid=pid,
            holder_role=None if holder is None else holder.role,
            hint=self._hint(holder),
        )

    def _hint(self, holder: FeedLockHolder | None) -> str:
        if holder is None or holder.pid is None:
            return "look the holder up in pg_locks (relation hubd_feed_lock) and end it"
        if holder.own_role:
            return (
                "a session of hubd's own role holds it and is never ended by hubd: end it "
                f"(SELECT pg_terminate_backend({holder.pid})) or let it commit"
            )
        return f"it is ended once commits have waited {self._limit:g}s (events.lock_hold_limit)"

    async def _cut_off(self, lock: FeedLock, pid: int) -> None:
        refused_at = self._refused.get(pid)
        if refused_at is not None and self._clock() - refused_at < REFUSAL_RETRY:
            return
        # The statement checks the wait again: this reading may be from before a pause.
        done = await self._events.terminate_feed_lock_holder(pid, waited=self._limit)
        role = None if lock.holder is None else lock.holder.role
        if done.outcome is Outcome.TERMINATED:
            self._metrics.feed_lock_terminations.inc()
            log.warning(
                "feed_lock_holder_terminated",
                holder_pid=pid,
                holder_role=role,
                longest_wait=round(lock.longest_wait, 1),
                limit=self._limit,
            )
        elif done.outcome is Outcome.REFUSED:
            first = refused_at is None
            self._refused[pid] = self._clock()
            if first:
                log.error(
                    "feed_lock_holder_not_terminated",
                    holder_pid=pid,
                    holder_role=role,
                    error=done.refusal,
                    hint=(
                        f"hubd's role {lock.own_role} may not end other roles' backends: on an "
                        "external PostgreSQL, GRANT pg_signal_backend TO "
                        f"{_ident(lock.own_role)} (a superuser's backend only a superuser may "
                        "end); until then end it by hand"
                    ),
                )


def _ident(name: str) -> str:
    """``name`` as an SQL identifier, quoted where it must be."""
    if re.fullmatch(r"[a-z_][a-z0-9_$]*", name):
        return name
    return '"' + name.replace('"', '""') + '"'
